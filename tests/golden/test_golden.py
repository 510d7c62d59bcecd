"""Golden IR text tests: each ``*.qir`` file under tests/golden is one test, run by the public
runner :mod:`qir.testing.golden` (docs/testing.md). ``QIR_UPDATE_GOLDEN=1 pytest tests/golden``
rewrites the expected output of failing files in place (review the diff before committing)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qir.testing.golden import check_golden, golden_files, load_golden, run_golden, update_golden

HERE = Path(__file__).parent
FILES = golden_files(HERE)


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(HERE)) for p in FILES])
def test_golden(path: Path) -> None:
    if check_golden(path, update=bool(os.environ.get("QIR_UPDATE_GOLDEN"))) == "updated":
        pytest.skip(f"updated {path.name}")


def test_there_are_golden_files() -> None:
    assert len(FILES) >= 6


def test_directive_errors(tmp_path: Path) -> None:
    bad = tmp_path / "x.qir"
    bad.write_text("graph @m() {\n  return None\n}\n")
    with pytest.raises(ValueError, match="exactly one"):
        load_golden(bad)
    bad.write_text("// RUN:\n// CHECK-NEXT: x\ngraph @m() {\n  return None\n}\n")
    with pytest.raises(ValueError, match="unknown directive"):
        load_golden(bad)


def test_update_rewrites_check_lines(tmp_path: Path) -> None:
    f = tmp_path / "u.qir"
    f.write_text("// RUN:\ngraph @m() {\n  return None\n}\n\n// CHECK: stale\n")
    case = load_golden(f)
    update_golden(case, run_golden(case))
    assert load_golden(f).expected == "graph @m() {\n  return None\n}"
