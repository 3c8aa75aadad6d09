"""Package metadata: versions, dependency bounds, license files, and the noxfile's mirror."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["optguard", "optsidefx", "opttrace", "optkernels", "optcudagraph", "optcompile"]


def _pyproject(name: str) -> dict:
    return tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())


def _version(name: str) -> str:
    tree = ast.parse((ROOT / "packages" / name / "src" / name / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__version__"]:
            assert isinstance(node.value, ast.Constant)
            return str(node.value.value)
    raise AssertionError(f"{name}/__init__.py sets no __version__")


def _local_requirements(name: str) -> dict[str, str]:
    found = {}
    for requirement in _pyproject(name)["project"]["dependencies"]:
        dist = re.split(r"[<>=!~ ]", requirement, maxsplit=1)[0]
        if dist in PACKAGES:
            found[dist] = requirement[len(dist) :]
    return found


def _as_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


@pytest.mark.parametrize("name", PACKAGES)
def test_metadata_names_the_license_and_reads_the_version_from_the_package(name):
    project = _pyproject(name)["project"]
    assert project["license"] == "BSD-3-Clause"
    assert project["license-files"] == ["LICENSE"]
    assert "version" in project["dynamic"] and "version" not in project
    assert project["classifiers"] and project["description"] and project["readme"]
    assert "urls" not in project  # none until the project has a public home
    assert (ROOT / "packages" / name / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()


def test_every_package_has_the_same_version():
    assert {_version(name) for name in PACKAGES} == {_version("optcompile")}


@pytest.mark.parametrize("name", PACKAGES)
def test_dependencies_on_other_layers_are_bounded_and_admit_their_version(name):
    for dist, spec in _local_requirements(name).items():
        lower = re.search(r">=([\d.]+)", spec)
        upper = re.search(r"<([\d.]+)", spec)
        assert lower and upper, f"{name} depends on {dist}{spec}: give it >= and < bounds"
        version = _as_tuple(_version(dist))
        assert _as_tuple(lower.group(1)) <= version < _as_tuple(upper.group(1)), (dist, spec)


def test_the_noxfile_mirrors_the_dependencies_between_layers():
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    [node] = [
        n
        for n in tree.body
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "LOCAL_DEPS"
    ]
    mirror = ast.literal_eval(node.value)
    assert {name: sorted(deps) for name, deps in mirror.items()} == {
        name: sorted(_local_requirements(name)) for name in PACKAGES
    }
