"""Every ```python block of docs/*.md and README.md runs as written.

Each file's blocks run in order in one fresh namespace, in a temporary working directory.
A block preceded by an HTML comment starting ``<!-- not-run`` (with a reason:
``<!-- not-run: signature -->``) is skipped; it is meant for API outlines, signatures and
excerpts, and for code that needs torchvision, a GPU or files that are not in the repo.
Pages whose blocks another test already runs are listed in ``RUN_ELSEWHERE`` and not run
twice.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import sys
import types
import warnings
from pathlib import Path

import pytest

from qir.march import get_march, set_march

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

#: page -> the test that runs its python blocks
RUN_ELSEWHERE = {
    "tutorial.md": "tests/flows/test_docs_tutorial.py",
    "modules.md": "tests/nn/test_docs_modules.py",
    "onnx.md": "tests/onnx/test_onnx_docs.py",
    "qconfig.md": "tests/quantization/test_docs_qconfig.py",
    "testing.md": "tests/ir/test_docs.py",
    "legality.md": "tests/quantization/test_check_model.py",
    "hybrid.md": "tests/docs/test_hybrid_doc.py",
    "passes.md": "tests/passes/test_manager.py",
    "patterns.md": "tests/passes/test_patterns.py",
}
#: page -> (block index -> why it cannot run) for pages this test may not edit
NOT_RUN_HERE = {
    "README.md": {0: "a fragment: `model` and `example_input` are the reader's"},
}
#: page -> modules its blocks need (optional extras): the page is skipped without them
NEEDS = {
    "migration.md": ("onnx", "onnxscript", "onnxruntime"),
}

_FENCE = re.compile(r"^(?P<marker><!-- not-run[^\n]*-->\n)?```python\n(?P<code>.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[tuple[str, bool]]:
    """(code, runnable) for every ```python block, in order."""
    return [(m["code"], m["marker"] is None) for m in _FENCE.finditer(text)]


def test_marker_parsing() -> None:
    text = "a\n```python\nx = 1\n```\n<!-- not-run: signature -->\n```python\nf(a, b) -> C\n```\n```text\nno\n```\n"
    assert python_blocks(text) == [("x = 1\n", True), ("f(a, b) -> C\n", False)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if page.name in RUN_ELSEWHERE and page.parent.name == "docs":
        pytest.skip(f"run by {RUN_ELSEWHERE[page.name]}")
    for module in NEEDS.get(page.name, ()):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    skipped = NOT_RUN_HERE.get(page.name, {}) if page.parent == ROOT else {}
    monkeypatch.chdir(tmp_path)
    before = get_march(default=None)
    # a real module, as a user's code would be: typing.get_type_hints (pass options) looks
    # classes' annotations up in sys.modules[cls.__module__]
    module = types.ModuleType(f"docs_{page.stem}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TracerWarning etc.: the pages' own tests check warnings
            for i, (code, runnable) in enumerate(blocks):
                if runnable and i not in skipped:
                    exec(compile(code, f"{page.name}[python block {i}]", "exec"), namespace)
    finally:
        set_march(before)
        os.chdir(ROOT)
