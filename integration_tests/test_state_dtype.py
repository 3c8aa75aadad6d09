"""``compile(opt, state_dtype=...)``: optimizer state stored in bfloat16 or blockwise int8.

Correctness: with int8 state (round to nearest, deterministic) a compiled step must equal an
eager optimizer whose state is quantized and dequantized after each of its steps (params
and every state entry, several steps). With bfloat16 (stochastic rounding) it stays within
bfloat16's rounding of eager at full precision, and two runs are identical. Quality: a tiny
transformer trained 300 steps (CPU, fixed seed) ends within 2% (bf16) / 5% (int8) of the
final loss at full precision, for AdamW, Adam, SGD with momentum, Lion and a custom
optimizer. Then the drop-in parts (state_dict, load_state_dict, copies, explain) and the
refusals (a state tensor read by a matmul, or replaced each step).
"""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Callable
from typing import Any

import optcompile
import pytest
import torch
from lowp_training import batches, train
from optcompile.compressed_state import COUNTER_ATTR, MIN_NUMEL
from optcompile.testing import set_grads
from optkernels.compressed import dequantize_state, packed_numel, quantize_state
from opttrace import TraceError
from step_optimizers import Lion, SophiaLike

MakeOpt = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, MakeOpt] = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=3e-3),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=3e-3, foreach=False),
    "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "Lion": lambda ps: Lion(ps, lr=3e-4, weight_decay=0.01, foreach=True),
    "SophiaLike": lambda ps: SophiaLike(ps),
}
TOLERANCE = {"bf16": 0.02, "int8": 0.05}
DTYPES = {"bf16": torch.bfloat16, "int8": "int8"}


def _model() -> torch.nn.Module:
    """Two 64x128 weights (compressed state) and small biases (exact state)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Tanh(), torch.nn.Linear(64, 128))


def _roundtrip(opt: torch.optim.Optimizer) -> None:
    """What int8 storage does to an eager optimizer's state after its step."""
    for p, state in opt.state.items():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.shape == p.shape and t.numel() >= MIN_NUMEL:
                payload = quantize_state(t, "int8", 0, 0)
                t.copy_(dequantize_state(payload, "int8", list(t.shape), t.dtype))


def _full_state(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return list(opt.state_dict()["state"].values())


@pytest.mark.parametrize(
    "name",
    ["AdamW-foreach", "AdamW-for-loop", "SGD-momentum", "Lion-foreach", "SophiaLike"],
)
def test_int8_steps_equal_eager_with_its_state_quantized_after_each_step(name: str) -> None:
    make: MakeOpt = {
        "AdamW-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
        "AdamW-for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
        "SGD-momentum": OPTIMIZERS["SGD-momentum"],
        "Lion-foreach": OPTIMIZERS["Lion"],
        "SophiaLike": OPTIMIZERS["SophiaLike"],
    }[name]
    model = _model()
    reference = copy.deepcopy(model)
    # (the torch backend: eager's own ops, so that eager's quantized state is reproduced; the
    # CPU backend's ulp differences can move a value across an int8 rounding boundary)
    opt = optcompile.compile(make(list(model.parameters())), state_dtype="int8", backend="torch")
    eager = make(list(reference.parameters()))
    for step in range(4):
        set_grads(model, step)
        set_grads(reference, step)
        opt.step()
        eager.step()
        _roundtrip(eager)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        for got, expected in zip(_full_state(opt), _full_state(eager), strict=True):
            assert got.keys() == expected.keys()
            for key in expected:
                torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-7)
    weight = next(iter(model.parameters()))
    assert opt.state[weight][next(iter(opt.state[weight].keys() - {"step"}))].dtype is torch.uint8


