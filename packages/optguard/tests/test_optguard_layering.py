from __future__ import annotations

import subprocess
import sys

HIGHER = {"optsidefx", "opttrace", "optkernels", "optcompile", "optcudagraph"}


def test_importing_optguard_imports_no_higher_layer():
    code = (
        "import sys, optguard; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HIGHER!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
