"""Plot step time / bandwidth floor per optimizer and variant from step_time.py's JSON results.

    python benchmarks/plot.py                      # the committed H200 results -> PNG
    python benchmarks/plot.py results/a.json ... --out results/a.png

One panel per parameter set, a group of bars per optimizer, one bar per variant (log scale:
the ratios run from 1.0 at the floor to thousands for a Python for-loop on tiny tensors).
Rows that failed (``fused=True`` where torch has no fused kernel) are left out. Needs
matplotlib (not a dependency of the packages or of CI).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
DEFAULT_INPUTS = [
    HERE / "results" / "step_time_h200_part1.json",
    HERE / "results" / "step_time_h200_part2.json",
]
DEFAULT_OUT = HERE / "results" / "step_time_h200.png"
VARIANTS = [
    "for-loop",
    "foreach",
    "fused",
    "torch.compile",
    "optcompile-nograph",
    "optcompile",
    "optcompile-capturable",
]


def load(paths: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows with a step time (ratio added), and each file's ``meta``."""
    rows, metas = [], []
    for path in paths:
        data = json.loads(path.read_text())
        metas.append(data["meta"])
        for row in data["rows"]:
            if row.get("step_s") and row.get("floor_s"):
                rows.append({**row, "ratio": row["step_s"] / row["floor_s"]})
    return rows, metas


def plot(rows: list[dict[str, Any]], metas: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["set"] for r in rows))
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(sets), figsize=(4.2 * len(sets), 4.6), sharey=True)
    axes = [axes] if len(sets) == 1 else list(axes)
    width = 0.8 / len(variants)
    for ax, name in zip(axes, sets, strict=True):
        here = [r for r in rows if r["set"] == name]
        optimizers = list(dict.fromkeys(r["optimizer"] for r in here))
        for j, variant in enumerate(variants):
            xs, ys = [], []
            for i, optimizer in enumerate(optimizers):
                match = [r for r in here if r["optimizer"] == optimizer and r["variant"] == variant]
                if match:
                    xs.append(i + (j - (len(variants) - 1) / 2) * width)
                    ys.append(match[0]["ratio"])
            ax.bar(xs, ys, width, label=variant, color=colors(j))
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_yscale("log")
        ax.set_xticks(range(len(optimizers)), optimizers)
        ax.set_title(name)
        ax.grid(axis="y", which="major", alpha=0.3)
    axes[0].set_ylabel("median step time / bandwidth floor (log)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(variants), frameon=False)
    devices = sorted({f"{m['device']}, torch {m['torch']}, triton {m['triton']}" for m in metas})
    fig.suptitle(f"Optimizer step time against the memory-bandwidth floor ({'; '.join(devices)})")
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="*", type=Path, default=DEFAULT_INPUTS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    rows, metas = load(args.inputs)
    if not rows:
        raise SystemExit(f"no rows with a step time in {[str(p) for p in args.inputs]}")
    plot(rows, metas, args.out)
    print(f"wrote {args.out} ({len(rows)} bars)")


if __name__ == "__main__":
    main()
