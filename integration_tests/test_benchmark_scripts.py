"""Benchmark scripts run end to end on the CPU, so they do not rot before the GPU machines
run them: the sharded ones on gloo, benchmarks/sharded_step.py (world size 1, in one process)
and benchmarks/fsdp_train.py (torchrun, world size 2), each in its --smoke mode (a tiny model,
a few steps; they raise if optcompile falls back or retraces, or if the compiled and eager runs
or the checkpoint round trip differ); benchmarks/first_call.py, benchmarks/in_backward.py,
benchmarks/in_backward_host.py and benchmarks/in_backward_cold.py on a tiny case;
benchmarks/host_time.py's host parts and benchmarks/guard_floor.py's loops on the CPU (the
Triton interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


def _script(command: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """``command`` run to its end (one OpenMP thread each, ``env`` added to the
    environment), asserted to succeed."""
    done = subprocess.run(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _run(args: list[str], tmp_path: Path) -> tuple[dict, str]:
    out, js = tmp_path / "table.md", tmp_path / "result.json"
    _script([*args, "--device", "cpu", "--smoke", "--json", str(js), "--out", str(out)])
    return json.loads(js.read_text()), out.read_text()


@pytest.mark.parametrize(
    ("optimizer", "variants"),
    [
        ("adamw", ["optcompile", "fused", "foreach", "plain optcompile"]),
        (
            "muon",
            ["optcompile", "eager", "plain optcompile", "plain eager", "plain optcompile no graph"],
        ),
    ],
)
def test_sharded_step_benchmark_runs_every_variant_on_the_cpu(
    tmp_path: Path, optimizer: str, variants: list[str]
) -> None:
    script = [sys.executable, str(BENCHMARKS / "sharded_step.py"), "--optimizer", optimizer]
    result, table = _run(script, tmp_path)
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == variants
    assert all(r["step_s"] > 0 and r["synced_s"] > 0 for r in rows.values())
    sharded, plain = rows["optcompile"], rows["plain optcompile"]
    assert sharded["fallback"] is None and sharded["traces"] == 1
    # The sharded step is the plain step over the local shards (world size 1: DTensor's
    # rules call no collective): the same launches.
    assert sharded["launches"] == plain["launches"]
    assert result["meta"]["floor_s"] > 0 and "| plain optcompile |" in table


def test_fsdp_training_benchmark_runs_under_torchrun_with_two_ranks(tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    script = str(BENCHMARKS / "fsdp_train.py")
    result, table = _run([*torchrun, "--nproc_per_node", "2", script], tmp_path)
    assert [r["rank"] for r in result["runs"]] == [0, 1]
    for run in result["runs"]:
        assert run["parity"]["parity_steps"] == 3
        assert [r["variant"] for r in run["rows"]] == ["optcompile", "fused", "foreach"]
        assert all(r["opt_step_s"] > 0 and r["train_step_s"] > 0 for r in run["rows"])
        assert run["rows"][0]["fallback"] is None
    assert "largest loss gap" in table


def test_first_call_benchmark_times_each_phase_in_a_fresh_process(tmp_path: Path) -> None:
    # (its timers patch the functions each phase runs: this keeps their names current)
    out = tmp_path / "first_call.md"
    script = str(BENCHMARKS / "first_call.py")
    command = [sys.executable, script, "--cases", "tiny-200-adamw", "--out", str(out)]
    done = _script([*command, "--warm", "--profile", str(tmp_path / "profile")])
    cold, warm = (json.loads(line) for line in done.stdout.strip().splitlines()[:2])
    assert (cold["caches"], warm["caches"]) == ("cold", "warm")
    for result in cold, warm:
        assert result["params"] == 200 and result["traces"] == 1 and result["fallback"] is None
        for phase in ("trace", "guards", "families", "run"):
            assert result["phases"][phase] > 0, phase
        assert result["check_code_lines"] < 200  # the params' guards are one loop
        assert result["settled_s"] is None  # (the step overlaps the background threads)
    assert cold["phases"]["C compile"] > warm["phases"]["C compile"]  # (built, then loaded)
    table = out.read_text()
    assert "| tiny-200-adamw | cold | 200 |" in table and "| tiny-200-adamw | warm | 200 |" in table
    for caches in ("cold", "warm"):
        profile = (tmp_path / "profile" / f"first_call_tiny-200-adamw_{caches}.txt").read_text()
        assert "under cProfile" in profile and "trace_step" in profile


def test_in_backward_host_benchmark_times_hooks_and_bucket_updates(tmp_path: Path) -> None:
    js = tmp_path / "result.json"
    script = str(BENCHMARKS / "in_backward_host.py")
    args = ["--device", "cpu", "--config", "tiny", "--buckets", "3", "--backend", "torch"]
    args += ["--iters", "2", "--warmup", "1", "--reps", "3", "--json", str(js)]
    done = _script([sys.executable, script, *args])
    result = json.loads(js.read_text())
    params = sum(r["params"] for r in result["per_bucket"])
    # a third of the gradient bytes each, one param group each: 3 of the matrices (the
    # last one's with the tied embedding), 1 of the vectors
    assert result["buckets"] == len(result["per_bucket"]) == 4
    inside = result["inside_backward"]
    # the hooks kept once the buckets are learned (the first param's, each bucket's last
    # one's) ran inside backward, and each bucket's update once
    assert inside["hooks"] == result["hooks"] == 5 < params and inside["updates"] == 4
    assert 0 < inside["updates_us"] <= inside["hooks_us"] < inside["backward_us"]
    assert all(r["plan"] < r["compiled step"] < r["update"] for r in result["per_bucket"])
    # timed outside backward (grad mode on), the updates hit the entries traced inside it
    assert all(r["traces"] == 1 and r["fast_hits"] > 3 for r in result["per_bucket"])
    assert result["per_hook"]["hook"] > 0 and "Per hook:" in done.stdout
    speed = result["python_speed"]
    assert speed["inside_us"] > 0 and speed["outside_us"] > 0
    assert "The same pure Python:" in done.stdout


def test_in_backward_cold_benchmark_splits_each_update_inside_backward_and_alone(
    tmp_path: Path,
) -> None:
    js = tmp_path / "result.json"
    script = str(BENCHMARKS / "in_backward_cold.py")
    args = ["--device", "cpu", "--config", "tiny", "--iters", "2", "--warmup", "1"]
    done = _script([sys.executable, script, *args, "--reps", "5", "--json", str(js)])
    result = json.loads(js.read_text())
    buckets = len(result["buckets"])
    # every bucket updated once per backward; each alone 5 times, the first 3 not kept
    assert len(result["inside"]) == 2 * buckets and len(result["alone"]) == 2 * buckets
    assert len(result["first_hooks"]) == 2  # (the first param's, once per backward)
    for _, parts in result["inside"] + result["alone"]:
        assert 0 < parts["tree"] < parts["find"] < parts["compiled"] < parts["update"]
        assert parts["clear"] > 0
    assert "| whole update |" in done.stdout
    # the backward three ways (hooks kept: the first param's and each bucket's last one's);
    # our hooks' bodies (the updates among them) took some of its time
    times = result["backwards"]
    assert times["hooks"] == buckets + 1 and 0 < times["ours"] < times["in backward"]
    assert times["plain"] > 0 and times["no-op hooks"] > 0 and "no-op hooks" in done.stdout


def test_in_backward_benchmark_reports_peaks_and_bucket_sizes_on_the_cpu(tmp_path: Path) -> None:
    js = tmp_path / "result.json"
    args = ["--device", "cpu", "--config", "tiny", "--batches", "2", "--warmup", "1"]
    variants = "optcompile,optcompile-in-backward,optcompile-in-backward@0.01"
    args += ["--iters", "2", "--variants", variants, "--json", str(js)]
    _script([sys.executable, str(BENCHMARKS / "in_backward.py"), *args])
    rows = {r["variant"]: r for r in json.loads(js.read_text())["rows"]}
    assert all(r["peak_bytes"] > 0 for r in rows.values())  # the peak resident set
    assert not rows["optcompile"].get("buckets")
    assert len(rows["optcompile-in-backward"]["buckets"]) == 2  # one per group
    assert len(rows["optcompile-in-backward@0.01"]["buckets"]) > 2  # 10 KiB each


def test_host_time_benchmark_times_the_host_parts_on_the_cpu() -> None:
    args = ["--device", "cpu", "--set", "200x4x4", "--calls", "20"]
    done = _script([sys.executable, str(BENCHMARKS / "host_time.py"), *args], TRITON_INTERPRET="1")
    rows = [line for line in done.stdout.splitlines() if line.startswith("| optcompile")]
    assert [r.split(" | ")[0] for r in rows] == ["| optcompile", "| optcompile-capturable"]
    assert all(r.count(" µs") == 5 for r in rows)  # guard check, gather, prologue, prepare, hit


def test_guard_floor_benchmark_times_the_native_loops_on_the_cpu() -> None:
    args = ["--device", "cpu", "--set", "200x4x4", "--calls", "20"]
    done = _script(
        [sys.executable, str(BENCHMARKS / "guard_floor.py"), *args], TRITON_INTERPRET="1"
    )
    rows = dict(
        line.strip("| ").rsplit(" | ", 1)
        for line in done.stdout.splitlines()
        if line.startswith("| ") and not line.startswith(("| part", "| ---"))
    )
    loops = ["200 params + their grads (native)", "600 state tensors (native)"]
    assert all(name in rows for name in [*loops, "201 dict versions (native)"]), rows
    assert float(rows["the three native loops together"]) > 0
