"""check_model on torchvision's resnet18: Bernoulli2 refuses it (fc: Linear, avgpool:
AdaptiveAvgPool2d are not supported there), Bayes accepts it.

Runs only when selected: ``python -m pytest -m torchvision tests/real_models/test_legality_torchvision.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from qir.quantization import check_model

pytestmark = pytest.mark.torchvision
tv = pytest.importorskip("torchvision")


@pytest.fixture(scope="module")
def resnet18() -> torch.nn.Module:
    return tv.models.resnet18().eval()


def test_resnet18_refused_on_bernoulli2(resnet18: torch.nn.Module) -> None:
    report = check_model(resnet18, torch.randn(1, 3, 224, 224), march="bernoulli2", advice=1)
    assert not report.ok
    assert {(v.node, v.module, v.spelling, v.kind) for v in report.violations} == {
        ("fc", "fc", "torch.nn.Linear", "unsupported"),
        ("avgpool", "avgpool", "torch.nn.AdaptiveAvgPool2d", "unsupported"),
    }
    text = str(report)
    assert "%fc" in text and "%avgpool" in text
    assert "nn.Conv2d(512, 1000, kernel_size=1)" in text
    assert "nn.AvgPool2d(kernel_size=(7, 7), stride=(7, 7))" in text


def test_resnet18_accepted_on_bayes(resnet18: torch.nn.Module) -> None:
    report = check_model(resnet18, torch.randn(1, 3, 224, 224), march="bayes")
    assert report.ok and not report.violations
    assert report.checked > 60
    assert {a.spelling for a in report.advisories} >= {"torch.nn.BatchNorm2d", "torch.nn.Conv2d"}


@pytest.mark.parametrize("march", ["bernoulli2", "bayes"])
def test_docs_show_the_real_report(resnet18: torch.nn.Module, march: str) -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "legality.md").read_text()
    m = re.search(rf"<!-- report:{march} -->\n```text\n(.*?)\n```", page, re.S)
    assert m is not None, f"docs/legality.md has no report block for {march}"
    report = check_model(resnet18, torch.randn(1, 3, 224, 224), march=march, advice=1)
    assert m.group(1) == str(report)
