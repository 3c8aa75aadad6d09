"""The built wheels, as a user installs them: offline, into fresh virtualenvs.

Needs the wheels in ``$OPTCOMPILE_DIST`` (default ``dist/``): ``./nox -s release`` builds
them and runs this file. torch, triton and numpy come from the environment running the tests
(a ``.pth`` file, as the nox layer environments do); nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DIST = Path(os.environ.get("OPTCOMPILE_DIST", ROOT / "dist"))
PACKAGES = ["optguard", "optsidefx", "opttrace", "optkernels", "optcudagraph", "optcompile"]


@pytest.fixture(scope="module")
def wheels() -> dict[str, Path]:
    found = {p.name.split("-")[0]: p for p in DIST.glob("*.whl")}
    missing = [p for p in PACKAGES if p not in found]
    if missing:
        pytest.skip(f"no wheels of {missing} in {DIST}: build them with ./nox -s wheels")
    return {p: found[p] for p in PACKAGES}


def _metadata(wheel: Path) -> tuple[dict[str, list[str]], dict[str, bytes]]:
    with zipfile.ZipFile(wheel) as z:
        files = {name: z.read(name) for name in z.namelist() if ".dist-info/" in name}
    [meta] = [v for k, v in files.items() if k.endswith(".dist-info/METADATA")]
    headers = Parser().parsestr(meta.decode())
    return {key: headers.get_all(key) or [] for key in set(headers.keys())}, files


def test_each_wheel_carries_the_license_and_bounded_dependencies(wheels):
    license_text = (ROOT / "LICENSE").read_bytes()
    for name, wheel in wheels.items():
        meta, files = _metadata(wheel)
        assert meta["License-Expression"] == ["BSD-3-Clause"], name
        [license_file] = [k for k in files if k.endswith(".dist-info/licenses/LICENSE")]
        assert files[license_file] == license_text, name
        assert meta["Classifier"], name
        assert not meta.get("Project-URL"), name  # none until there is a real one
        for requirement in meta.get("Requires-Dist", []):
            if requirement.split("<")[0].split(">")[0] in PACKAGES:
                assert "<" in requirement and ">=" in requirement, (name, requirement)
        with zipfile.ZipFile(wheel) as z:
            shipped = set(z.namelist())
        assert f"{name}/py.typed" in shipped and f"{name}/__init__.py" in shipped, name
    with zipfile.ZipFile(wheels["optguard"]) as z:
        assert "optguard/_native.cpp" in z.namelist()  # built on first use, from the wheel


def _pip_env() -> dict[str, str]:
    """This machine's pip settings left out: the install must work from dist/ alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    return env


def _fresh_venv(where: Path) -> Path:
    """A virtualenv that sees torch's site-packages (and nothing of this repository)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    torch_site = Path(torch.__file__).resolve().parent.parent
    (Path(purelib) / "_base.pth").write_text(f"{torch_site}\n")
    return python


def _pip_install(python: Path, *requirements: str) -> None:
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index"]
    done = subprocess.run(
        [*pip, "--find-links", str(DIST), *requirements],
        env=_pip_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _run(python: Path, code: str, cwd: Path) -> str:
    env = {**_pip_env(), "OPTCOMPILE_NATIVE": "0"}
    done = subprocess.run(
        [str(python), "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


ONE_STEP = """
import copy, sys
import torch, optcompile
import optguard, optsidefx, opttrace, optkernels, optcudagraph
for module in (optguard, optsidefx, opttrace, optkernels, optcudagraph, optcompile):
    assert module.__file__.startswith(sys.prefix), module.__file__  # the installed copy
    assert module.__version__ == optcompile.__version__
model = torch.nn.Linear(4, 2)
twin = copy.deepcopy(model)
opt = optcompile.compile(torch.optim.AdamW(model.parameters(), lr=1e-2))
eager = torch.optim.AdamW(twin.parameters(), lr=1e-2)
for m, o in ((model, opt), (twin, eager)):
    m(torch.ones(3, 4)).sum().backward()
    o.step()
torch.testing.assert_close(list(model.parameters()), list(twin.parameters()))
report = optcompile.explain(opt)
assert report.traces == 1 and report.fallback_reason is None, report
print("compiled step matches eager", optcompile.__version__, report.backend)
"""


def test_the_full_stack_installs_offline_and_runs_a_compiled_step(wheels, tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    _run(python, "import importlib.util as u; assert u.find_spec('optcompile') is None", tmp_path)
    _pip_install(python, "optcompile")
    out = _run(python, ONE_STEP, tmp_path)
    # CPU params: the generated C backend where a C compiler is found, else the torch one
    compiler = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
    backend = "cpu" if compiler else "torch"
    assert out.startswith(f"compiled step matches eager 0.1.0 {backend}"), out


def test_one_layer_installs_alone(wheels, tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    _pip_install(python, "optguard")
    check = (
        "import importlib.util as u, optguard, sys\n"
        "assert optguard.__file__.startswith(sys.prefix)\n"
        "others = ['optsidefx', 'opttrace', 'optkernels', 'optcudagraph', 'optcompile']\n"
        "print([m for m in others if u.find_spec(m) is not None])\n"
    )
    assert _run(python, check, tmp_path).strip() == "[]"
