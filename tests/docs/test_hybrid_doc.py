"""docs/hybrid.md: its python blocks run in order, and its printed outputs are what the code prints."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import pytest

from qir.march import get_march, set_march

PAGE = Path(__file__).resolve().parents[2] / "docs" / "hybrid.md"

pytest.importorskip("onnxscript")  # the page exports the seed's model to ONNX


def test_hybrid_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = PAGE.read_text(encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "docs_hybrid"}
    printed = io.StringIO()
    before = get_march(default=None)
    try:
        with contextlib.redirect_stdout(printed), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)):
                exec(compile(code, f"hybrid.md[python block {i}]", "exec"), namespace)
    finally:
        set_march(before)
    table, error, report = re.findall(r"^```text\n(.*?)^```", text, re.S | re.M)
    assert table.strip() in printed.getvalue()  # print(hybrid_placement(qat_model))
    assert error.strip() == namespace["message"]
    assert report.strip() in str(namespace["report"])
