"""On CUDA (skipped elsewhere): capturable=True, which eager accepts only for device params,
and the eager paths of every optimizer with a float lr changed by a scheduler.

Compiled vs eager on copies of one model over 4 steps, params and every state tensor. The
tolerance is what eager needs between its own foreach and for-loop paths on this device
(floored at 1e-6), as in test_parity_matrix.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optcompile
import pytest
import torch
from optcompile.testing import set_grads, small_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

optim = torch.optim
CAPTURABLE = {
    "Adam": lambda ps, f: optim.Adam(ps, lr=1e-2, foreach=f, capturable=True),
    "AdamW amsgrad": lambda ps, f: optim.AdamW(
        ps, lr=1e-2, foreach=f, capturable=True, amsgrad=True, weight_decay=0.1
    ),
    "NAdam": lambda ps, f: optim.NAdam(ps, lr=1e-2, foreach=f, capturable=True),
    "RAdam": lambda ps, f: optim.RAdam(ps, lr=1e-2, foreach=f, capturable=True),
    "Adamax": lambda ps, f: optim.Adamax(ps, lr=1e-2, foreach=f, capturable=True),
    "Adadelta": lambda ps, f: optim.Adadelta(ps, foreach=f, capturable=True),
    "RMSprop centered": lambda ps, f: optim.RMSprop(
        ps, lr=1e-2, foreach=f, capturable=True, centered=True, momentum=0.5
    ),
    "Rprop": lambda ps, f: optim.Rprop(ps, lr=1e-2, foreach=f, capturable=True),
    "ASGD": lambda ps, f: optim.ASGD(ps, lr=1e-2, foreach=f, capturable=True),
}
DEFAULTS = {
    "Adam": lambda ps, f: optim.Adam(ps, lr=1e-2, foreach=f),
    "AdamW": lambda ps, f: optim.AdamW(ps, lr=1e-2, foreach=f),
    "NAdam": lambda ps, f: optim.NAdam(ps, lr=1e-2, foreach=f),
    "RAdam": lambda ps, f: optim.RAdam(ps, lr=1e-2, foreach=f),
    "Adamax": lambda ps, f: optim.Adamax(ps, lr=1e-2, foreach=f),
    "Adadelta": lambda ps, f: optim.Adadelta(ps, lr=1.0, foreach=f),
    "Adagrad": lambda ps, f: optim.Adagrad(ps, lr=1e-2, foreach=f),
    "RMSprop": lambda ps, f: optim.RMSprop(ps, lr=1e-2, foreach=f),
    "Rprop": lambda ps, f: optim.Rprop(ps, lr=1e-2, foreach=f),
    "SGD nesterov": lambda ps, f: optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, foreach=f),
    "ASGD": lambda ps, f: optim.ASGD(ps, lr=1e-2, foreach=f),
}
STEPS = 4


def _run(
    make: Callable[[list[torch.nn.Parameter]], Any],
    compiled: bool,
    schedule: bool,
    backend: str = "torch",
):
    model = small_model().cuda()
    opt = make(list(model.parameters()))
    if compiled:
        opt = optcompile.compile(opt, backend=backend)
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS) if schedule else None
    for step in range(STEPS):
        set_grads(model, step)
        opt.step()
        if sched is not None:
            sched.step()
    return model, opt


def _values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out.append(p.detach())
        out.extend(v for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor))
    return out


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True))


def _check(
    make_for: Callable[[bool], Any],
    foreach: bool,
    schedule: bool,
    backend: str = "torch",
    floor: float = 1e-6,
) -> None:
    tolerance = max(
        _max_diff(
            _values(*_run(make_for(True), False, schedule)),
            _values(*_run(make_for(False), False, schedule)),
        ),
        floor,
    )
    model, opt = _run(make_for(foreach), True, schedule, backend)
    reference, eager = _run(make_for(foreach), False, schedule)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None, report.fallback_reason
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert set(opt.state[p]) == set(eager.state[q])
    assert _max_diff(_values(model, opt), _values(reference, eager)) <= tolerance


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("name", sorted(CAPTURABLE))
def test_capturable_on_cuda_matches_eager(name, foreach):
    _check(lambda f: lambda ps: CAPTURABLE[name](ps, f), foreach, schedule=False)


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_eager_paths_on_cuda_match_eager_under_a_scheduler_without_retrace(name, foreach):
    _check(lambda f: lambda ps: DEFAULTS[name](ps, f), foreach, schedule=True)
    _, opt = _run(lambda ps: DEFAULTS[name](ps, foreach), True, schedule=True)
    _, baseline = _run(lambda ps: DEFAULTS[name](ps, foreach), True, schedule=False)
    assert optcompile.explain(opt).traces == optcompile.explain(baseline).traces


# A comparison the host made (RAdam's rect > 5, default mode) once reached tl.where as a
# float (Triton warns it will refuse that): it must come back as a bool.
@pytest.mark.filterwarnings("error:tl.where with a non-boolean condition")
@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_auto_backend_fuses_cuda_steps_into_triton_kernels_matching_eager(name, foreach):
    """backend="auto" (the default) on CUDA params: the Triton kernels, with the user's
    default capturable=False (step counts on the CPU), under a cosine schedule. The kernels
    round each op separately where ATen fuses some into FMAs: tolerance floored at 1e-5."""
    _check(lambda f: lambda ps: DEFAULTS[name](ps, f), foreach, True, backend="auto", floor=1e-5)
    _, opt = _run(lambda ps: DEFAULTS[name](ps, foreach), True, True, backend="auto")
    _, baseline = _run(lambda ps: DEFAULTS[name](ps, foreach), True, False, backend="auto")
    report = optcompile.explain(opt)
    assert report.backend == "triton"
    assert "@triton.jit" in report.graph_code, report.graph_code[:300]
    assert 1 <= report.kernel_launches_per_step <= 2
    # No retrace for the schedule (SGD's lazily created momentum buffers trace twice anyway).
    assert report.traces == optcompile.explain(baseline).traces


def test_auto_backend_keeps_cpu_params_off_the_gpu_backend():
    """CPU params on a CUDA machine: the generated C where a compiler is found, else torch."""
    import shutil

    opt = optcompile.compile(optim.AdamW(small_model().parameters(), lr=1e-2))
    compiler = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
    assert optcompile.explain(opt).backend == ("cpu" if compiler else "torch")


def test_foreach_none_takes_the_foreach_path_on_cuda_like_eager():
    model = small_model().cuda()
    opt = optcompile.compile(optim.AdamW(model.parameters(), lr=1e-2), backend="torch")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert "_foreach_" in optcompile.explain(opt).graph_code


def test_triton_backend_on_cpu_params_runs_the_torch_backend_and_says_why():
    model, reference = small_model(), small_model()
    opt = optcompile.compile(optim.AdamW(model.parameters(), lr=1e-2), backend="triton")
    eager = optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(2):
        set_grads(model, step)
        set_grads(reference, step)
        opt.step()
        eager.step()
    assert _max_diff(_values(model, opt), _values(reference, eager)) <= 1e-6
    assert optcompile.explain(opt).graph_code.startswith("# not fused (its tensors live on cpu")


def _matrices() -> torch.nn.Module:
    torch.manual_seed(0)  # Muon takes 2-D parameters only: a tall, a square, a wide one
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8, bias=False),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 8, bias=False),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 3, bias=False),
    )


NEWER = {
    "Adafactor foreach": (lambda ps: optim.Adafactor(ps, lr=1e-2, foreach=True), small_model),
    "Adafactor": (lambda ps: optim.Adafactor(ps, lr=1e-2, weight_decay=0.1), small_model),
    "Muon": (lambda ps: optim.Muon(ps, lr=1e-2), _matrices),
    "Muon rms-matched lr": (
        lambda ps: optim.Muon(ps, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
        _matrices,
    ),
}


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("name", sorted(NEWER))
def test_adafactor_and_muon_on_cuda_match_eager_under_a_scheduler(name, backend):
    make, model_for = NEWER[name]
    runs = []
    for compiled in (True, False):
        model = model_for().cuda()
        opt = make(list(model.parameters()))
        if compiled:
            opt = optcompile.compile(opt, backend=backend)
        sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
        for step in range(STEPS):
            set_grads(model, step)
            opt.step()
            sched.step()
        runs.append((model, opt))
    (model, opt), (reference, eager) = runs
    report = optcompile.explain(opt)
    assert report.fallback_reason is None and report.traces == 1, report.retrace_reasons
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert set(opt.state[p]) == set(eager.state[q])
    assert _max_diff(_values(model, opt), _values(reference, eager)) <= 1e-5


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_adafactor_foreach_none_traces_the_for_loop_eager_takes_on_cuda(backend):
    """Adafactor's foreach=None is its for-loop on every device (``if foreach:``): the trace
    took the foreach path on CUDA (1e-3 apart from eager in float16; the differential test's
    long mode found it)."""
    make = lambda ps: optim.Adafactor(ps, lr=1e-2, foreach=None)  # noqa: E731
    model, opt = _run(make, True, True, backend)
    reference, eager = _run(make, False, True)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None, report.fallback_reason
    assert "_foreach_" not in report.graph_code
    assert _max_diff(_values(model, opt), _values(reference, eager)) <= 1e-5


@pytest.mark.parametrize("foreach", [True, False])
def test_triton_plan_on_the_torch_backend_takes_cpu_step_counts(foreach):
    """NAdam with capturable=False on backend "triton", a param the kernels do not take (a
    non-dense one): the torch backend runs the capturable-path graph with the CPU step
    counts, moving them to the device for ops that refuse CPU scalars (addcmul raised; the
    differential test's long mode found it)."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(4, 6, generator=gen), torch.randn((), generator=gen), torch.randn(5)]
    runs = []
    for compiled in (True, False):
        params = [
            torch.nn.Parameter(values[0].cuda()[:, ::2]),
            torch.nn.Parameter(values[1].cuda()),
            torch.nn.Parameter(values[2].cuda()),
        ]
        opt = optim.NAdam(params, lr=1e-2, foreach=foreach)
        if compiled:
            opt = optcompile.compile(opt, backend="triton")
        for step in range(3):
            grads = torch.Generator().manual_seed(10 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads).cuda()
            opt.step()
        runs.append((params, opt))
    (params, opt), (reference, eager) = runs
    assert optcompile.explain(opt).fallback_reason is None
    for p, q in zip(params, reference, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for key, value in eager.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=1e-5, atol=1e-6)