@pytest.mark.parametrize("name", ["AdamW", "SGD-momentum"])
def test_bf16_state_stays_within_bfloat16_rounding_of_full_precision(name: str) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    opt = optcompile.compile(OPTIMIZERS[name](list(model.parameters())), state_dtype=torch.bfloat16)
    eager = OPTIMIZERS[name](list(reference.parameters()))
    for step in range(5):
        set_grads(model, step)
        set_grads(reference, step)
        opt.step()
        eager.step()
    lr = opt.param_groups[0]["lr"]
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=5 * lr * 0.04)
    for got, expected in zip(_full_state(opt), _full_state(eager), strict=True):
        for key in expected:  # a few ulps of bfloat16 at the tensor's scale
            scale = expected[key].abs().max().item()
            torch.testing.assert_close(got[key], expected[key], rtol=2**-6, atol=2**-7 * scale)
    # The rounding counter never retraces (SGD creates its buffers in its first step: one
    # retrace, as at full precision).
    assert optcompile.explain(opt).traces == (2 if name == "SGD-momentum" else 1)


def test_bf16_runs_are_reproducible_and_each_step_draws_new_rounding_bits() -> None:
    payloads = []
    for _ in range(2):
        optcompile.reset()
        model = _model()
        opt = optcompile.compile(torch.optim.AdamW(model.parameters()), state_dtype=torch.bfloat16)
        for step in range(3):
            set_grads(model, step)
            opt.step()
        weight = next(iter(model.parameters()))
        payloads.append(opt.state[weight]["exp_avg_sq"].clone())
        assert opt.state[weight]["exp_avg_sq"].dtype is torch.bfloat16
        # one draw per step, and one per conversion when the state was created (the two
        # weights' exp_avg and exp_avg_sq)
        assert opt.__dict__[COUNTER_ATTR] == 3 + 4
    assert torch.equal(payloads[0], payloads[1])


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_tiny_transformer_final_loss_is_close_to_full_precision(
    name: str, fmt: str, full_precision_losses: dict[str, float]
) -> None:
    loss, opt = train(OPTIMIZERS[name], state_dtype=DTYPES[fmt], data=_data())
    base = full_precision_losses[name]
    assert abs(loss / base - 1) <= TOLERANCE[fmt], (loss, base)
    full, stored = optcompile.explain(opt).state_bytes or (0, 0)
    assert stored < full * (0.7 if fmt == "bf16" else 0.45)  # (small tensors stay exact)


_BATCHES: list[torch.Tensor] = []


def _data() -> list[torch.Tensor]:
    """One set of batches for every run."""
    if not _BATCHES:
        _BATCHES.extend(batches(300))
    return _BATCHES


@pytest.fixture(scope="module")
def full_precision_losses() -> dict[str, float]:
    return {name: train(make, data=_data())[0] for name, make in OPTIMIZERS.items()}


def test_state_dict_is_full_precision_and_loads_into_an_eager_optimizer() -> None:
    model = _model()
    opt = optcompile.compile(torch.optim.AdamW(model.parameters()), state_dtype="int8")
    for step in range(3):
        set_grads(model, step)
        opt.step()
    weight, bias = list(model.parameters())[:2]
    payload = opt.state[weight]["exp_avg"]
    assert payload.dtype is torch.uint8 and payload.shape == (packed_numel(weight.numel()),)
    assert opt.state[bias]["exp_avg"].dtype is torch.float32  # 64 elements: exact
    assert opt.state[weight]["step"].dtype is torch.float32  # step counts stay exact
    saved = opt.state_dict()
    assert saved["state"][0]["exp_avg"].dtype is torch.float32
    assert saved["state"][0]["exp_avg"].shape == weight.shape
    torch.testing.assert_close(
        saved["state"][0]["exp_avg"], dequantize_state(payload, "int8", [64, 128], torch.float32)
    )
    assert opt.state[weight]["exp_avg"] is payload  # state_dict() leaves the state alone
    eager = torch.optim.AdamW(copy.deepcopy(model).parameters())
    eager.load_state_dict(saved)
    assert eager.state_dict()["state"][0]["exp_avg_sq"].dtype is torch.float32


