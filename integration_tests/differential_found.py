"""Cases the differential test (test_differential.py) found, kept as explicit examples once
fixed: CI runs each of them before the drawn ones. Each comment says what it caught.
"""

from __future__ import annotations

from differential_cases import Case, Event, Group, N, Param, T

FOUND = [
    # The Triton plan's store of 0-dim results truncated bfloat16 under the interpreter
    # (fixed on main alongside the float64 lanes).
    Case("Adam", (Group((Param((), "bfloat16"),)),), steps=4, backend="triton"),
    # float64 with a Tensor lr on backend "triton" (CPU): the kernels computed the bias
    # corrections from float32 step counts where eager reads them as Python floats (4e-7
    # relative after two steps; fixed with the tracer's python_float marks).
    Case(
        "Adam",
        (Group((Param((3,), "float64"),)),),
        defaults={"lr": T(0.01), "foreach": False},
        steps=2,
        backend="triton",
        seed=2,
    ),
    # Tensor betas beside a bfloat16 group on backend "triton" (CPU): a prelude's 0-dim
    # bfloat16 cast of a beta went to the host, whose numpy has no bfloat16 (TypeError).
    Case(
        "Adam",
        (Group((Param((3,)),)), Group((Param((3,), "bfloat16"),))),
        defaults={"betas": (T(0.9), T(0.999)), "lr": T(0.01), "foreach": False},
        steps=2,
        backend="triton",
    ),
    # Rprop's for-loop over a 0-dim float16 param beside others, on the torch backend inside
    # a Triton plan: its 0-dim state was read in float64 as if it were a step count (the
    # sign test then took the wrong side).
    Case(
        "Rprop",
        (Group((Param((3,)), Param((), "float16"))),),
        defaults={"lr": T(0.01), "etas": (0.4, 1.5), "foreach": False},
        backend="triton",
    ),
    # Tensor betas on float64 with capturable=False, backend "triton": eager's bias
    # corrections are float32 tensor ops (1 - beta2 ** 3: ATen's x * x * x, whose float32
    # ulp is 2e-5 of it), the host computed them in double (7e-7 off in the params).
    Case(
        "Adam",
        (Group((Param((3,), "float64"), Param((), "float64"))),),
        defaults={"betas": (T(0.9), T(0.999)), "lr": 0.1, "foreach": False},
        backend="triton",
    ),
    # Adamax's for-loop over an empty strided bfloat16 param beside another: the batched
    # plan's run of eager's in-place op on strided half lanes took maximum(.., out=) for one.
    Case("Adamax", (Group((Param((0,), "bfloat16", layout="strided"), Param((3,)))),), steps=2),
    # Found by OPTCOMPILE_FUZZ_BACKEND=cpu|torch|triton campaigns (seeds 7, 9, 11-13, and the
    # default draw):
    # ASGD with Tensor lambd, alpha and t0 in a second group and a numpy lr, on the C loops'
    # torch-backend plan: its batched check handed numpy bools to aten._assert_scalar.
    Case(
        "ASGD",
        (
            Group((Param((3,)), Param((3,)))),
            Group(
                (Param((3,)),),
                {
                    "lambd": T(0.0001),
                    "alpha": T(0.75),
                    "t0": T(1000000.0),
                    "weight_decay": 0.0,
                    "maximize": False,
                },
            ),
        ),
        defaults={
            "lambd": 0.0001,
            "alpha": 0.75,
            "weight_decay": 0.0,
            "lr": N(0.01),
            "differentiable": False,
        },
        steps=2,
        none_grads=((), ()),
        share_grads=True,
        closure=True,
        hooks=True,
        events=(
            Event(after=0, kind="round_trip", args=("fresh", False)),
            Event(after=0, kind="deepcopy", args=None),
        ),
        backend="cpu",
    ),
    # ASGD over float32 and float64 params after a state_dict round trip (eta and mu cast to
    # each param's dtype): the C loops stacked a column of two dtypes (eta 803 for 0.01), and
    # the host computed the float64 eta in double where eager rounds it through float32.
    Case(
        "ASGD",
        (Group((Param((3,)),)), Group((Param((3,), "float64"),))),
        defaults={
            "lambd": 0.0001,
            "alpha": 0.75,
            "weight_decay": 0.0,
            "lr": N(0.01),
            "differentiable": False,
        },
        steps=2,
        none_grads=((), ()),
        share_grads=True,
        closure=True,
        hooks=True,
        events=(
            Event(after=0, kind="set", args=(0, "alpha", 0.75)),
            Event(after=0, kind="round_trip", args=("fresh", False)),
            Event(after=0, kind="deepcopy", args=None),
        ),
        backend="cpu",
    ),
    # Adafactor (eps[0]=None) over float32 and bfloat16 params in one group, on the C loops'
    # torch-backend plan: its compiling path clamped the bfloat16 param at float32's eps.
    Case(
        "Adafactor",
        (Group((Param((3,)),)),),
        defaults={"eps": (None, 0.001), "d": 1.0, "lr": N(0.01), "foreach": True},
        steps=2,
        none_grads=((), ()),
        share_grads=True,
        closure=True,
        hooks=True,
        events=(
            Event(after=0, kind="add_group", args=Group((Param((3,)), Param((1025,), "bfloat16")))),
            Event(after=0, kind="round_trip", args=("fresh", False)),
            Event(after=0, kind="deepcopy", args=None),
            Event(after=0, kind="scale_param", args=0),
        ),
        backend="cpu",
    ),
    # NAdam over 0-dim params in two groups on Triton's host mode: addcmul's value, an array
    # of the two groups' numbers, raised a ValueError.
    Case(
        "NAdam",
        (Group((Param(()),)), Group((Param(()),))),
        defaults={"eps": 1e-08, "weight_decay": 0.0, "lr": N(0.01), "differentiable": False},
        steps=2,
        none_grads=((), ()),
        closure=True,
        hooks=True,
        scheduler="StepLR",
        events=(
            Event(after=0, kind="round_trip", args=("fresh", False)),
            Event(after=0, kind="deepcopy", args=None),
            Event(after=0, kind="scale_param", args=0),
        ),
        backend="triton",
    ),
    # Adam foreach over a float64 and a complex64 param beside a float32 group: the prelude
    # (view_as_real's ops) computed the float64 param's bias corrections in float32.
    Case(
        "Adam",
        (
            Group((Param((3,)),)),
            Group((Param((3,)),)),
            Group((Param((3,)), Param((3,), "float64"), Param((3,), "complex64"))),
        ),
        defaults={
            "betas": (0.9, 0.999),
            "eps": 1e-08,
            "weight_decay": 0.0,
            "amsgrad": False,
            "lr": N(0.01),
            "foreach": True,
            "differentiable": False,
        },
        steps=2,
        none_grads=((), ()),
        share_grads=True,
        closure=True,
        hooks=True,
        scheduler="StepLR",
        events=(Event(after=0, kind="deepcopy", args=None),),
        backend="cpu",
    ),
    # RAdam with Tensor betas over a float64 param (its capturable path, the step count seen
    # in float64): eager's beta ** step with a Tensor beta is a float32 op.
    Case(
        "RAdam",
        (Group((Param((3,), "float64"),)),),
        defaults={
            "betas": (T(0.9), T(0.999)),
            "eps": 1e-08,
            "weight_decay": 0.0,
            "lr": T(0.01),
            "differentiable": False,
        },
        steps=2,
        none_grads=((), ()),
        share_grads=True,
        closure=True,
        hooks=True,
        events=(
            Event(after=0, kind="round_trip", args=("fresh", False)),
            Event(after=0, kind="deepcopy", args=None),
            Event(after=0, kind="scale_param", args=0),
        ),
    ),
    # NAdam foreach over a float64 param after a round trip (mu_product float64), Triton's
    # host mode: a widened prelude handed the kernels its step count in float64 (4% off).
    Case(
        "NAdam",
        (Group((Param((3,), "float64"),)),),
        defaults={
            "eps": 1e-08,
            "weight_decay": 0.0,
            "lr": N(0.01),
            "foreach": True,
            "differentiable": False,
        },
        steps=2,
        none_grads=((), ()),
        share_grads=True,
        closure=True,
        hooks=True,
        scheduler="StepLR",
        events=(
            Event(after=0, kind="set", args=(0, "betas", (0.9, 0.999))),
            Event(after=0, kind="round_trip", args=("fresh", False)),
            Event(after=0, kind="deepcopy", args=None),
            Event(after=0, kind="scale_param", args=0),
        ),
        backend="triton",
    ),
    # NAdam with weight decay over a float16 param on the C loops: ATen's CPU add rounds its
    # alpha to float16 first; the loops took it in float32 (exp_avg an ulp off in 4%).
    Case(
        "NAdam",
        (
            Group((Param((1,)), Param((3,)), Param((3,)))),
            Group((Param((3,)),)),
            Group((Param((3,)), Param((4097,), "float16"), Param((3,)), Param((3,)))),
        ),
        defaults={"weight_decay": 0.1, "lr": N(0.01), "differentiable": False},
        steps=2,
        none_grads=((), ()),
        closure=True,
        hooks=True,
        scheduler="LambdaLR",
        events=(Event(after=0, kind="deepcopy", args=None),),
        backend="cpu",
    ),
    # SGD over a 0-dim complex64 param beside a float32 one with a Tensor lr: the host was asked
    # to round a complex value (a KeyError while lowering); such a step is no lane program.
    Case(
        "SGD",
        (Group((Param((), "complex64"), Param((3,)))),),
        defaults={
            "momentum": 0.0,
            "dampening": 0.0,
            "weight_decay": 0.0,
            "nesterov": False,
            "lr": T(0.01),
            "differentiable": False,
        },
        steps=2,
        none_grads=((), ()),
        share_grads=True,
        closure=True,
        hooks=True,
        events=(
            Event(after=0, kind="round_trip", args=("fresh", False)),
            Event(after=0, kind="deepcopy", args=None),
            Event(after=0, kind="scale_param", args=0),
        ),
        backend="cpu",
    ),
    # ASGD with Tensor lambd, alpha and lr, one group switched to foreach (so its for-loop
    # group traced on the capturable path, the step count seen in float64): eager's
    # arithmetic with the Tensors is float32, the trace's was float64 (eta an ulp off).
    Case(
        "ASGD",
        (Group((Param((3,)),)), Group((Param((3,)),))),
        defaults={
            "lambd": T(0.0001),
            "alpha": T(0.75),
            "weight_decay": 0.0,
            "maximize": False,
            "lr": T(0.01),
            "differentiable": False,
        },
        steps=2,
        none_grads=((), ()),
        share_grads=True,
        closure=True,
        hooks=True,
        events=(
            Event(after=0, kind="set", args=(0, "foreach", True)),
            Event(after=0, kind="round_trip", args=("fresh", False)),
            Event(after=0, kind="deepcopy", args=None),
        ),
    ),
    # NAdam foreach over a complex64 param with a Tensor momentum_decay on Triton's host mode:
    # a part of the split graph with no tensor input (an IndexError while checking devices).
    Case(
        "NAdam",
        (
            Group(
                (Param((3,), "complex64"),),
                {"eps": 1e-08, "weight_decay": 0.0, "momentum_decay": 0.004, "foreach": True},
            ),
        ),
        defaults={"eps": 1e-08, "momentum_decay": T(0.004), "lr": T(0.01), "differentiable": False},
        steps=2,
        none_grads=((), ()),
        share_grads=True,
        closure=True,
        hooks=True,
        scheduler="StepLR",
        events=(
            Event(after=0, kind="set", args=(0, "betas", (0.9, 0.999))),
            Event(after=0, kind="round_trip", args=("fresh", False)),
            Event(after=0, kind="deepcopy", args=None),
            Event(after=0, kind="scale_param", args=0),
        ),
        backend="triton",
    ),
    # ASGD's for-loop over a 0-dim float32 param, a bfloat16 one, with a foreach group beside
    # them, on the torch backend: the foreach path's mu (``as_tensor(1 / max(1, step.item()
    # - t0))``) made the eager-path trace fail, so every group was traced on the capturable
    # path, where the for-loop's ops on a 0-dim or bfloat16 param are not eager's (an ulp off).
    Case(
        "ASGD",
        (
            Group((Param((3,)), Param(()))),
            Group((Param((3,)),), {"lambd": T(0.0001), "alpha": T(0.75), "foreach": True}),
        ),
        defaults={"alpha": T(0.75), "lr": T(0.01)},
        steps=2,
        events=(Event(after=0, kind="round_trip", args=("fresh", False)),),
    ),
    Case(
        "ASGD",
        (
            Group((Param((37,), "bfloat16"), Param((), "float16"))),
            Group((Param((5,)),), {"foreach": True}),
        ),
        defaults={"lr": T(0.01), "t0": 1.0},
        steps=4,
    ),
    # RAdam's for-loop with Tensor betas under OneCycleLR (which sets beta1 to a float): its
    # eager-path trace took Python's max of a tensor rho_t and failed, so the torch backend
    # ran the capturable path, an ulp off eager.
    Case(
        "RAdam",
        (Group((Param((3,)),)),),
        defaults={"betas": (T(0.9), T(0.999)), "lr": T(0.01)},
        steps=2,
        scheduler="OneCycleLR",
    ),
    # RAdam's for-loop switched to foreach after a step, float64, torch backend: the test
    # asked eager's bits of it (its exactness read the groups' options before the switch);
    # RAdam's foreach path is traced on its capturable path (within 1e-7 in float64).
    Case(
        "RAdam",
        (Group((Param((3,), "float64"),)),),
        defaults={"lr": N(0.01)},
        steps=2,
        events=(Event(after=0, kind="set", args=(0, "foreach", True)),),
    ),
]
