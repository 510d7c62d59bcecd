"""docs/ir-ops.md is the op registry's current table."""

from __future__ import annotations

from pathlib import Path

from qir.ir.op_list import op_list_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "ir-ops.md"


def test_op_list_doc_is_current() -> None:
    text = op_list_markdown()
    assert "| `conv2d` | `nn.Conv2d` |" in text and "| `relu` |" in text
    assert DOC.read_text(encoding="utf-8") == text, (
        "docs/ir-ops.md is out of date: run `python -m qir.ir.op_list > docs/ir-ops.md`"
    )
