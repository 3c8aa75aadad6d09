"""Build, test, typecheck and lint sessions for the optcompile monorepo.

Run through the bootstrap script at the repo root: ``./nox`` (every session CI needs) or
``./nox -s demo``. ``./nox -l`` lists the sessions.

Environments are layered to keep CI fast on 2 cores:
- ``.nox/_base`` holds the third-party tools once: torch (the CPU wheel ``torch==2.13.0+cpu``
  on machines without ``nvidia-smi``, installed first and alone, so nothing can pull in a
  CUDA build), triton, numpy, pytest, hypothesis, mypy, ruff. The CPU wheel comes from
  PyTorch's CPU index, named here (``TORCH_CPU_INDEX``); set ``OPTCOMPILE_TORCH_INDEX`` to
  another index URL (a mirror), or to an empty string to use only pip's own configuration.
- ``.nox/_layer-<package>`` sees the base through a ``.pth`` file and pip-installs, editable,
  only that package and its lower layers (pip resolves their dependencies; torch is already
  satisfied). A layer's tests and typecheck therefore run without any higher layer installed.
- ``.nox/_build`` holds hatchling, which builds the wheels (``./nox -s wheels``, into
  ``dist/``); the ``release`` session builds them and installs them offline into fresh
  virtualenvs (``repo_tests/``), with the docs' link check.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "none"
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
ENVS = ROOT / ".nox"

# Layers, lowest first. A package depends only on packages listed before it.
PACKAGES = ["optguard", "optsidefx", "opttrace", "optkernels", "optcudagraph", "optcompile"]

# Direct dependencies on other packages of this repo (mirror of each pyproject.toml).
LOCAL_DEPS: dict[str, list[str]] = {
    "optguard": [],
    "optsidefx": ["optguard"],
    "opttrace": ["optguard", "optsidefx"],
    "optkernels": [],
    "optcudagraph": [],
    "optcompile": ["optguard", "optsidefx", "opttrace", "optkernels", "optcudagraph"],
}

TORCH = "torch>=2.11" if shutil.which("nvidia-smi") else "torch==2.13.0"
# Where the CPU wheel comes from on machines without CUDA. torch==2.13.0 matches 2.13.0+cpu,
# which pip ranks above the plain (CUDA) 2.13.0 of the default index.
TORCH_CPU_INDEX = os.environ.get("OPTCOMPILE_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
TOOLS = ["triton>=3.6", "numpy", "pytest>=8", "hypothesis>=6", "mypy", "ruff"]
# Tests build optguard's native checks in the foreground (deterministic: no tier upgrade mid-test).
TEST_ENV = {"TRITON_INTERPRET": "1", "OPTCOMPILE_NATIVE": "sync"}


def lower_layers(package: str) -> list[str]:
    """The repo packages ``package`` depends on, transitively, in layer order."""
    needed: set[str] = set()
    stack = list(LOCAL_DEPS[package])
    while stack:
        dep = stack.pop()
        if dep not in needed:
            needed.add(dep)
            stack.extend(LOCAL_DEPS[dep])
    return [p for p in PACKAGES if p in needed]


def _python(env: Path) -> str:
    return str(env / "bin" / "python")


def _site_packages(session: nox.Session, env: Path) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    out = session.run(_python(env), "-c", code, silent=True, external=True)
    return str(out).strip()


def _fresh(session: nox.Session, env: Path, stamp: str) -> bool:
    """Create ``env`` unless it exists with the same ``stamp``; True if it must be filled."""
    marker = env / ".optcompile-stamp"
    if marker.exists() and marker.read_text() == stamp:
        return False
    if env.exists():
        shutil.rmtree(env)
    session.run(sys.executable, "-m", "venv", str(env), external=True)
    return True


def _mark(env: Path, stamp: str) -> None:
    (env / ".optcompile-stamp").write_text(stamp)


def base_env(session: nox.Session) -> Path:
    """The shared environment with torch and the tools (built once, reused)."""
    env = ENVS / "_base"
    stamp = "\n".join([TORCH, *TOOLS])
    if _fresh(session, env, stamp):
        pip = [_python(env), "-m", "pip", "install", "-q"]
        if TORCH.startswith("torch==") and TORCH_CPU_INDEX:
            # torch alone from the CPU index, then its dependencies from the usual ones.
            cpu = ["--extra-index-url", TORCH_CPU_INDEX, "--no-deps"]
            session.run(*pip, *cpu, TORCH, external=True)
        session.run(*pip, TORCH, external=True)
        session.run(*pip, *TOOLS, external=True)
        _mark(env, stamp)
    return env


def layer_env(session: nox.Session, package: str) -> Path:
    """An environment with ``package`` and its lower layers (editable) on top of the base."""
    base = base_env(session)
    env = ENVS / f"_layer-{package}"
    pyprojects = [
        ROOT / "packages" / p / "pyproject.toml" for p in [*lower_layers(package), package]
    ]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in pyprojects)).hexdigest()
    stamp = f"{base}\n{digest}"
    if _fresh(session, env, stamp):
        pth = Path(_site_packages(session, env)) / "_optcompile_base.pth"
        pth.write_text(_site_packages(session, base) + "\n")
        editables = [
            arg for p in [*lower_layers(package), package] for arg in ("-e", f"packages/{p}")
        ]
        session.run(_python(env), "-m", "pip", "install", "-q", *editables, external=True)
        _mark(env, stamp)
    return env


BUILD_TOOLS = ["hatchling>=1.27"]
DIST = ROOT / "dist"


def build_env(session: nox.Session) -> Path:
    """A small environment with the build backend (the wheels build without isolation)."""
    env = ENVS / "_build"
    stamp = "\n".join(BUILD_TOOLS)
    if _fresh(session, env, stamp):
        session.run(_python(env), "-m", "pip", "install", "-q", *BUILD_TOOLS, external=True)
        _mark(env, stamp)
    return env


def build_wheels(session: nox.Session) -> None:
    """The six packages' wheels, built anew into ``dist/``."""
    DIST.mkdir(exist_ok=True)
    for old in DIST.glob("*.whl"):
        if old.name.split("-")[0] in PACKAGES:
            old.unlink()
    python = _python(build_env(session))
    sources = [f"packages/{p}" for p in PACKAGES]
    pip = [python, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps"]
    session.run(*pip, "-w", str(DIST), *sources, external=True)


@nox.session
def wheels(session: nox.Session) -> None:
    """Build all six wheels into dist/ (pip install --find-links dist optcompile)."""
    build_wheels(session)


@nox.session
def release(session: nox.Session) -> None:
    """What a user gets: the wheels install offline into fresh venvs and run a compiled
    step; package metadata; every relative link in the markdown files resolves."""
    build_wheels(session)
    python = _python(base_env(session))
    env = {"OPTCOMPILE_DIST": str(DIST)}
    session.run(
        python, "-m", "pytest", "repo_tests", "-q", *session.posargs, env=env, external=True
    )


@nox.session
def lint(session: nox.Session) -> None:
    python = _python(base_env(session))
    session.run(python, "-m", "ruff", "check", ".", external=True)
    session.run(python, "-m", "ruff", "format", "--check", ".", external=True)


@nox.session
@nox.parametrize("package", PACKAGES)
def typecheck(session: nox.Session, package: str) -> None:
    python = _python(layer_env(session, package))
    config = f"packages/{package}/pyproject.toml"
    session.run(
        python,
        "-m",
        "mypy",
        "--strict",
        "--config-file",
        config,
        f"packages/{package}/src",
        external=True,
    )


# Run in a layer's environment: importing the package must import no other repo package
# that is not one of its lower layers.
LAYER_CHECK = """
import importlib, sys
package, allowed, repo = sys.argv[1], set(sys.argv[2].split()), set(sys.argv[3].split())
importlib.import_module(package)
extra = sorted({m.split(".")[0] for m in sys.modules} & repo - allowed - {package})
sys.exit(f"{package} imports higher layers: {extra}" if extra else 0)
"""


def _pytest(session: nox.Session, package: str, path: str) -> None:
    python = _python(layer_env(session, package))
    session.run(python, "-m", "pytest", path, "-q", *session.posargs, env=TEST_ENV, external=True)


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    python = _python(layer_env(session, package))
    allowed = " ".join(lower_layers(package))
    session.run(python, "-c", LAYER_CHECK, package, allowed, " ".join(PACKAGES), external=True)
    _pytest(session, package, f"packages/{package}/tests")


@nox.session
def integration(session: nox.Session) -> None:
    _pytest(session, "optcompile", "integration_tests")


@nox.session
def demo(session: nox.Session) -> None:
    python = _python(layer_env(session, "optcompile"))
    # The native checks are built ahead, as a user does after installing (a no-op when built).
    session.run(python, "-m", "optguard", "build", external=True)
    session.run(python, "-m", "optcompile.demo", *session.posargs, external=True)


# Everything, in this order; a parametrized name selects all of its parametrizations.
nox.options.sessions = ["lint", "typecheck", "tests", "integration", "demo", "release"]
