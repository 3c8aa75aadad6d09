"""Sweep the generated kernels' launch configuration (BLOCK, num_warps) per set and optimizer.

    python benchmarks/tune_kernels.py [--sets gpt2-bf16,gpt2] [--optimizers AdamW,SGD]
                                      [--configs default,1024x4,512x4,2048x8]

Each configuration runs in a fresh process (``OPTKERNELS_BLOCK``, ``OPTKERNELS_NUM_WARPS``
are read at import). Prints, per (set, optimizer), optcompile's step time (CUDA events, median)
over the floor (bytes the step moves over the copy bandwidth measured in the same process),
beside ``fused=True`` measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def child(set_name: str, optimizers: list[str]) -> None:
    sys.path.insert(0, str(HERE))
    import step_time

    bandwidth = step_time.copy_bandwidth("cuda")
    out = {}
    for opt in optimizers:
        params = step_time.make_params(set_name, "cuda")
        floor = step_time.floor_bytes(set_name, opt) / bandwidth
        row = {}
        for variant in ("optcompile", "fused"):
            step = None
            try:
                step, copies = step_time.build_over_copies(variant, opt, params)
                row[variant] = step_time.time_per_step(step, "cuda") / floor
                if not step_time.params_are_finite(copies):
                    row[variant] = f"{row[variant]:.2f}x (NaN/inf params)"
            except Exception as exc:  # fused=True does not exist for every optimizer
                row[variant] = f"{type(exc).__name__}"
            del step
        out[opt] = row
    print("RESULT " + json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="gpt2-bf16,gpt2")
    parser.add_argument("--optimizers", default="AdamW,SGD,Adagrad")
    parser.add_argument("--configs", default="1024x4,1024x8,512x4,2048x8,4096x16")
    parser.add_argument("--child", nargs=2, metavar=("SET", "OPTIMIZERS"))
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1].split(","))
        return
    optimizers = args.optimizers.split(",")
    print("| set | BLOCK x warps | " + " | ".join(f"{o} (fused)" for o in optimizers) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in optimizers) + " |")
    for set_name in args.sets.split(","):
        for config in args.configs.split(","):
            env = dict(os.environ)
            if config != "default":  # else the tuned configuration (foreach_kernel.py)
                block, warps = config.split("x")
                env.update(OPTKERNELS_BLOCK=block, OPTKERNELS_NUM_WARPS=warps)
            argv = [sys.executable, __file__, "--child", set_name, ",".join(optimizers)]
            done = subprocess.run(argv, env=env, capture_output=True, text=True)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                print(f"| {set_name} | {config} | failed: {done.stderr.strip()[-300:]} |")
                continue
            result = json.loads(lines[-1][len("RESULT ") :])

            def cell(row: dict[str, object]) -> str:
                def fmt(v: object) -> str:
                    return f"{v:.2f}x" if isinstance(v, float) else str(v)

                return f"{fmt(row['optcompile'])} ({fmt(row['fused'])})"

            cells = " | ".join(cell(result[o]) for o in optimizers)
            print(f"| {set_name} | {config} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
