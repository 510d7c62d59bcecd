"""Golden IR text tests for passes: one ``.qir`` file per test (docs/testing.md).

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
result is verified and printed. :func:`check_golden` runs one file; with ``update=True``
it rewrites the expected output of a failing file in place (review the diff).
"""

from __future__ import annotations

import difflib
from pathlib import Path

import attrs

from passes.manager import PassManager
from qir.ir import Graph, parse_graph, print_graph, verify

__all__ = ["GoldenCase", "GoldenMismatch", "check_golden", "golden_files", "load_golden", "run_golden"]

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


def load_golden(path: Path) -> GoldenCase:
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


def run_golden(case: GoldenCase) -> str:
    graph: Graph = parse_graph(case.text, allow_unbound=True, source=case.path.name)
    verify(graph)
    if case.pipeline:
        graph = PassManager(case.pipeline).run(graph, inplace=True).graph
        verify(graph)
    return print_graph(graph)


def update_golden(case: GoldenCase, actual: str) -> None:
    if case.from_file:
        case.path.with_suffix(".expected").write_text(actual + "\n")
        return
    kept = [ln for ln in case.text.splitlines() if _directive(ln, CHECK) is None]
    while kept and not kept[-1].strip():
        kept.pop()
    checks = [f"{CHECK} {ln}" if ln else CHECK for ln in actual.splitlines()]
    case.path.write_text("\n".join([*kept, "", *checks]) + "\n")


class GoldenMismatch(AssertionError):
    """A golden file's output differs from its expectation, or its expected error did not occur."""


def golden_files(directory: str | Path) -> list[Path]:
    """Every ``*.qir`` file under ``directory``, sorted (one test each)."""
    return sorted(Path(directory).rglob("*.qir"))


def check_golden(path: str | Path, update: bool = False) -> str:
    """Run golden file ``path``; return ``"passed"`` or ``"updated"``, or raise :class:`GoldenMismatch`
    with a unified diff (or the missing error text). ``update=True`` rewrites a mismatching
    file's CHECK lines (or ``.expected`` file) from the actual output."""
    case = load_golden(Path(path))
    if case.errors:
        try:
            run_golden(case)
        except Exception as e:
            missing = [t for t in case.errors if t not in str(e)]
            if missing:
                raise GoldenMismatch(f"{case.path.name}: expected an error containing {missing[0]!r}, got:\n{e}") from e
            return "passed"
        raise GoldenMismatch(
            f"{case.path.name}: expected an error containing {case.errors[0]!r}; the pipeline succeeded"
        )
    actual = run_golden(case)
    expected = case.expected if case.expected is not None else input_graph_text(case.text)
    if actual == expected:
        return "passed"
    if update and case.expected is not None:
        update_golden(case, actual)
        return "updated"
    diff = "\n".join(
        difflib.unified_diff(expected.splitlines(), actual.splitlines(), "expected", "actual", lineterm="")
    )
    raise GoldenMismatch(f"{case.path.name} (pipeline {case.pipeline!r}) output differs:\n{diff}")
