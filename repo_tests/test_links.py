"""Every relative link in the repository's markdown files resolves (files and #anchors)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", ".nox", ".venv-nox", "dist", "build", "scratch", "node_modules"}
# [text](target) and ![alt](target); a target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    return sorted(
        p
        for p in ROOT.rglob("*.md")
        if not any(part in SKIP_DIRS or part.startswith(".") for part in p.relative_to(ROOT).parts)
    )


def links(text: str) -> list[str]:
    text = CODE.sub("", FENCE.sub("", text))
    return LINK.findall(text)


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    found: set[str] = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", CODE.sub(lambda m: m.group(0)[1:-1], heading[1]))
            slug = text.strip().lower().replace(" ", "-")
            n = 1
            candidate = slug
            while candidate in found:
                candidate = f"{slug}-{n}"
                n += 1
            found.add(candidate)
    return found


def test_the_link_finder_sees_links_and_skips_code():
    text = "[a](docs/x.md) ![p](p.png) `[b](no.md)`\n```\n[c](no2.md)\n```\n[d](https://e.org)"
    assert links(text) == ["docs/x.md", "p.png", "https://e.org"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in links(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target} (no {resolved.relative_to(ROOT)})")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target} (no heading #{fragment} in {resolved.name})")
    assert not broken, f"{path.relative_to(ROOT)}: broken links: {broken}"
