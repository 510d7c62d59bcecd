"""docs/qconfig.md promises its code blocks run as written; run them, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

from qir.march import get_march, set_march

DOC = Path(__file__).resolve().parents[2] / "docs" / "qconfig.md"


def test_qconfig_doc_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 8
    before = get_march(default=None)
    ns: dict[str, object] = {}
    try:
        for i, block in enumerate(blocks):
            exec(compile(block, f"{DOC.name}[block {i}]", "exec"), ns)
    finally:
        set_march(before)
