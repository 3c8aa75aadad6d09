"""Steps whose eager for-loop decides on its step counts in Python (RAdam's rectification,
``rho_t > 5``; ASGD's averaging, ``mu == 1``: test_asgd_half.py) are traced with the decision
as an exact select (opttrace.radam, opttrace.asgd): over enough steps for both branches, and
for Python's ``x ** 0.5`` to differ from ``sqrt``'s rounding somewhere (it does for ~0.7% of
RAdam's step counts), the compiled step is eager's bits on the CPU's torch backend, and
fused into one launch on the kernel backends.
"""

from __future__ import annotations

import optcompile
import pytest
import torch
from differential_cases import DEVICE, TRITON_OK
from optkernels.c_kernel import find_compiler

STEPS = 300


def _pair(
    dtype: torch.dtype, backend: str, device: str = "cpu", **options: object
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    params = [
        torch.randn(37, dtype=dtype).to(device),
        torch.randn(3, 4, dtype=dtype).to(device),
        torch.randn((), dtype=dtype).to(device),
    ]
    params = [p.requires_grad_() for p in params]
    twins = [p.detach().clone().requires_grad_() for p in params]
    opt = optcompile.compile(torch.optim.RAdam(params, foreach=False, **options), backend=backend)
    return params, twins, opt, torch.optim.RAdam(twins, foreach=False, **options)


def _step_both(
    params: list[torch.Tensor],
    twins: list[torch.Tensor],
    opt: torch.optim.Optimizer,
    eager: torch.optim.Optimizer,
) -> None:
    """One step of each optimizer on the same random grads."""
    for p, t in zip(params, twins, strict=True):
        p.grad = torch.randn_like(p)
        t.grad = p.grad.clone()
    opt.step()
    eager.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "options",
    [
        {"lr": 0.01},
        {"lr": 0.1, "weight_decay": 0.1},
        {"lr": 0.1, "weight_decay": 0.1, "decoupled_weight_decay": True},
    ],
    ids=["defaults", "weight_decay", "decoupled"],
)
def test_radam_for_loop_is_eagers_bits_through_the_rectification(dtype, options):
    optcompile.reset()
    params, twins, opt, eager = _pair(dtype, "torch", **options)
    for step in range(STEPS):
        _step_both(params, twins, opt, eager)
        for p, t in zip(params, twins, strict=True):
            assert torch.equal(p, t), f"step {step}: param"
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[p][key], eager.state[t][key]), f"step {step}: {key}"
    assert optcompile.explain(opt).traces == 1


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1"),
        ),
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(isinstance(find_compiler(), str), reason="no C compiler"),
        ),
    ],
)
def test_radam_for_loop_fuses_on_the_kernel_backends(backend):
    optcompile.reset()
    # (the Triton kernels on the GPU where there is one: step counts on the CPU, params there)
    device = DEVICE if backend == "triton" else "cpu"
    params, twins, opt, eager = _pair(torch.float32, backend, device, lr=0.1)
    for _ in range(8):  # through the rectification's start (step 6)
        _step_both(params, twins, opt, eager)
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p, t)
    explanation = optcompile.explain(opt)
    assert explanation.fallback_reason is None and explanation.kernel_launches_per_step == 1