def test_load_state_dict_of_full_precision_quantizes_and_steps_on() -> None:
    model = _model()
    eager = torch.optim.AdamW(copy.deepcopy(model).parameters())
    for p in eager.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    eager.step()
    opt = optcompile.compile(torch.optim.AdamW(model.parameters()), state_dtype=torch.bfloat16)
    opt.load_state_dict(eager.state_dict())
    weight = next(iter(model.parameters()))
    assert opt.state[weight]["exp_avg"].dtype is torch.bfloat16
    for got, expected in zip(_full_state(opt), _full_state(eager), strict=True):
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=2**-7, atol=0)
    set_grads(model, 0)
    opt.step()
    assert opt.state[weight]["exp_avg"].dtype is torch.bfloat16
    assert opt.state[weight]["step"].item() == 2


def test_explain_reports_the_state_bytes_before_and_after() -> None:
    model = _model()
    opt = optcompile.compile(torch.optim.Adam(model.parameters()), state_dtype="int8")
    set_grads(model, 0)
    opt.step()
    explanation = optcompile.explain(opt)
    weights = 2 * 64 * 128
    small = (64 + 128) * 2 * 4 + 4 * 4  # biases' moments and four step counts
    assert explanation.state_bytes == (weights * 2 * 4 + small, 2 * 2 * packed_numel(8192) + small)
    assert "state (int8): " in str(explanation) and "at full precision" in str(explanation)


