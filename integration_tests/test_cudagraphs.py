"""CUDA graphs for compiled steps (skipped without CUDA; run on the GPU machine).

Compiled (default options: backend and cudagraphs "auto") vs eager on copies of one model
over 10 steps with zero_grad(set_to_none=True) before every backward-like grad assignment
(new gradient tensors each step) and a cosine LR schedule: params and every state tensor
match, the step is recorded exactly once and replayed after that.
"""

from __future__ import annotations

import io

import optcompile
import pytest
import torch
from optguard import native
from step_optimizers import (
    ClippedAdam,
    ForeachLamb,
    StepScaledTrustSGD,
    TrustRatioSGD,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

optim = torch.optim
STEPS = 10
CASES = {
    "AdamW": lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "AdamW capturable": lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.1, capturable=True),
    "AdamW for-loop": lambda ps: optim.AdamW(ps, lr=1e-2, foreach=False),
    "SGD momentum": lambda ps: optim.SGD(ps, lr=1e-2, momentum=0.9),
    "SGD momentum nesterov for-loop": lambda ps: optim.SGD(
        ps, lr=1e-2, momentum=0.9, nesterov=True, foreach=False
    ),
}


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 7), torch.nn.LayerNorm(7)
    ).cuda()


def _pair(make):
    model, reference = _model(), _model()
    opt = optcompile.compile(make(list(model.parameters())))
    eager = make(list(reference.parameters()))
    schedules = [optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS) for o in (opt, eager)]
    return model, reference, opt, eager, schedules


def _step(models, opts, schedules, step):
    gen = torch.Generator().manual_seed(step)
    grads = [torch.randn(p.shape, generator=gen) for p in models[0].parameters()]
    for model, opt, schedule in zip(models, opts, schedules, strict=True):
        opt.zero_grad(set_to_none=True)
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.to(p.device)  # a new tensor: a new address every step
        opt.step()
        schedule.step()


def _assert_same(model, reference, opt, eager, rtol=1e-5, atol=1e-6):
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)
        for key, value in eager.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=rtol, atol=atol)


# Muon's Newton-Schulz matmuls are bfloat16: cuBLAS may pick another algorithm while a graph
# records them than eagerly, which moves the orthogonalized update by bfloat16 rounding
# (~4e-3 relative) and a param by lr times that.
PRELUDE_TOLERANCE = {"Muon": {"rtol": 1e-4, "atol": 1e-4}}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_graphed_step_matches_eager_over_ten_steps_with_one_recording(name):
    model, reference, opt, eager, schedules = _pair(CASES[name])
    for step in range(STEPS):
        _step((model, reference), (opt, eager), schedules, step)
    _assert_same(model, reference, opt, eager)
    report = optcompile.explain(opt)
    # SGD creates its momentum buffers in the first step: the second call traces again.
    assert report.fallback_reason is None and report.traces == (2 if "SGD" in name else 1)
    assert report.cudagraph_recordings == 1, report.cudagraphs
    # Each entry's first call runs (and compiles) eagerly; the next is recorded and replayed.
    assert report.cudagraph_replays == STEPS - report.traces
    assert report.kernel_launches_per_step == 1
    assert report.cudagraphs.startswith("graph #") and "1 recording(s)" in report.cudagraphs
    # The staged values (the schedule's lr each step; CPU step counts' host values) went to
    # the device through the CUDA driver, not copy_.
    staging = _plan(opt).staging
    sends, driver = staging.sends, staging.native_sends
    assert sends >= STEPS - 1 and driver == (sends if native.module() is not None else 0)


def _plan(opt):
    from optcompile.api import _OPTIMIZERS

    return _OPTIMIZERS[opt].cache.entries[0].value.plan.plan


