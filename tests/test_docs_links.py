"""Every relative link in README.md and docs/*.md reaches a file of the repository, and every
`#anchor` a heading of that file (GitHub's slugs). Fast: reads a dozen Markdown files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.workflow_helpers import REPO

DOCS = [
    REPO / "README.md",
    REPO / "benchmarks" / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a `# comment` there is no heading)."""
    return "\n".join(text.split("```")[::2])


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats -1, -2."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(path.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.+)", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(path: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(path.read_text())) if "://" not in target]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc):
    broken = []
    for target in _links(doc):
        file, _, anchor = target.partition("#")
        linked = (doc.parent / file).resolve() if file else doc
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def test_anchors_are_githubs():
    assert {"all-settings", "data-prepare-and-the-dry-run-checks"} <= _anchors(
        REPO / "docs" / "configuration.md"
    )
    assert "2-status-sacct-by-default-squeue-on-request-no-accounting--hang" in _anchors(
        REPO / "docs" / "slurm-notes.md"
    )


def test_the_readme_maps_every_doc():
    """The README's documentation table names every file of docs/."""
    linked = {(REPO / target.partition("#")[0]).resolve() for target in _links(REPO / "README.md")}
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md links none of docs/{missing}"
