from __future__ import annotations

import subprocess
import sys

OTHERS = {"optguard", "optsidefx", "opttrace", "optcompile", "optcudagraph"}


def test_importing_optkernels_imports_no_tracing_layer():
    code = (
        "import sys, optkernels; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {OTHERS!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
