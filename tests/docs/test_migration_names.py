"""docs/migration.md's "Names users import" table: every qir path resolves, every refused name raises."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_migration_imports import resolve

DOC = Path(__file__).resolve().parents[2] / "docs" / "migration.md"


def _rows() -> list[tuple[str, str, str]]:
    text = DOC.read_text(encoding="utf-8")
    body = text.split("<!-- names begin -->", 1)[1].split("<!-- names end -->", 1)[0]
    rows = []
    for line in body.strip().splitlines()[2:]:  # skip the header and the rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 3, line
        rows.append((cells[0], cells[1], cells[2]))
    return rows


def _paths(cell: str) -> list[str]:
    return [p for p in re.findall(r"`([^`(]+)`", cell) if p.startswith("qir.")]


def test_every_row_has_a_status_and_qir_paths() -> None:
    rows = _rows()
    assert len(rows) >= 8
    for _plugin, qir, status in rows:
        assert status.split(":")[0] in {"same", "alias", "differs", "not supported"}, status
        assert _paths(qir), qir


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r[1][:40])
def test_supported_names_resolve_and_refused_names_raise(row: tuple[str, str, str]) -> None:
    _, qir, status = row
    for path in _paths(qir):
        if status.startswith("not supported"):
            with pytest.raises((AttributeError, ImportError), match="not supported by qir"):
                resolve(path)
        else:
            assert resolve(path) is not None
