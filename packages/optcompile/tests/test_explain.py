"""explain(): a summary of at most 40 lines for any model size; the full text on request."""

from __future__ import annotations

import optcompile
import torch

MAX_LINES = 40


def _adamw_over(count: int) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(3)
    opt = optcompile.compile(torch.optim.AdamW(params, lr=1e-3), backend="torch")
    opt.step()
    return opt


def test_the_summary_fits_in_40_lines_and_groups_guards_by_kind():
    opt = _adamw_over(148)
    for option, value in (("maximize", True), ("foreach", False)):  # retraces, with reasons
        opt.param_groups[0][option] = value
        opt.step()
    report = optcompile.explain(opt)
    text = str(report)
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, text
    assert lines[0].startswith("AdamW.step: compiled   backend: torch   traces: 3")
    stripped = [line.strip() for line in lines]
    assert "148 params: metadata, data pointer" in stripped
    assert "148 grads: None or not, metadata" in stripped
    assert any(line.startswith("444 state values [exp_avg, exp_avg_sq, step]") for line in stripped)
    assert "  - L['opt'].param_groups[0]['maximize']: value changed (False -> True)" in lines
    assert lines[-1].endswith("explain(obj, verbose=True)")


def test_the_summary_stays_short_with_many_retraces_and_groups():
    def update(xs, ys, zs, lr):
        torch._foreach_add_(xs, ys, alpha=lr)
        torch._foreach_add_(zs, ys, alpha=lr)

    f = optcompile.compile(update, backend="torch", recompile_limit=20)
    xs, ys, zs = ([torch.zeros(2) for _ in range(40)] for _ in range(3))
    for lr in range(1, 12):  # an int: each value is a new entry
        f(xs, ys, zs, lr)
    report = optcompile.explain(f)
    assert report.traces == 11 and len(report.retrace_reasons) == 10
    lines = str(report).splitlines()
    assert len(lines) <= MAX_LINES
    assert "  (5 earlier; the latest follow)" in lines


def test_verbose_keeps_every_guard_and_the_code():
    opt = _adamw_over(30)
    report = optcompile.explain(opt, verbose=True)
    text = str(report)
    assert len(text.splitlines()) > 300
    for guard in report.guards:
        assert f"  - {guard}" in text
    assert "def check(L):" in text and "def forward(" in text and "def gather(L):" in text
    brief = optcompile.explain(opt)
    assert brief.guards == report.guards and brief.check_code == report.check_code


def test_a_compiled_object_not_traced_yet_says_so():
    opt = optcompile.compile(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    lines = str(optcompile.explain(opt)).splitlines()
    assert lines[0].startswith("SGD.step: not traced yet")
    assert "retrace reasons: none" in lines
