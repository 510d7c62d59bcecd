"""docs/migration.md's import table: every qir path it names exists; the ones it says are missing are."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "migration.md"


def _table_rows() -> list[tuple[str, str]]:
    text = DOC.read_text(encoding="utf-8")
    body = text.split("<!-- imports begin -->", 1)[1].split("<!-- imports end -->", 1)[0]
    rows = []
    for line in body.strip().splitlines()[2:]:  # skip the header and the rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 2, line
        rows.append((cells[0], cells[1]))
    return rows


def qir_paths(cell: str) -> list[str]:
    """The backticked dotted ``qir`` paths of a table cell."""
    return [p for p in re.findall(r"`([^`]+)`", cell) if p == "qir" or p.startswith("qir.")]


def resolve(path: str) -> object:
    """Import the longest importable module prefix of ``path``, then walk attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(path)


def test_every_seed_import_has_a_qir_path() -> None:
    rows = _table_rows()
    assert len(rows) >= 15
    plugin_side = " ".join(r[0] for r in rows)
    for module in (
        ".quantization",
        ".march",
        ".nn",
        ".nn.qat",
        ".nn.quantized",
        ".functional",
        ".qconfig",
        ".utils.fx_helper",
        ".utils.onnx_helper",
        "set_march",
    ):
        assert module in plugin_side, module
    for plugin, qir in rows:
        if qir.startswith("not provided"):
            continue
        paths = qir_paths(qir)
        assert paths, plugin
        for p in paths:
            resolve(p)  # raises when the path does not exist


def test_paths_said_to_be_missing_are_missing() -> None:
    # every seed import has a qir path today; rows marked "not provided" must name paths that are absent
    missing = [p for _, qir in _table_rows() if qir.startswith("not provided") for p in qir_paths(qir)]
    for p in missing:
        try:
            resolve(p)
        except (AttributeError, ModuleNotFoundError):
            continue
        raise AssertionError(f"{p} exists now: move it to the mapped rows of docs/migration.md")


def test_seed_style_attribute_access_after_import_qir() -> None:
    # seed 002 writes `import horizon_plugin_pytorch as horizon` then `horizon.nn...`,
    # `horizon.quantization...`, `horizon.march...`: the same attribute paths work on qir.
    import qir as horizon

    assert horizon.nn.Exp is not None
    assert horizon.functional.rgb2centered_yuv is not None
    assert horizon.quantization.prepare_qat is not None
    assert horizon.march.March.BAYES.value == "bayes"
    assert horizon.qconfig.default_qat_8bit_fake_quant_qconfig is not None
