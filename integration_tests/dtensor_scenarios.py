"""Sharded-training scenarios run by test_dtensor.py in each of two spawned gloo processes.

Each scenario compiles an optimizer over a small FSDP2 (``fully_shard``) transformer, steps it
beside eager torch.optim over a twin model (same seed, same batches), and raises on any
difference in parameters or state. ``main`` runs them all on one rank and writes, per
scenario, "ok" or the error to ``<out>/rank<r>.json``: one spawn serves the whole module.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import optcompile
import torch
import torch.distributed as dist
from dtensor_setup import (
    ClippedSGD,
    Lamb,
    Lars,
    Tiny,
    assert_collectives,
    assert_same,
    backward,
    copy_grads,
    init_group,
    local,
    model_2d,
    no_fallback,
    run_each,
    run_pair,
    sharded_model,
    step_2d,
    step_pair,
    traces,
)
from step_optimizers import Lion
from torch import nn


def adamw_with_scheduler() -> None:
    sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1))  # noqa: E731
    _, opt, _, _ = run_pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), schedule=sched)
    assert traces(opt) == 1, optcompile.explain(opt).retrace_reasons


def adamw_for_loop() -> None:
    _, opt, _, _ = run_pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False))
    assert traces(opt) == 1, optcompile.explain(opt).retrace_reasons


def sgd_momentum_with_scheduler() -> None:
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5)  # noqa: E731
    _, opt, _, _ = run_pair(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), schedule=sched)
    # (the momentum buffers are made by the first step: one retrace, as for plain tensors)
    assert traces(opt) == 2, optcompile.explain(opt).retrace_reasons


def custom_lion() -> None:
    _, opt, _, _ = run_pair(lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1))
    assert traces(opt) == 2, optcompile.explain(opt).retrace_reasons


def adafactor() -> None:
    # Eager Adafactor fails on sharded matrices in torch itself (an in-place pow_ of a
    # partial norm); its vector path (norms, biases) is what eager FSDP2 can run. Its lerp_
    # by a weight read from a tensor goes through DTensor's C++ sharding cache, which
    # compares such weights of two calls (by node: nothing is decided on a value). Its
    # ``param.norm(2).item()`` reads the partial norm of the local shard, in eager DTensor as
    # here (DTensor's rules call for no all-reduce there): compiled equals eager, one trace.
    vectors = lambda m: [p for p in m.parameters() if p.dim() == 1]  # noqa: E731
    for foreach in (False, True):
        make = functools.partial(torch.optim.Adafactor, lr=1e-2, foreach=foreach)
        _, opt, _, _ = run_pair(make, params=vectors)
        assert traces(opt) == 1, optcompile.explain(opt).retrace_reasons
    # On sharded matrices the trace meets eager's own error: a FallbackWarning that names
    # it, then eager raises it.
    errors = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for compiled in (True, False):
            model = sharded_model()
            opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
            backward(model, 0)
            try:
                (optcompile.compile(opt) if compiled else opt).step()
            except RuntimeError as exc:
                errors.append(str(exc).splitlines()[0])
    assert len(errors) == 2 and errors[0] == errors[1], errors
    assert "in-place operations that require placement changes" in errors[0], errors
    fallbacks = [str(w.message) for w in caught if w.category is optcompile.FallbackWarning]
    assert len(fallbacks) == 1 and errors[0] in fallbacks[0], fallbacks


def clip_grad_norm_before_step() -> None:
    clip = lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)  # noqa: E731
    _, opt, _, _ = run_pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), before_step=clip)
    assert traces(opt) == 1


def global_norm_inside_step() -> None:
    _, opt, _, _ = run_pair(lambda ps: ClippedSGD(ps))
    explanation = optcompile.explain(opt)
    assert "all_reduce" in explanation.graph_code, explanation.graph_code
    assert any("all_reduce" in c for c in explanation.collectives), explanation.collectives
    assert "collectives" in str(explanation)


def lamb_trust_ratios() -> None:
    # Per tensor (a for-loop): the norms of a sharded param and of its update are partial
    # sums; DTensor all-reduces them where its rules say (here before each use of a norm, as
    # in eager). The state is made in the first step: one retrace, as for plain tensors.
    _, opt, _, _ = run_pair(Lamb, steps=3)
    assert traces(opt) == 2, optcompile.explain(opt).retrace_reasons
    assert_collectives(opt, "all_reduce(sum)")


def lars_trust_ratios() -> None:
    _, opt, _, _ = run_pair(Lars, steps=3)
    assert traces(opt) == 2, optcompile.explain(opt).retrace_reasons
    assert_collectives(opt, "all_reduce(sum)")


def _matrices(model: nn.Module) -> list[Any]:
    """The model's 2-D parameters (Muon's): tall, wide and square ones."""
    return [p for p in model.parameters() if p.dim() == 2]


def muon_newton_schulz() -> None:
    # torch.optim.Muon over the sharded matrices (Shard(0)): its Newton-Schulz matmuls run
    # through DTensor's matmul rules, which pick the all-gathers and all-reduces.
    make = functools.partial(torch.optim.Muon, lr=1e-2, weight_decay=0.1)
    _, opt, _, _ = run_pair(make, steps=3, params=_matrices)
    assert traces(opt) == 1, optcompile.explain(opt).retrace_reasons
    assert_collectives(opt, "all_reduce(sum)", "all_gather_into_tensor")


def mixed_groups() -> None:
    def make(ps: list[Any]) -> torch.optim.Optimizer:
        torch.manual_seed(1)
        plain = nn.Linear(4, 4)
        for p in plain.parameters():
            p.grad = torch.ones_like(p)
        return torch.optim.AdamW([{"params": ps}, {"params": list(plain.parameters())}])

    def plain_grads(model: nn.Module) -> None:  # (zero_grad drops them each step)
        for o in optimizers:
            for p in o.param_groups[1]["params"]:
                p.grad = torch.ones_like(p)

    optimizers: list[torch.optim.Optimizer] = []
    remember = lambda ps: optimizers.append(make(ps)) or optimizers[-1]  # noqa: E731
    _, opt, _, eager = run_pair(remember, before_step=plain_grads)
    for p, q in zip(opt.param_groups[1]["params"], eager.param_groups[1]["params"], strict=True):
        torch.testing.assert_close(p, q)
    assert traces(opt) == 1, optcompile.explain(opt).retrace_reasons


def checkpoint_interchange(tmp: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def make(ps: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=1e-2)

    for saver_compiled in (False, True):
        path = os.path.join(tmp, f"ckpt-{saver_compiled}")
        saver, saver_opt = sharded_model(), None
        saver_opt = make(saver.parameters())
        if saver_compiled:
            saver_opt = optcompile.compile(saver_opt)
        for step in range(3):
            backward(saver, step)
            saver_opt.step()
            saver_opt.zero_grad()
        state = {"model": saver.state_dict(), "optim": get_optimizer_state_dict(saver, saver_opt)}
        dcp.save(state, checkpoint_id=path)
        # Load into a fresh pair: one compiled, one eager; both continue from the checkpoint.
        loaded = []
        for compiled in (True, False):
            model = sharded_model(seed=7)
            opt = make(model.parameters())
            if compiled:
                opt = optcompile.compile(opt)
            target = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(target, checkpoint_id=path)
            model.load_state_dict(target["model"])
            set_optimizer_state_dict(model, opt, target["optim"])
            loaded.append((model, opt))
        (model, opt), (ref, eager) = loaded
        for step in range(3, 5):
            backward(model, step)
            copy_grads(model, ref)
            copy_grads(model, saver)
            for o in (opt, eager, saver_opt):
                o.step()
                o.zero_grad()
        assert_same(model, opt, ref, eager)
        assert_same(model, opt, saver, saver_opt)


def checkpoint_reshards_into_a_2d_mesh(tmp: str) -> None:
    # Saved by a compiled FSDP2 run (Shard(0) over both ranks), loaded by DCP into compiled
    # and eager 2-D models (other placements: resharded); both continue equal.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = os.path.join(tmp, "ckpt-reshard")
    saver = sharded_model()
    saver_opt = optcompile.compile(torch.optim.AdamW(saver.parameters(), lr=1e-2))
    for step in range(2):
        backward(saver, step)
        saver_opt.step()
        saver_opt.zero_grad()
    state = {
        "model": get_model_state_dict(saver),
        "optim": get_optimizer_state_dict(saver, saver_opt),
    }
    dcp.save(state, checkpoint_id=path)
    loaded = []
    for compiled in (True, False):
        model = model_2d(seed=7)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if compiled:
            opt = optcompile.compile(opt)
        target = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
        }
        dcp.load(target, checkpoint_id=path)
        set_model_state_dict(model, target["model"])
        set_optimizer_state_dict(model, opt, target["optim"])
        loaded.append((model, opt))
    (model, opt), (ref, eager) = loaded
    for p, q in zip(model.parameters(), saver.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            mine, saved = opt.state[p][key], saver_opt.state[q][key]
            assert mine.placements == p.placements, (key, mine.placements, p.placements)
            torch.testing.assert_close(mine.full_tensor(), saved.full_tensor(), rtol=0, atol=0)
    step_2d([(model, opt), (ref, eager)], range(2, 4))
    assert_same(model, opt, ref, eager)
    assert traces(opt) == 1, optcompile.explain(opt).retrace_reasons


def ddp_unchanged() -> None:
    from torch.nn.parallel import DistributedDataParallel

    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return DistributedDataParallel(Tiny())

    model, ref = make_model(), make_model()
    opt = optcompile.compile(torch.optim.AdamW(model.parameters(), lr=1e-2))
    eager = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step_pair(model, opt, ref, eager, 5)
    assert_same(model, opt, ref, eager)
    assert traces(opt) == 1


def placements_change_retraces() -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    @optcompile.compile
    def scale(xs: list[torch.Tensor], factor: float) -> None:
        torch._foreach_mul_(xs, factor)

    full = torch.arange(8.0).reshape(4, 2)
    for placement in (Shard(0), Shard(0), Replicate()):
        x = distribute_tensor(full.clone(), mesh, [placement])
        scale([x], 0.5)
        torch.testing.assert_close(x.full_tensor(), full * 0.5)
    explanation = optcompile.explain(scale)
    assert explanation.traces == 2, explanation.retrace_reasons
    reason = explanation.retrace_reasons[-1]
    assert "placements" in reason and "Replicate" in reason, reason


def native_checks_catch_dtensor_changes() -> None:
    """The fast tier checks DTensors in C++ (mesh, placements, local tensor of the params,
    their grads and the state): a hit needs no Python per DTensor, and each change in place
    is still caught, with a reason naming it; a new but equal local tensor object at the
    same address keeps the trace."""
    from optguard import native
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    model, opt, ref, eager = run_pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), steps=3)
    if native.module() is not None:  # (else the same checks run in the tree and Python)
        code = optcompile.explain(opt).check_code
        assert "pinned DTensors keep mesh and placements" in code, code
        assert "their DTensors keep mesh and placements" in code, code
    ps, qs = list(model.parameters()), list(ref.parameters())

    def replicate_in_place(t: Any) -> None:  # the same object, gathered (valid on any world)
        full = t.redistribute(placements=[Replicate()])
        t._spec, t._local_tensor = full._spec, full._local_tensor

    def state_local(o: Any, q: Any) -> None:
        st = o.state[q]["exp_avg"]
        st._local_tensor = st._local_tensor.clone()

    def same_address(o: Any, q: Any) -> None:  # another object, the same storage
        q._local_tensor = q._local_tensor.view_as(q._local_tensor)

    def equal_spec(o: Any, q: Any) -> None:  # another but equal spec (==, not identity)
        g = q.grad
        g._spec = DTensorSpec(g._spec.mesh, tuple(g._spec.placements), g._spec.tensor_meta)

    def param_local(o: Any, q: Any) -> None:
        q._local_tensor = q._local_tensor.clone()

    def grad_placements(o: Any, q: Any) -> None:
        replicate_in_place(q.grad)

    def state_placements(o: Any, q: Any) -> None:
        replicate_in_place(o.state[q]["exp_avg_sq"])

    changes = [
        (state_local, 0, "['exp_avg']._local_tensor: data pointer changed"),
        (same_address, 1, None),
        (equal_spec, 2, None),
        (param_local, 3, "._local_tensor: data pointer changed"),
        (state_placements, 5, "['exp_avg_sq'].placements: value changed"),
        # (last: the next backward's grads would be sharded again, another retrace)
        (grad_placements, 4, ".grad.placements: value changed"),
    ]
    for k, (change, i, reason) in enumerate(changes):
        before = traces(opt)
        backward(model, 10 + k)
        copy_grads(model, ref)
        for o, params in ((opt, ps), (eager, qs)):
            change(o, params[i])
            o.step()
        explanation = optcompile.explain(opt)
        if reason is None:
            assert explanation.traces == before, explanation.retrace_reasons
        else:
            assert explanation.traces == before + 1, (change.__name__, explanation.retrace_reasons)
            assert reason in explanation.retrace_reasons[-1], explanation.retrace_reasons[-1]
        for o in (opt, eager):
            o.zero_grad()
    assert_same(model, opt, ref, eager)


def fsdp_x_tensor_parallel() -> None:
    model, ref = model_2d(), model_2d()
    opt = optcompile.compile(torch.optim.AdamW(model.parameters(), lr=1e-2))
    eager = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step_2d([(model, opt), (ref, eager)], range(5))
    assert_same(model, opt, ref, eager)
    assert traces(opt) == 1, optcompile.explain(opt).retrace_reasons
    two_d = [p.placements for p in model.parameters() if len(p.placements) == 2]
    assert len(two_d) == 8 and any("Shard(dim=1)" in str(pl) for pl in two_d), two_d


def triton_backend_fuses_like_plain() -> None:
    # backend="triton" (under TRITON_INTERPRET=1 on the CPU): the sharded elementwise step
    # is the plain step over the local shards, so it fuses into the same launches.
    if os.environ.get("TRITON_INTERPRET") != "1":
        return  # (test_dtensor.py skips it then)

    def make(ps: list[Any]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)

    model, ref = sharded_model(), sharded_model()
    opt = optcompile.compile(make(list(model.parameters())), backend="triton")
    eager = make(list(ref.parameters()))
    plain = [nn.Parameter(local(p).detach().clone()) for p in model.parameters()]
    plain_opt = optcompile.compile(make(plain), backend="triton")
    for step in range(2):
        backward(model, step)
        copy_grads(model, ref)
        for p, q in zip(plain, model.parameters(), strict=True):
            p.grad = local(q.grad).clone()
        for o in (opt, eager, plain_opt):
            o.step()
            o.zero_grad()
    assert_same(model, opt, ref, eager)
    sharded, flat = optcompile.explain(opt), optcompile.explain(plain_opt)
    assert sharded.fallback_reason is None and "@triton.jit" in sharded.graph_code
    # One generated kernel over every lane (plus the small one that writes the 0-dim step
    # counts back: the step keeps them off the device here), the very kernels of the plain
    # step over the same local shards.
    code = sharded.graph_code
    kernels = [line for line in code.splitlines() if line.startswith("def foreach_")]
    assert len([k for k in kernels if "_small(" not in k]) == 1, code[:600]
    assert code == flat.graph_code
    assert sharded.kernel_launches_per_step == flat.kernel_launches_per_step
    assert not sharded.collectives, sharded.collectives
    for p, q in zip(plain, model.parameters(), strict=True):
        torch.testing.assert_close(p, local(q))
    # A global norm inside the step: the norms and their all-reduce (DTensor's rules) run on
    # the torch backend before the kernel; everything elementwise is one kernel.
    optcompile.reset()
    model, ref = sharded_model(), sharded_model()
    opt = optcompile.compile(ClippedSGD(model.parameters()), backend="triton")
    eager = ClippedSGD(ref.parameters())
    step_pair(model, opt, ref, eager, 2)
    assert_same(model, opt, ref, eager)
    explanation = optcompile.explain(opt)
    code = explanation.graph_code
    assert explanation.collectives == ["all_reduce(sum) of pow_tensor_scalar"], explanation
    prelude = code.split("\n", 3)[2]  # the "# partly fused: ..." line names what runs first
    assert prelude.startswith("# partly fused") and "all_reduce" in prelude, code[:800]
    kernels = [line for line in code.splitlines() if line.startswith("def foreach_")]
    assert len(kernels) == 1, kernels
    # Trust ratios, per tensor (LARS foreach, LAMB for-loop): each tensor's norms and
    # DTensor's all-reduces of them run in the prelude, each awaited there before the kernel
    # reads it (a kernel takes the result by address); what follows them is one kernel.
    for make in (Lars, Lamb):
        optcompile.reset()
        model, ref = sharded_model(), sharded_model()
        opt = optcompile.compile(make(model.parameters()), backend="triton")
        eager = make(ref.parameters())
        step_pair(model, opt, ref, eager, 2)
        assert_same(model, opt, ref, eager)
        assert_collectives(opt, "all_reduce(sum)")
        code = optcompile.explain(opt).graph_code
        prelude = code.split("\n", 3)[2]
        assert prelude.startswith("# partly fused") and "wait_tensor" in prelude, code[:800]
        kernels = [line for line in code.splitlines() if line.startswith("def foreach_")]
        assert len([k for k in kernels if "_small(" not in k]) == 1, kernels
        _assert_prelude_kept_out_of_graphs(opt)
    # Muon (defaults) over the sharded tall, wide and square matrices: the Newton-Schulz
    # matmuls with DTensor's all-gathers and all-reduces (and the momentum they read) run in
    # the prelude; the weight decay and the update, each matrix's lr scaled by its global
    # shape (a number per lane), in one kernel. The same bits as eager.
    optcompile.reset()
    model, ref = sharded_model(), sharded_model()
    opt = optcompile.compile(torch.optim.Muon(_matrices(model), lr=1e-2), backend="triton")
    eager = torch.optim.Muon(_matrices(ref), lr=1e-2)
    step_pair(model, opt, ref, eager, 2)
    assert_same(model, opt, ref, eager, rtol=0, atol=0)
    assert_collectives(opt, "all_reduce(sum)", "all_gather_into_tensor")
    code = optcompile.explain(opt).graph_code
    kernels = [line for line in code.splitlines() if line.startswith("def foreach_")]
    assert len(kernels) == 1 and code.split("\n", 3)[2].startswith("# partly fused"), kernels
    _assert_prelude_kept_out_of_graphs(opt)


def _assert_prelude_kept_out_of_graphs(opt: Any) -> None:
    """A prelude that runs DTensor's collectives is not recorded in a CUDA graph: the
    reason explain() gives on CUDA names the collective."""
    from optcompile.api import _compiled_of
    from optcompile.driver import newest

    entry = newest(_compiled_of(opt))
    assert entry is not None
    reason = entry.plan.plan.prelude_capture_reason()
    assert reason is not None and "collectives are kept out of CUDA graphs" in reason, reason


SCENARIOS: dict[str, Callable[..., None]] = {
    f.__name__: f
    for f in (
        adamw_with_scheduler,
        adamw_for_loop,
        sgd_momentum_with_scheduler,
        custom_lion,
        adafactor,
        clip_grad_norm_before_step,
        global_norm_inside_step,
        lamb_trust_ratios,
        lars_trust_ratios,
        muon_newton_schulz,
        mixed_groups,
        checkpoint_interchange,
        checkpoint_reshards_into_a_2d_mesh,
        ddp_unchanged,
        placements_change_retraces,
        native_checks_catch_dtensor_changes,
        fsdp_x_tensor_parallel,
        triton_backend_fuses_like_plain,
    )
}


def main(rank: int, world_size: int, out: str) -> None:
    os.environ.setdefault("OPTCOMPILE_NATIVE", "0")
    init_group("gloo", rank, world_size, out, 60)

    def checked(name: str, scenario: Callable[..., None]) -> Callable[[], None]:
        def call() -> None:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if name.startswith("checkpoint_"):
                    scenario(out)
                else:
                    scenario()
            no_fallback(caught)

        return call

    run_each(rank, out, {name: checked(name, s) for name, s in SCENARIOS.items()})


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
