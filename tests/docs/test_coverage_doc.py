"""docs/coverage.md's operator coverage matrix is what the live registries say."""

from __future__ import annotations

from pathlib import Path

from backends.common.optable import generated_block
from qir.cli.coverage import BLOCK, coverage_rows, coverage_table_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "coverage.md"


def test_coverage_doc_is_up_to_date() -> None:
    assert generated_block(BLOCK, coverage_table_markdown()) in DOC.read_text(encoding="utf-8"), (
        "docs/coverage.md is stale: run python -m qir.cli.coverage docs/coverage.md"
    )


def test_coverage_spot_checks() -> None:
    rows = {r.spelling: r for r in coverage_rows()}
    assert len(rows) == 113
    conv = rows["torch.nn.Conv2d"]
    assert (conv.ir_op, conv.qat, conv.quantized, conv.lowering) == ("conv2d", "`qat.Conv2d`", "`Conv2d`", True)
    assert rows["torch.add"].quantized == "`QFunctional.add`" and rows["torch.add"].lowering
    assert rows["torch.exp"].qat == "generated `Exp` → `qat.UnaryLUT`"
    assert rows["torch.nn.Linear"].support == ("not_supported", "supported")  # (bernoulli2, bayes)
    anchors = rows["torchvision.models.detection.rpn.AnchorGenerator"]
    assert anchors.qat == "`qat.AnchorGenerator`" and anchors.quantized == "`AnchorGenerator`" and anchors.lowering
    assert rows["torch.nn.LSTMCell"].qat == "`qat.LSTMCell`" and rows["torch.nn.LSTMCell"].lowering
    assert rows["torch.nn.LayerNorm"].qat == "`qat.LayerNorm`" and rows["torch.nn.LayerNorm"].lowering
