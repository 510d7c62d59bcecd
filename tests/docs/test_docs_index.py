"""docs/README.md links every page of docs/, and every link it has resolves."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_index_lists_every_page() -> None:
    links = re.findall(r"\]\(([^)#]+)\)", (DOCS / "README.md").read_text(encoding="utf-8"))
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert set(links) == pages, (sorted(pages - set(links)), sorted(set(links) - pages))
    assert len(links) == len(set(links))
    assert links[0] == "tutorial.md"


def test_readme_links_the_index() -> None:
    assert "(docs/README.md)" in (DOCS.parent / "README.md").read_text(encoding="utf-8")
