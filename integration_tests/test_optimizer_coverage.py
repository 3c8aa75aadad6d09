"""Every torch.optim optimizer: those the compiler targets with default options, foreach on
and off, Muon (2-D parameters only); LBFGS and SparseAdam run eagerly, with a reason."""

from __future__ import annotations

import warnings

import optcompile
import pytest
import torch
from optcompile.testing import assert_same, run_pair, small_model

optim = torch.optim
OPTIMIZERS = {
    "Adam": lambda ps, f: optim.Adam(ps, lr=1e-2, foreach=f),
    "AdamW": lambda ps, f: optim.AdamW(ps, lr=1e-2, foreach=f),
    "NAdam": lambda ps, f: optim.NAdam(ps, lr=1e-2, foreach=f),
    "RAdam": lambda ps, f: optim.RAdam(ps, lr=1e-2, foreach=f),
    "Adamax": lambda ps, f: optim.Adamax(ps, lr=1e-2, foreach=f),
    "Adadelta": lambda ps, f: optim.Adadelta(ps, foreach=f),
    "Adagrad": lambda ps, f: optim.Adagrad(ps, lr=1e-2, foreach=f),
    "RMSprop": lambda ps, f: optim.RMSprop(ps, lr=1e-2, foreach=f),
    "Rprop": lambda ps, f: optim.Rprop(ps, lr=1e-2, foreach=f),
    "SGD": lambda ps, f: optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=f),
    "ASGD": lambda ps, f: optim.ASGD(ps, lr=1e-2, foreach=f),
    "Adafactor": lambda ps, f: optim.Adafactor(ps, lr=1e-2, foreach=f),
}


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_default_options_compile_and_match_eager(name, foreach):
    model, opt, reference, eager = run_pair(lambda ps: OPTIMIZERS[name](ps, foreach), steps=3)
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None
    # Only SGD creates state (momentum buffers) inside its first step: one retrace for that.
    assert report.traces == (2 if name == "SGD" else 1), report.retrace_reasons


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("name", sorted(set(OPTIMIZERS) - {"Adafactor"}))  # (eager refuses)
def test_complex_parameters_compile_through_their_real_views(name, foreach):
    """torch.optim steps a complex parameter through ``view_as_real`` of it and of its
    state: the trace writes the new real values back as ``view_as_complex``."""
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64)),
        torch.nn.Parameter(torch.randn(5)),
    ]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = optcompile.compile(OPTIMIZERS[name](params, foreach), fullgraph=True)
    eager = OPTIMIZERS[name](twins, foreach)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(params, twins, strict=True):
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            q.grad = p.grad.clone()
        opt.step()
        eager.step()
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p, q)
        for key, value in eager.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value)
    assert params[0].dtype == torch.complex64 and opt.state[params[0]]
    report = optcompile.explain(opt)
    assert report.fallback_reason is None
    # (SGD's ops take the complex tensors as they are.)
    assert ("view_as_complex" in report.graph_code) is (name != "SGD")


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize(
    "options",
    [
        {"weight_decay": 0.1},
        {"maximize": True},
        {"beta2_decay": -0.5, "d": 2.0, "eps": (1e-4, 1e-2)},
    ],
)
def test_adafactor_options_match_eager_and_its_per_tensor_scales_are_computed_in_the_graph(
    options, foreach
):
    # Adafactor's step size is max(eps2, RMS(p)) * min(lr, 1/sqrt(step)): values read from
    # tensors (.item()) meet Python's min/max, which the graph computes: no decision, no guard.
    model, opt, reference, eager = run_pair(
        lambda ps: optim.Adafactor(ps, lr=0.5, foreach=foreach, **options), steps=4
    )
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None and report.traces == 1
    assert "max(" in report.graph_code and "min(" in report.graph_code


def _matrices(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # Muon takes 2-D parameters only; a tall, a square, a wide one
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8, bias=False),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 8, bias=False),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 3, bias=False),
    )


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"nesterov": False, "momentum": 0.5},
        {"weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"},
        {"ns_steps": 2, "ns_coefficients": (3.0, -3.2, 1.2)},
    ],
)
def test_muon_matches_eager_through_its_writes_into_a_transposed_view(options):
    # Muon orthogonalizes each update in bfloat16, transposing tall matrices and dividing in
    # place through the transposed view: a write the trace turns into the base's new value.
    # Its matmuls run on the torch backend, its per-element tail fused for all three shapes
    # (each reads its own shape-scaled lr), where the backend fuses (not "torch").
    for backend in ("auto", "torch"):
        model, opt, reference, eager = run_pair(
            lambda ps: optim.Muon(ps, lr=1e-2, **options),
            steps=4,
            model=_matrices(),
            backend=backend,
        )
        assert_same(model, opt, reference, eager)
        report = optcompile.explain(opt)
        assert report.fallback_reason is None and report.traces == 1
        assert "aten.permute" in report.graph_code
        if report.backend != "torch":
            assert "partly fused" in report.graph_code, report.graph_code[:300]


