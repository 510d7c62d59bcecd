"""torchvision models through benchmarks/zoo_flow.py's whole flow: QAT grid, validation, converted and artifact agree.

Runs only when selected (needs torchvision):
``/work/tvenv/bin/python -m pytest -m torchvision tests/real_models/test_zoo_flow_torchvision.py``.
The whole zoo's table is in benchmarks/README.md ("The torchvision zoo through the whole flow").
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.torchvision


# mobilenet_v3_small: Hardswish / Hardsigmoid built with inplace=True (the QAT table lookup read
# its input after the activation overwrote it); googlenet: inception branches and their cat;
# densenet121: standalone batch norms after cats (depthwise 1x1 convs); fcn_head: a segmentation head
@pytest.mark.parametrize("name", ["mobilenet_v3_small", "googlenet", "densenet121", "fcn_head"])
def test_qat_grid_validation_converted_and_artifact_agree(name: str) -> None:
    pytest.importorskip("torchvision")
    from benchmarks.zoo_flow import run_one

    r = run_one(name, "bayes")
    assert r["stage"] == "done", r.get("trace", r)
    assert (r["grid_vs_conv"], r["val_vs_conv"], r["art_vs_conv"]) == ("exact", "exact", "exact"), r


def test_swin_is_refused_at_prepare_naming_its_torch_fx_wrapped_attention() -> None:
    pytest.importorskip("torchvision")
    from benchmarks.zoo_flow import run_one

    r = run_one("swin_t", "bayes")
    assert r["stage"] == "prepare(calib)", r
    assert "torchvision.models.swin_transformer.shifted_window_attention" in r["error"]
    assert "hybrid=True" in r["trace"]  # the full message (the row keeps its first 400 characters)
