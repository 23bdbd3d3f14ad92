"""The documentation points at things that exist: relative links and the `docs/design.md §N` sections the code cites."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document: Path) -> None:
    targets = [t for t in LINK.findall(document.read_text()) if not re.match(r"[a-z]+://", t)]
    missing = [t for t in targets if not (document.parent / t).exists()]
    assert not missing, f"{document.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_cited_design_sections_exist() -> None:
    sections = {int(n) for n in re.findall(r"^## (\d+)\.", (ROOT / "docs" / "design.md").read_text(), re.M)}
    cited = {}
    for path in [*(ROOT / "vlm_retrofit").rglob("*.py"), *(ROOT / "docs").glob("*.md")]:
        for number in re.findall(r"design\.md §(\d+)", path.read_text()):
            cited.setdefault(int(number), []).append(path.name)
    assert cited, "no code cites docs/design.md: this test checks nothing"
    unknown = {n: files for n, files in cited.items() if n not in sections}
    assert not unknown, f"cited sections of docs/design.md that it does not have: {unknown}"