class MatmulState(torch.optim.Optimizer):
    """A momentum buffer read by a matmul (a Shampoo-like preconditioner)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 1e-3})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["buf"] = torch.zeros_like(p)
                if p.dim() == 2:  # the buffer as it is stored, read by a matmul
                    p.sub_(state["buf"] @ (state["buf"].T @ p), alpha=group["lr"] * 1e-3)
                state["buf"].mul_(0.9).add_(p.grad)
                p.sub_(state["buf"], alpha=group["lr"])


class ReplacedState(MatmulState):
    """A momentum buffer replaced by a new tensor each step."""

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["buf"] = state.get("buf", torch.zeros_like(p)) * 0.9 + p.grad
                p.sub_(state["buf"], alpha=group["lr"])


@pytest.mark.parametrize(
    ("cls", "reason"),
    [
        (MatmulState, r"state_dtype: L\['opt'\]\.state\[.*\]\['buf'\] is read by aten\.\w+"),
        (ReplacedState, r"state_dtype: the step stores a new tensor into L\['opt'\]\.state"),
    ],
)
def test_a_state_it_cannot_keep_compressed_is_refused_and_steps_eagerly_on_full_values(
    cls: type[torch.optim.Optimizer], reason: str
) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    opt = optcompile.compile(cls(model.parameters()), state_dtype="int8")
    eager = cls(reference.parameters())
    with pytest.warns(optcompile.FallbackWarning, match=reason):
        for step in range(3):
            set_grads(model, step)
            set_grads(reference, step)
            opt.step()
            eager.step()
            _roundtrip(eager)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    weight = next(iter(model.parameters()))
    assert opt.state[weight]["buf"].dtype is torch.uint8  # eager steps keep it compressed
    with pytest.raises(TraceError, match=reason):
        model = _model()
        strict = optcompile.compile(cls(model.parameters()), state_dtype="int8", fullgraph=True)
        for step in range(2):
            set_grads(model, step)
            strict.step()


def test_state_dtype_options_are_checked_and_recompiling_without_it_restores_full_state() -> None:
    with pytest.raises(optcompile.CompileError, match=r"torch\.float16 is not supported"):
        optcompile.compile(torch.optim.SGD(_model().parameters()), state_dtype=torch.float16)
    with pytest.raises(optcompile.CompileError, match="applies to optimizers"):
        optcompile.compile(lambda x: x * 2, state_dtype="int8")
    with pytest.raises(optcompile.CompileError, match="with in_backward=True is not supported"):
        optcompile.compile(
            torch.optim.SGD(_model().parameters()), state_dtype="int8", in_backward=True
        )
    model = _model()
    opt = optcompile.compile(torch.optim.AdamW(model.parameters()), state_dtype="int8")
    set_grads(model, 0)
    opt.step()
    weight = next(iter(model.parameters()))
    clone = pickle.loads(pickle.dumps(opt))
    assert next(iter(clone.state.values()))["exp_avg"].dtype is torch.uint8
    assert clone.state_dict()["state"][0]["exp_avg"].dtype is torch.float32
    copied = copy.deepcopy(opt)
    for p in copied.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    copied.step()
    assert next(iter(copied.state.values()))["exp_avg"].dtype is torch.uint8
    optcompile.compile(opt, state_dtype=None)
    assert opt.state[weight]["exp_avg"].dtype is torch.float32
    set_grads(model, 1)
    opt.step()
    assert opt.state[weight]["exp_avg"].dtype is torch.float32


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_triton_backend_runs_compressed_state_like_the_torch_backend(fmt: str) -> None:
    runs = []
    for backend in ("torch", "triton"):
        optcompile.reset()
        model = _model().to("cuda" if torch.cuda.is_available() else "cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        opt = optcompile.compile(opt, backend=backend, state_dtype=DTYPES[fmt])
        for step in range(3):
            set_grads(model, step)
            opt.step()
        runs.append((list(model.parameters()), _full_state(opt)))
        if backend == "triton":  # dequantize, update, requantize in one kernel per dtype group
            explanation = optcompile.explain(opt)
            assert "not fused" not in explanation.graph_code
            assert "partly fused" not in explanation.graph_code
    (params, state), (fused_params, fused_state) = runs
    # The kernels compute each op as ATen does, up to an ulp of float32 (fused multiply-adds);
    # where that ulp crosses a rounding boundary the state differs by an ulp (bf16) or a
    # code (int8) of its format, and that element's later updates by as much: on a GPU,
    # whose compiler fuses multiply-adds, up to a code of int8's map (2/127 relative at the
    # top of a block) and its effect on three updates of lr 1e-2.
    cuda = torch.cuda.is_available()
    for p, q in zip(fused_params, params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-3 if cuda else 3 * 1e-2 * 2**-6)
    for got, expected in zip(fused_state, state, strict=True):
        for key in expected:
            rtol = 2**-5 if cuda else 2**-7
            torch.testing.assert_close(got[key], expected[key], rtol=rtol, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_cuda_compressed_state_on_the_auto_backend_matches_the_torch_backend(fmt: str) -> None:
    runs = []
    for backend in ("torch", "auto"):
        optcompile.reset()
        model = _model().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=backend == "auto")
        opt = optcompile.compile(opt, backend=backend, state_dtype=DTYPES[fmt])
        for step in range(6):
            set_grads(model, step)
            opt.step()
        runs.append((list(model.parameters()), _full_state(opt)))
        if backend == "auto":  # fused and recorded once as a CUDA graph
            explanation = optcompile.explain(opt)
            assert explanation.traces == 1
            assert "partly fused" not in explanation.graph_code
            assert explanation.cudagraph_recordings == 1, explanation.cudagraphs
    (params, state), (fused_params, fused_state) = runs
    # (as above: a code or ulp of the format where a fused multiply-add flips it; the step
    # counts live on the device with capturable=True, on the CPU without)
    for p, q in zip(fused_params, params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-3)
    for got, expected in zip(fused_state, state, strict=True):
        for key in expected:
            a, b = got[key].cpu(), expected[key].cpu()
            if fmt == "int8" and a.dim() > 0:  # a code is relative to its block's absmax
                assert (a - b).abs().max() <= b.abs().max() * 2 / 127, key
            else:
                torch.testing.assert_close(a, b, rtol=2**-5, atol=1e-5)
