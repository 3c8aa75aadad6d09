"""The private Triton APIs optkernels uses, in one place (a Triton upgrade is one edit here).

Triton's JIT keys its disk cache by a hash of Triton's own source files (``triton_key``),
computed once per process: about 0.4 s in a fresh process before any cached binary is
found; and its binder (``native_specialize_impl``) imports Triton's Gluon packages on its
first call (0.17 s where they have no .pyc). So each generated kernel keeps a small record
next to its source: for each fingerprint of the arguments it was launched with (what the
JIT specializes on, or finer: ``_fingerprint``), Triton's cache entry (the hash and the
files) and the signature its launcher is built for; and, once, what a launch needs of the
function itself (``_Recorded``: its name, debug setting and parameters). A later process
builds the compiled kernel from those files and launches it itself: Triton neither
compiles, hashes itself nor binds, and the function's module is not even imported (Triton's
``@triton.jit`` builds a JITFunction from its source lines: ~2 ms each). Anything
unexpected (another Triton, target or setting, files gone, a JIT that specializes
differently, a launcher that refuses the arguments) falls back to Triton's own path, which
is always correct, only slower.

A process whose kernels are not recorded yet (a cold cache) compiles them: through
Triton's stages as ``triton.compile`` does on a miss, but into files beside the record
instead of Triton's cache (``_compile``), so without Triton's self-hash (its cache key)
and without its binder (the specialization is made from the fingerprint). Where that
cannot be done as Triton would (hooks, overrides or dumps set, parameters with settings,
anything unexpected), Triton's JIT compiles, after its self-hash: most of it reading and
hashing ``libtriton`` (hundreds of MB), which runs without the GIL. ``prefetch_triton_key``
starts that in a background thread when the backend is made on a cold cache
(``compile()``), so that such a first compile finds it done or under way.

The private APIs are used only in this package, optkernels' Triton compat layer, one module
per concept: ``kernel`` (``Kernel``: a launch, direct or through Triton's JIT), ``records``
(the record files), ``specialize`` (a launch's fingerprint and specialization), ``stages``
(the cold cache's compile through Triton's stages), ``prefetch`` (the background threads
and the current device) and ``version`` (which Triton this is).
"""

from optkernels._triton_compat.kernel import Kernel
from optkernels._triton_compat.prefetch import (
    launch_signature,
    prefetch_runtime,
    prefetch_triton_key,
)

__all__ = ["Kernel", "launch_signature", "prefetch_runtime", "prefetch_triton_key"]
