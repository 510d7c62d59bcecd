"""docs/tutorial.md promises its python blocks run as written: run them, in order, in one namespace."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from qir.march import get_march, set_march

DOC = Path(__file__).resolve().parents[2] / "docs" / "tutorial.md"


def _fenced(text: str) -> tuple[list[str], list[str]]:
    """(python blocks, plain blocks) of a markdown text."""
    python: list[str] = []
    plain: list[str] = []
    current: list[str] | None = None
    target = python
    for line in text.splitlines():
        if current is None and line.startswith("```"):
            current, target = [], (python if line.strip() == "```python" else plain)
        elif current is not None and line.strip() == "```":
            target.append("\n".join(current) + "\n")
            current = None
        elif current is not None:
            current.append(line)
    return python, plain


def test_tutorial_blocks_run() -> None:
    text = DOC.read_text()
    blocks, shown = _fenced(text)
    assert len(blocks) >= 7
    before = get_march(default=None)
    ns: dict[str, object] = {}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            for i, block in enumerate(blocks):
                exec(compile(block, f"{DOC.name}[block {i}]", "exec"), ns)
    finally:
        set_march(before)
    # the printouts the page shows are what the code prints
    printed = out.getvalue()
    for expected in shown:
        assert expected.strip() in printed, expected
