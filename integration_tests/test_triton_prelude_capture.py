"""backend="triton": a plan whose torch-backend ops come first (a prelude) run as its CUDA
graph records and replays it (prepare, launch, finish), compared with eager (setup:
triton_setup.py).
"""

from __future__ import annotations

import optcompile
import pytest
import torch
from step_optimizers import ClippedAdam, CountedClippedMomentum, ForeachLamb, TrustRatioSGD
from triton_setup import DEVICE, SHAPES, _assert_close, needs_triton

optim = torch.optim
pytestmark = needs_triton


class _GraphProtocol:
    """Runs a plan as its CUDA graph does, without one (no CUDA here): the first call whole,
    then ``prepare`` + ``launch`` (what a graph records and replays) + ``finish``."""

    def __init__(self, plan):
        self.plan, self.calls, self.stale = plan, 0, []

    def __call__(self, inputs):
        self.calls += 1
        if self.calls == 1:
            return self.plan(inputs)
        self.plan.prepare(inputs)
        self.stale.append(self.plan.stale(inputs))
        self.plan.launch()
        self.plan.finish(inputs)
        return ()


PRELUDES = {
    "Muon": lambda ps: optim.Muon(ps, lr=1e-2),
    "LAMB (foreach)": ForeachLamb,
    "trust ratio (for-loop)": TrustRatioSGD,
    "global-norm clip": ClippedAdam,
    "global-norm clip, host step counts": CountedClippedMomentum,
}


# The host computes with the prelude's 0-dim results (under the interpreter, where they are
# CPU tensors): ``prepare`` runs before the replay, so no graph.
REFUSED = {"global-norm clip, host step counts": "the host computes with its 0-dim results"}
# On CUDA the prelude's 0-dim result (the clip coefficient) is a device tensor beside the CPU
# step counts the host reads: the kernels take their 0-dim values from one place, so the
# whole step runs on the torch backend (no split, no graph), and says why.
UNSPLIT_ON_CUDA = {"global-norm clip, host step counts": "its tensors live on several devices"}


@pytest.mark.parametrize("name", sorted(PRELUDES))
def test_a_prelude_runs_as_its_cuda_graph_would_and_matches_eager(name):
    # A plan whose torch-backend ops (Muon's matmuls, LAMB's norms, a global-norm clip) come
    # first is recorded with them: its prepare / launch / finish split, driven as the graph
    # is (launch once per call, on the plan's copies of the new grads; the kernels' tables
    # point at the prelude's results; its deferred writes after the kernels), matches eager
    # over steps with new grad tensors each step and a hyperparameter the prelude reads
    # changed midway (the graph would be re-recorded, saying why).
    from optcompile.api import _compiled_of
    from optcompile.driver import newest
    from optkernels.prelude_capture import capture_reason

    shapes = [(8, 6), (3, 8), (5, 5)] if name == "Muon" else SHAPES
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in shapes]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = optcompile.compile(PRELUDES[name](params), backend="triton")
    eager = PRELUDES[name](reference)
    params = opt.param_groups[0]["params"]
    reference = eager.param_groups[0]["params"]
    protocol = None
    for step in range(5):
        for p, q in zip(params, reference, strict=True):
            p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
            q.grad = p.grad.clone()
        if step == 4 and name == "Muon":
            for o in (opt, eager):
                o.param_groups[0]["momentum"] = 0.8
        opt.step()
        eager.step()
        if step == 1:  # (a step creating state in its first call traces again)
            entry = newest(_compiled_of(opt))
            plan = entry.plan.plan
            if DEVICE == "cuda" and name in UNSPLIT_ON_CUDA:
                assert plan.split is None and UNSPLIT_ON_CUDA[name] in plan.reason
                assert "torch backend runs this graph" in optcompile.explain(opt).cudagraphs
                continue
            assert plan.split is not None
            assert capture_reason(plan.split.prelude, plan.device) is None
            if name in REFUSED:
                assert REFUSED[name] in plan.prelude_capture_reason()
                return
            assert plan.prelude_capture_reason() is None
            entry.plan = protocol = _GraphProtocol(plan)
    _assert_close(params, opt, reference, eager, rtol=1e-5, atol=1e-6)
    if protocol is None:  # (UNSPLIT_ON_CUDA)
        return
    assert protocol.calls == 3 and _compiled_of(opt).stats.traces <= 2
    first, last = protocol.stale  # (the protocol's first call ran the plan whole)
    assert first is None
    if name == "Muon":
        assert "the Python numbers its torch-backend ops take changed" in last
        assert "0.95 -> 0.8" in last
    else:
        assert last is None
    capture = protocol.plan.capture
    assert capture.inputs == [] and capture.statics  # the grads' copies; no grad kept
    assert protocol.plan.launches_beside_graph == 1 + (1 if protocol.plan.split.writes else 0)
