"""resnet18 / mobilenet_v2 (random weights): calibrate, one QAT step, convert; converted close to QAT.

Runs only when selected (needs torchvision): ``python -m pytest -m torchvision tests/real_models -q``
(e.g. with /work/tvenv/bin/python). The numbers are in benchmarks/torchvision_qat_error.py's table.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.torchvision


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_calibrate_qat_convert(name: str, march: str) -> None:
    pytest.importorskip("torchvision")
    from benchmarks.torchvision_qat_error import run_one

    r = run_one(name, march, size=64, batch=2)
    # requantization differs from fake quant by at most 1 LSB per layer; with random weights the
    # differences grow with depth (resnet18: ~1 LSB at the stem, ~10 LSB at layer4)
    assert r["rel_l2"] < 0.15, r
