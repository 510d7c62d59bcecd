"""Golden IR text tests: each ``*.qir`` file under tests/golden is one test.

A file holds one input graph and directives in ``//`` comments (the parser skips them)::

    // RUN: absorb-bn, dce                (the pipeline; "// RUN:" alone = identity)
    graph @main(...) { ... }
    // CHECK: graph @main(...) {          (the exact expected output, one line per CHECK)
    // CHECK:   %y: ... = relu(%x)
    // CHECK: }

Expected output comes from the ``// CHECK:`` lines, else from ``<name>.expected`` beside
the file, else it is the input graph itself (a print/parse round-trip test). Unlike
FileCheck, the CHECK lines are the whole output, compared exactly. ``// ERROR: text``
instead expects parsing, verification or the pipeline to fail with ``text`` in the message.

The input is parsed with ``allow_unbound=True`` (constants are zeros of their declared
type) and verified; the pipeline runs through ``passes.manager.PassManager`` and the
result is verified and printed. ``QIR_UPDATE_GOLDEN=1 pytest tests/golden`` rewrites the
expected output of failing files in place (review the diff before committing).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import attrs
import pytest

from qir.ir import Graph, parse_graph, print_graph, verify

HERE = Path(__file__).parent
FILES = sorted(HERE.rglob("*.qir"))

RUN, CHECK, ERROR = "// RUN:", "// CHECK:", "// ERROR:"


@attrs.frozen
class GoldenCase:
    path: Path
    text: str
    pipeline: str
    expected: str | None  # None: the input itself
    errors: tuple[str, ...]
    from_file: bool  # expected output lives in <name>.expected


def _directive(line: str, prefix: str) -> str | None:
    s = line.strip()
    if not s.startswith(prefix):
        return None
    rest = s[len(prefix) :]
    return rest[1:] if rest.startswith(" ") else rest


def load(path: Path) -> GoldenCase:
    text = path.read_text()
    runs, checks, errors = [], [], []
    for i, line in enumerate(text.splitlines(), 1):
        if (r := _directive(line, RUN)) is not None:
            runs.append(r.strip())
        elif (c := _directive(line, CHECK)) is not None:
            checks.append(c)  # indentation after "// CHECK: " is kept
        elif (e := _directive(line, ERROR)) is not None:
            errors.append(e.strip())
        elif line.lstrip().startswith("// CHECK") or line.lstrip().startswith("// RUN"):
            raise ValueError(f"{path}:{i}: unknown directive {line.strip()!r}; use {RUN!r}, {CHECK!r} or {ERROR!r}")
    if len(runs) != 1:
        raise ValueError(f"{path}: needs exactly one '{RUN} <pipeline>' line, found {len(runs)}")
    expected_file = path.with_suffix(".expected")
    if checks and expected_file.exists():
        raise ValueError(f"{path}: has both CHECK lines and {expected_file.name}; keep one")
    expected: str | None = "\n".join(checks) if checks else None
    if expected is None and expected_file.exists():
        expected = expected_file.read_text().rstrip("\n")
    if errors and expected is not None:
        raise ValueError(f"{path}: ERROR lines and an expected output exclude each other")
    return GoldenCase(path, text, runs[0], expected, tuple(errors), expected_file.exists())


def input_graph_text(text: str) -> str:
    """The input graph as written: the file without comment-only lines and blank edges."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("//")]
    return "\n".join(lines).strip("\n")


def run_case(case: GoldenCase) -> str:
    graph: Graph = parse_graph(case.text, allow_unbound=True, source=case.path.name)
    verify(graph)
    if case.pipeline:
        from passes.manager import PassManager  # imported here: the IR tests must not need passes

        graph = PassManager(case.pipeline).run(graph, inplace=True).graph
        verify(graph)
    return print_graph(graph)


def update(case: GoldenCase, actual: str) -> None:
    if case.from_file:
        case.path.with_suffix(".expected").write_text(actual + "\n")
        return
    kept = [ln for ln in case.text.splitlines() if _directive(ln, CHECK) is None]
    while kept and not kept[-1].strip():
        kept.pop()
    checks = [f"{CHECK} {ln}" if ln else CHECK for ln in actual.splitlines()]
    case.path.write_text("\n".join([*kept, "", *checks]) + "\n")


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(HERE)) for p in FILES])
def test_golden(path: Path) -> None:
    case = load(path)
    if case.errors:
        with pytest.raises(Exception) as info:
            run_case(case)
        for e in case.errors:
            assert e in str(info.value), f"{path.name}: expected an error containing {e!r}, got:\n{info.value}"
        return
    actual = run_case(case)
    expected = case.expected if case.expected is not None else input_graph_text(case.text)
    if actual == expected:
        return
    if os.environ.get("QIR_UPDATE_GOLDEN") and case.expected is not None:
        update(case, actual)
        pytest.skip(f"updated {path.name}")
    diff = "\n".join(
        difflib.unified_diff(expected.splitlines(), actual.splitlines(), "expected", "actual", lineterm="")
    )
    pytest.fail(f"{path.name} (pipeline {case.pipeline!r}) output differs:\n{diff}", pytrace=False)


def test_there_are_golden_files() -> None:
    assert len(FILES) >= 6


def test_directive_errors(tmp_path: Path) -> None:
    bad = tmp_path / "x.qir"
    bad.write_text("graph @m() {\n  return None\n}\n")
    with pytest.raises(ValueError, match="exactly one"):
        load(bad)
    bad.write_text("// RUN:\n// CHECK-NEXT: x\ngraph @m() {\n  return None\n}\n")
    with pytest.raises(ValueError, match="unknown directive"):
        load(bad)


def test_update_rewrites_check_lines(tmp_path: Path) -> None:
    f = tmp_path / "u.qir"
    f.write_text("// RUN:\ngraph @m() {\n  return None\n}\n\n// CHECK: stale\n")
    case = load(f)
    update(case, run_case(case))
    assert load(f).expected == "graph @m() {\n  return None\n}"