def test_a_dropped_staging_ring_keeps_its_pinned_memory_until_its_copies_are_done():
    """A copy queued through the driver is unknown to torch's pinned-memory allocator: the
    ring waits for its stream before that memory can be handed out again."""
    from optkernels.staging import SLOTS, Staging

    if native.module() is None:
        pytest.skip(f"optguard's native module is not loaded: {native.status()}")
    device = torch.device("cuda")
    seen = torch.zeros(64, device=device)
    for value in (1.0, 2.0):
        staging = Staging()
        busy = torch.randn(4096, 4096, device=device)
        for _ in range(4):
            busy = busy @ busy / 4096  # the copy below waits behind this
        staging.begin()
        buffer, host = staging.stage(None, (64,), torch.float32, device)
        host[:] = value
        staging.send(buffer)
        staging.end()
        assert staging.native_sends == 1
        seen.add_(buffer)
        del staging, buffer, host  # the ring goes: its pinned memory back to torch
        for _ in range(SLOTS):  # handed out again at once, and overwritten
            torch.full((64,), -1000.0, pin_memory=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(seen.cpu(), torch.full((64,), 3.0), rtol=0, atol=0)


def test_a_ring_dropped_during_a_capture_holds_its_memory_until_a_later_round():
    """Waiting for a stream inside a CUDA graph capture would break the capture: the ring's
    pinned memory is held until the next round outside one."""
    from optkernels import staging as staging_module
    from optkernels.staging import Staging

    if native.module() is None:
        pytest.skip(f"optguard's native module is not loaded: {native.status()}")
    device = torch.device("cuda")
    staging = Staging()
    staging.begin()
    buffer, host = staging.stage(None, (8,), torch.float32, device)
    host[:] = 5.0
    staging.send(buffer)
    staging.end()
    assert staging.native_sends == 1
    out = torch.zeros(8, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(buffer * 2)
        del staging, host  # the ring goes while this thread captures
    assert len(staging_module._HELD) == 1
    graph.replay()
    later = Staging()
    later.begin()  # outside the capture: the held memory is waited for and let go
    assert staging_module._HELD == []
    torch.cuda.synchronize()
    assert out.tolist() == [10.0] * 8


def test_a_moved_parameter_is_caught_by_its_data_pointer_guard_and_recorded_anew():
    """Params and state are static inputs: each hit checks their addresses (one C++ loop),
    and a moved one sends the call to a new trace and recording, never to a stale table.
    The new entry differs from the old only in addresses: it replaces it (and its graph)."""
    model, reference, opt, eager, schedules = _pair(CASES["AdamW"])
    for step in range(3):
        _step((model, reference), (opt, eager), schedules, step)
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            p.data = p.data.clone()  # same values, new addresses
            q.data = q.data.clone()
    for step in range(3, 6):
        _step((model, reference), (opt, eager), schedules, step)
    _assert_same(model, reference, opt, eager)
    report = optcompile.explain(opt)
    assert report.traces == 2 and "data pointer" in report.retrace_reasons[0]
    assert report.entries == 1 and report.cudagraph_recordings == 1, report.cudagraphs
    assert report.cudagraph_replays == 2  # steps 4 and 5 (step 3 traced, recorded at 4)


# Steps whose ops the kernels cannot take (matmuls, norms) run them on the torch backend
# first (a prelude); the graph records them too.
PRELUDES = {
    "Muon": lambda ps: optim.Muon([p for p in ps if p.dim() == 2], lr=1e-2),
    "LAMB (foreach)": ForeachLamb,
    "trust ratio (for-loop)": TrustRatioSGD,
    "global-norm clip": ClippedAdam,
}


@pytest.mark.parametrize("name", sorted(PRELUDES))
def test_a_step_with_a_prelude_is_recorded_with_it_and_matches_eager(name):
    model, reference, opt, eager, schedules = _pair(PRELUDES[name])
    for step in range(STEPS):
        _step((model, reference), (opt, eager), schedules, step)
    _assert_same(model, reference, opt, eager, **PRELUDE_TOLERANCE.get(name, {}))
    report = optcompile.explain(opt)
    assert report.fallback_reason is None, report.fallback_reason
    assert report.cudagraph_recordings == 1, report.cudagraphs
    assert report.cudagraph_replays == STEPS - report.traces
    # The graph, the copy of the grads its prelude reads, and its deferred writes, if any.
    writes = 1 if _plan(opt).split.writes else 0
    assert report.kernel_launches_per_step == 1 + 1 + writes
    assert "torch-backend op(s) before its kernels" in report.cudagraphs


def test_a_number_the_prelude_takes_changed_re_records_the_graph_and_says_why():
    model, reference, opt, eager, schedules = _pair(PRELUDES["Muon"])
    for step in range(6):
        if step == 4:
            for o in (opt, eager):
                o.param_groups[0]["momentum"] = 0.8
        _step((model, reference), (opt, eager), schedules, step)
    _assert_same(model, reference, opt, eager, **PRELUDE_TOLERANCE["Muon"])
    report = optcompile.explain(opt)
    assert report.cudagraph_recordings == 2, report.cudagraphs
    assert "re-recorded because: the Python numbers its torch-backend ops take" in (
        report.cudagraphs
    )


def test_a_graph_re_recorded_past_its_limit_is_dropped_and_the_step_runs_without_it():
    # Muon's momentum changed every step: each change re-records the graph (its prelude took
    # the number), up to optcudagraph's limit; then the graph is dropped and the plan runs as
    # it does without one (its prelude, kernels and deferred writes, each call), still
    # matching eager; explain() says so and counts the plan's own launches.
    from optcudagraph.tree import DEFAULT_MAX_RERECORDS

    model, reference, opt, eager, schedules = _pair(PRELUDES["Muon"])
    # (step 0 and 1 trace, 2 records, 3.. re-record, the next drops, the last runs without)
    for step in range(DEFAULT_MAX_RERECORDS + 5):
        if step >= 3:
            for o in (opt, eager):
                o.param_groups[0]["momentum"] = 0.9 - 0.01 * step
        _step((model, reference), (opt, eager), schedules, step)
    _assert_same(model, reference, opt, eager, **PRELUDE_TOLERANCE["Muon"])
    report = optcompile.explain(opt)
    assert report.cudagraphs.startswith("dropped: re-recorded"), report.cudagraphs
    assert report.cudagraph_recordings == 1 + DEFAULT_MAX_RERECORDS
    plan = _plan(opt)
    assert report.kernel_launches_per_step == plan.kernel_launches_per_step > 3


# Steps reading a tensor's value on the host (.item()): a host sync no graph can record.
HOST_READS = {
    "trust ratio of a step count's .item()": StepScaledTrustSGD,
    "Adafactor": lambda ps: optim.Adafactor(ps, lr=0.1),
}


@pytest.mark.parametrize("name", sorted(HOST_READS))
def test_a_step_with_an_op_the_kernels_cannot_take_runs_without_a_graph_and_says_why(name):
    model, reference, opt, eager, schedules = _pair(HOST_READS[name])
    for step in range(3):
        _step((model, reference), (opt, eager), schedules, step)
    _assert_same(model, reference, opt, eager)
    report = optcompile.explain(opt)
    assert report.cudagraph_recordings == 0
    assert report.cudagraphs.startswith("not used:"), report.cudagraphs
    # (the CPU step count .item() reads, or the read itself, named)
    why = report.cudagraphs
    assert "torch backend" in why and (".item()" in why or "CPU tensor" in why), why
    with pytest.raises(optcompile.CompileError, match="cudagraphs=True, but"):
        strict = optcompile.compile(HOST_READS[name](list(_model().parameters())), cudagraphs=True)
        for p in strict.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        strict.step()


def test_a_deleted_optimizer_takes_its_graph_with_it():
    """The device's tree manager holds graphed functions weakly: the graph, the plan and its
    buffers go with the compiled optimizer."""
    import gc
    import weakref

    from optcompile.api import _OPTIMIZERS
    from optcudagraph import tree_manager

    model, reference, opt, eager, schedules = _pair(CASES["AdamW"])
    for step in range(3):
        _step((model, reference), (opt, eager), schedules, step)
    graphed = _OPTIMIZERS[opt].cache.entries[0].value.plan.graphed
    assert graphed is not None and graphed in tree_manager("cuda").functions
    gone = weakref.ref(graphed)
    del graphed, opt, schedules
    gc.collect()
    assert gone() is None


class _ReplacingMomentum(torch.optim.Optimizer):
    """Momentum kept by storing a new tensor each step (``buf = buf * m + g``)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-2, "momentum": 0.9})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.zeros_like(p)
                state["buf"] = state["buf"] * group["momentum"] + p.grad
                p.add_(state["buf"], alpha=-group["lr"])


def test_a_state_tensor_replaced_each_step_stays_correct_with_graphs():
    """The stored buffer is a new tensor each call (a graph output): no address guard holds
    it, the plan reads its address each call."""
    model, reference, opt, eager, schedules = _pair(_ReplacingMomentum)
    for step in range(STEPS):
        _step((model, reference), (opt, eager), schedules, step)
    _assert_same(model, reference, opt, eager)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None and report.traces == 2, report.retrace_reasons


def test_checkpoint_reloads_stay_compiled_and_correct_with_graphs():
    model, reference, opt, eager, schedules = _pair(CASES["AdamW"])
    for step in range(3):
        _step((model, reference), (opt, eager), schedules, step)
    buffer = io.BytesIO()
    torch.save(eager.state_dict(), buffer)
    for step in range(3, 23):
        for o in (opt, eager):
            o.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
        _step((model, reference), (opt, eager), schedules, step)
    _assert_same(model, reference, opt, eager)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None and report.entries <= 2, report.retrace_reasons
