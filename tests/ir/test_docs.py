"""The examples in docs/ir.md and docs/testing.md stay true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qir.ir import parse_graph, print_graph, verify

DOCS = Path(__file__).resolve().parents[2] / "docs"


def blocks(page: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (DOCS / page).read_text(), re.S)


@pytest.mark.parametrize("text", blocks("ir.md", "qir"))
def test_ir_md_text_examples_round_trip(text: str) -> None:
    g = parse_graph(text, allow_unbound=True)
    verify(g)
    assert print_graph(g) == text.strip()


@pytest.mark.parametrize("code", blocks("testing.md", "python"))
def test_testing_md_examples_run(code: str) -> None:
    exec(compile(code, "docs/testing.md", "exec"), {"__name__": "docs_example"})


def test_docs_have_examples() -> None:
    assert blocks("ir.md", "qir") and len(blocks("testing.md", "python")) >= 3