def _lbfgs_steps(model, opt, steps=3):
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    losses = []
    for _ in range(steps):

        def closure():
            opt.zero_grad()
            loss = model(x).pow(2).sum()
            loss.backward()
            return loss

        losses.append(opt.step(closure))
    return losses


def test_lbfgs_needs_its_closure_inside_the_step_so_it_runs_eagerly_with_one_warning():
    model, reference = small_model(), small_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = optcompile.compile(optim.LBFGS(model.parameters(), lr=0.5, max_iter=4))
        losses = _lbfgs_steps(model, opt)
    fallbacks = [w for w in caught if issubclass(w.category, optcompile.FallbackWarning)]
    assert len(fallbacks) == 1 and "LBFGS.step(closure) needs its closure" in str(
        fallbacks[0].message
    )
    eager = optim.LBFGS(reference.parameters(), lr=0.5, max_iter=4)
    expected = _lbfgs_steps(reference, eager)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    assert_same(model, opt, reference, eager)
    assert "needs its closure" in (optcompile.explain(opt).fallback_reason or "")


def test_lbfgs_with_fullgraph_is_refused_when_compiled():
    with pytest.raises(optcompile.CompileError, match=r"fullgraph=True: LBFGS\.step"):
        optcompile.compile(optim.LBFGS(small_model().parameters()), fullgraph=True)


def test_sparse_adam_runs_eagerly_naming_the_sparse_gradient():
    def make():
        torch.manual_seed(0)
        return torch.nn.Embedding(10, 4, sparse=True)

    model, reference = make(), make()
    opt = optcompile.compile(optim.SparseAdam(model.parameters(), lr=0.1))
    eager = optim.SparseAdam(reference.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            ids = torch.tensor([step, 3, 7])
            for m, o in ((model, opt), (reference, eager)):
                o.zero_grad()
                m(ids).pow(2).sum().backward()
                o.step()
    fallbacks = [w for w in caught if issubclass(w.category, optcompile.FallbackWarning)]
    assert len(fallbacks) == 1
    assert ".grad is a sparse_coo tensor; only dense (strided) tensors" in str(fallbacks[0].message)
    assert_same(model, opt, reference, eager)


class _Tagged(torch.Tensor):
    """A subclass that keeps torch's ops (no __torch_function__ / __torch_dispatch__ of
    its own): traced like a tensor."""


class _Logged(torch.Tensor):
    """A subclass that runs its own code around each op: its step must stay eager."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("kind", ["tagged", "logged"])
def test_tensor_subclasses_with_their_own_ops_run_eagerly_naming_them(kind):
    """The graph runs torch's plain ops: a subclass's __torch_function__ would be skipped,
    so such a step runs eagerly, with the reason. (DTensor is traced through its own
    dispatch: test_dtensor.py.)"""
    distributed = kind == "DTensor"
    if distributed:
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
        )
    try:
        torch.manual_seed(0)
        values = [torch.randn(4, 3), torch.randn(5)]
        if distributed:
            mesh = init_device_mesh("cpu", (1,))
            make = lambda t: distribute_tensor(t.clone(), mesh, [Shard(0)])  # noqa: E731
        else:
            cls = _Tagged if kind == "tagged" else _Logged
            make = lambda t: t.clone().as_subclass(cls)  # noqa: E731
        params = [torch.nn.Parameter(make(t)) for t in values]
        twins = [torch.nn.Parameter(make(t)) for t in values]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # (the torch backend: eager's own ops, compared bitwise)
            opt = optcompile.compile(optim.AdamW(params, lr=1e-2, foreach=False), backend="torch")
            eager = optim.AdamW(twins, lr=1e-2, foreach=False)
            for step in range(3):
                for p, q in zip(params, twins, strict=True):
                    p.grad = make(torch.full(p.shape, 0.1 * (step + 1)))
                    q.grad = make(torch.full(q.shape, 0.1 * (step + 1)))
                opt.step()
                eager.step()
        for p, q in zip(params, twins, strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
        fallbacks = [w for w in caught if issubclass(w.category, optcompile.FallbackWarning)]
        if kind == "tagged":
            assert fallbacks == [] and optcompile.explain(opt).fallback_reason is None
        else:
            name = "DTensor" if distributed else "_Logged"
            assert len(fallbacks) == 1
            assert f"params'][0] is a {name}, a tensor subclass" in str(fallbacks[0].message)
    finally:
        if distributed:
            torch.distributed.destroy_process_group()
