"""Build, test, typecheck and lint sessions for the optcompile monorepo.

Run through the bootstrap script at the repo root: ``./nox`` (every session) or
``./nox -s demo``. ``./nox -l`` lists the sessions.

Torch is always installed first, in its own pip call: the CPU wheel (``torch==2.13.0``) on
machines without ``nvidia-smi``, ``torch>=2.11`` on GPU machines. Nothing installed later can
then pull in a CUDA build of torch on a CPU-only machine.
"""

from __future__ import annotations

import shutil

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

# Layers, lowest first. A package depends only on packages listed before it.
PACKAGES = ["optguard", "optsidefx", "opttrace", "optkernels", "optcompile"]

# Direct dependencies on other packages of this repo (mirror of each pyproject.toml).
LOCAL_DEPS: dict[str, list[str]] = {
    "optguard": [],
    "optsidefx": ["optguard"],
    "opttrace": ["optguard", "optsidefx"],
    "optkernels": [],
    "optcompile": ["optguard", "optsidefx", "opttrace", "optkernels"],
}

TEST_ENV = {"TRITON_INTERPRET": "1"}


def lower_layers(package: str) -> list[str]:
    """The repo packages `package` depends on, transitively, in layer order."""
    needed: set[str] = set()
    stack = list(LOCAL_DEPS[package])
    while stack:
        dep = stack.pop()
        if dep not in needed:
            needed.add(dep)
            stack.extend(LOCAL_DEPS[dep])
    return [p for p in PACKAGES if p in needed]


def install_torch(session: nox.Session) -> None:
    """Install torch on its own, before anything that depends on it."""
    if shutil.which("nvidia-smi"):
        session.install("torch>=2.11")
    else:
        session.install("torch==2.13.0")


def install_packages(session: nox.Session, package: str, *, extra: str = "") -> None:
    """Editable-install `package` and its lower layers (never a higher one)."""
    args: list[str] = []
    for dep in lower_layers(package):
        args += ["-e", f"packages/{dep}"]
    args += ["-e", f"packages/{package}{extra}"]
    session.install(*args)


def install_all(session: nox.Session) -> None:
    args: list[str] = []
    for package in PACKAGES:
        args += ["-e", f"packages/{package}"]
    session.install(*args)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
@nox.parametrize("package", PACKAGES)
def typecheck(session: nox.Session, package: str) -> None:
    install_torch(session)
    install_packages(session, package)
    session.install("mypy")
    session.run(
        "mypy",
        "--strict",
        "--config-file",
        f"packages/{package}/pyproject.toml",
        f"packages/{package}/src",
    )


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    install_torch(session)
    install_packages(session, package, extra="[test]")
    session.run("pytest", f"packages/{package}/tests", "-q", *session.posargs, env=TEST_ENV)


@nox.session
def integration(session: nox.Session) -> None:
    install_torch(session)
    install_all(session)
    session.install("pytest>=8", "hypothesis>=6")
    session.run("pytest", "integration_tests", "-q", *session.posargs, env=TEST_ENV)


@nox.session
def demo(session: nox.Session) -> None:
    install_torch(session)
    install_all(session)
    session.run("python", "-m", "optcompile.demo", *session.posargs)


# Everything, in this order; a parametrized name selects all of its parametrizations.
nox.options.sessions = ["lint", "typecheck", "tests", "integration", "demo"]
