"""The on-disk kernel cache: a second process compiling the same optimizer reuses the
generated source file and, on a GPU, Triton's compiled binary: the Triton compiler is not
run, nor Triton's per-process hash of its own sources (``triton_key``, 0.4 s), which any
lookup in Triton's disk cache needs. Each process is a fresh interpreter with its own cache
folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)

# Each child counts the kernels Triton compiles (its compiler's first stage) in `compiles`.
COUNT_COMPILES = textwrap.dedent(
    """
    from triton.compiler import compiler

    compiles = []
    make_ir = compiler.ASTSource.make_ir

    def counting(self, *args, **kwargs):
        compiles.append(self.name)
        return make_ir(self, *args, **kwargs)

    compiler.ASTSource.make_ir = counting
    """
)

CHILD = COUNT_COMPILES + textwrap.dedent(
    """
    import json, os, sys, threading, time
    import torch
    from triton.runtime import build as triton_build, cache as triton_cache

    c_builds = []  # the threads that ran the C compiler for Triton's runtime modules
    c_build = triton_build._build

    def recording(*args, **kwargs):
        c_builds.append(threading.current_thread().name)
        return c_build(*args, **kwargs)

    triton_build._build = recording
    import optcompile

    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = [torch.nn.Parameter(torch.ones(n, device=device)) for n in (7, 1000)]
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p in twins:
        p.grad = torch.full_like(p, 0.5)
    extra = {"capturable": True} if device == "cuda" else {}
    opt = optcompile.compile(
        torch.optim.AdamW(params, lr=0.1, foreach=True, **extra), backend="triton"
    )
    eager = torch.optim.AdamW(twins, lr=0.1, foreach=True, **extra)
    start = time.perf_counter()
    opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    first_step_s = time.perf_counter() - start
    # (on CUDA, later launches of the same kernels: as the first one found them)
    steps = 3 if device == "cuda" else 1
    for _ in range(steps - 1):
        opt.step()
    for _ in range(steps):
        eager.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    print(json.dumps({
        "compiles": compiles,
        "c_builds": c_builds,
        "files": sorted(os.listdir(os.environ["OPTKERNELS_CACHE_DIR"])),
        "first_step_s": first_step_s,
        "self_hashes": triton_cache.triton_key.cache_info().misses,
        "param": params[0][0].item(),
        "gluon": "triton.experimental.gluon" in sys.modules,
        "imported": any(m.startswith("optkernels_generated_") for m in sys.modules),
    }))
    """
)


def _child(tmp_path, script=CHILD):
    env = dict(
        os.environ,
        OPTKERNELS_CACHE_DIR=str(tmp_path / "src"),
        TRITON_CACHE_DIR=str(tmp_path / "triton"),
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_reuses_the_generated_kernels(tmp_path):
    first = _child(tmp_path)
    second = _child(tmp_path)
    assert first["files"] and first["files"] == second["files"]  # no new source written
    assert second["param"] == first["param"]
    if torch.cuda.is_available():
        assert first["compiles"], "the first process should have run the Triton compiler"
        assert second["compiles"] == [], f"recompiled: {second['compiles']}"
        assert first["self_hashes"] == 1 and second["self_hashes"] == 0
        # The second launches the recorded kernels itself: Triton's binder, which imports
        # its Gluon packages on its first call, did not run.
        assert not second["gluon"]
        # Nor did it import the generated modules (Triton's JIT builds their functions from
        # their source lines): the records keep what its launches need of them.
        assert first["imported"] and not second["imported"]
        # A cold cache: Triton's runtime modules were built ahead, in the background threads
        # the backend started (_triton_compat.prefetch_runtime), none at the first launch.
        assert first["c_builds"], "Triton built no runtime module in a cold cache?"
        background = [n.startswith("optkernels-triton-runtime-") for n in first["c_builds"]]
        assert all(background), first["c_builds"]
        assert second["c_builds"] == []
        # And a fresh cache folder compiles again (the check above can fail).
        third = _child(tmp_path / "fresh")
        assert third["compiles"]


# One generated kernel, launched with three fingerprints (an int argument equal to 1 is a
# constexpr to Triton's JIT; an output 4 bytes off 16-byte alignment another kernel).
LAUNCHES = COUNT_COMPILES + textwrap.dedent(
    """
    import json, sys, textwrap
    import torch
    from triton.runtime import cache as triton_cache
    from optkernels._triton_compat import specialize
    from optkernels.foreach_kernel import load_kernel
    SOURCE = '''
    @triton.jit
    def first_times(ptrs, n, out, SCALE, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        address = tl.load(ptrs + i, mask=mask, other=0)
        x = tl.load(address.to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)
        tl.store(out + i, x * SCALE, mask=mask)
    '''
    kernel = load_kernel(textwrap.dedent(SOURCE), "first_times")
    xs = [torch.full((3,), float(i + 1), device="cuda") for i in range(5)]
    ptrs = torch.tensor([x.data_ptr() for x in xs], device="cuda")
    buffer = torch.zeros(6, device="cuda")
    calls = [(ptrs, 5, buffer[:5], 2.0), (ptrs, 1, buffer[:5], 3.0), (ptrs, 5, buffer[1:], 0.5)]
    results = []
    for _ in range(2):  # (the second round: each fingerprint's compiled kernel, directly)
        for args in calls:
            buffer.zero_()
            kernel[(1,)](*args, BLOCK=8)
            results.append(buffer.tolist())
    gluon = "triton.experimental.gluon" in sys.modules
    imported = any(m.startswith("optkernels_generated_") for m in sys.modules)
    self_hashes = triton_cache.triton_key.cache_info().misses
    same = []  # the specialization made from the fingerprint, and Triton's binder's
    for args in calls:
        key = specialize._fingerprint(kernel.fn, args, {"BLOCK": 8})
        launch = specialize._bind(kernel.fn, args, {"BLOCK": 8})
        made = specialize._specialization(kernel.fn, key, launch.bound)
        same.append(made == launch.specialization and specialize._agrees(key, made))
    print(json.dumps({
        "results": results, "compiles": compiles, "gluon": gluon, "imported": imported,
        "self_hashes": self_hashes, "same": same,
    }))
    """
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_compile_without_triton_s_self_hash_and_launch_from_the_record(tmp_path):
    first = _child(tmp_path, LAUNCHES)
    second = _child(tmp_path, LAUNCHES)
    expected = [
        [2.0, 4.0, 6.0, 8.0, 10.0, 0.0],
        [3.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.5, 1.0, 1.5, 2.0, 2.5],
    ]
    assert first["results"] == second["results"] == expected * 2
    assert first["compiles"] == ["first_times"] * 3  # (one per fingerprint, once)
    assert first["self_hashes"] == 0  # (compiled without Triton's cache: no key needed)
    assert second["compiles"] == [] and second["self_hashes"] == 0
    assert not second["gluon"]  # (Triton's binder never ran)
    assert first["imported"] and not second["imported"]  # (nor Triton's jit decorator)
    assert first["same"] == second["same"] == [True] * 3
