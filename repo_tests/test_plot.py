"""benchmarks/plot.py reads the committed results (plotting itself needs matplotlib: not here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _plot_module():
    spec = importlib.util.spec_from_file_location("plot", ROOT / "benchmarks" / "plot.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_results_load_as_ratios_without_the_failed_rows():
    plot = _plot_module()
    rows, metas = plot.load(plot.DEFAULT_INPUTS)
    assert {m["device"] for m in metas} == {"NVIDIA H200"}
    assert all(r["ratio"] == r["step_s"] / r["floor_s"] for r in rows)
    assert not [r for r in rows if "error" in r]  # fused Adagrad: torch has no such kernel
    gpt2 = [
        r
        for r in rows
        if (r["set"], r["optimizer"], r["variant"]) == ("gpt2", "AdamW", "optcompile")
    ]
    assert len(gpt2) == 1 and 1.0 <= gpt2[0]["ratio"] < 1.1
    assert (ROOT / "benchmarks" / "results" / "step_time_h200.png").exists()
