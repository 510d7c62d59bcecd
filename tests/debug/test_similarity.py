"""featuremap_similarity on the digits model: paths, figures checked independently, files, no side effects."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from qir.quantization import FakeQuantize, compile_model, load_compiled
from qir.quantization.debug import cosine, featuremap_similarity
from tests.debug.conftest import Digits

LAYERS = ["quant", "conv0", "add", "pool", "conv2", "avg", "classifier", "dequant", "(output)"]


def test_float_vs_converted_rows_and_output_cosine(digits: Digits) -> None:
    r = featuremap_similarity(digits.float_model, digits.converted, digits.x_test)
    assert [row.name for row in r.rows] == LAYERS
    assert (r.stage_a, r.stage_b) == ("float", "converted")
    with torch.no_grad():
        ref = cosine(digits.float_model(digits.x_test), digits.converted(digits.x_test))
    assert r.row("(output)").cosine == pytest.approx(ref, abs=1e-12)
    # Inputs are multiples of 1/32 and QuantStub's scale is 1/128: quantizing them is exact.
    assert r.row("quant").max_abs == 0.0 and r.row("quant").max_lsb == 0.0
    assert r.row("conv0").dtype == "qint8" and r.row("conv0").max_lsb is not None
    assert 0.99 < r.row("classifier").cosine < 1.0


def test_lsb_column_is_max_error_over_the_converted_scale(digits: Digits) -> None:
    r = featuremap_similarity(digits.calibrated, digits.converted, digits.x_test)
    row = r.row("conv2")
    scale = float(digits.converted.conv2.scale)
    assert row.max_lsb == pytest.approx(row.max_abs / scale, rel=1e-5)
    assert all(x.max_lsb is None or x.max_lsb >= 0 for x in r.rows)


def test_a_degraded_layer_is_the_first_drop(digits: Digits) -> None:
    bad = copy.deepcopy(digits.calibrated)
    bad.conv2.activation_post_process.scale.mul_(0.1)  # clips most of conv2's output
    r = featuremap_similarity(digits.float_model, bad, digits.x_test, threshold=0.99)
    first = r.first_drop(0.99)
    assert first is not None and first.name == "conv2"
    assert r.row("add").cosine > 0.999
    assert "<<" in r.table()


def test_models_are_left_as_they_were(digits: Digits) -> None:
    model = copy.deepcopy(digits.calibrated).train()
    for fq in model.modules():
        if isinstance(fq, FakeQuantize):
            fq.enable_observer(True).enable_fake_quant(False)  # calibration state
    before = {k: v.clone() for k, v in model.state_dict().items()}
    featuremap_similarity(digits.float_model, model, digits.x_test)
    assert model.training and all(m.training for m in model.modules())
    fqs = [m for m in model.modules() if isinstance(m, FakeQuantize)]
    assert all(fq.observer_enabled and not fq.fake_quant_enabled for fq in fqs)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_files_table_json_and_plot(digits: Digits, tmp_path: Path) -> None:
    r = featuremap_similarity(digits.float_model, digits.calibrated, digits.x_test, threshold=0.999, out_dir=tmp_path)
    data = json.loads((tmp_path / "similarity.json").read_text())
    assert [layer["name"] for layer in data["layers"]] == [row.name for row in r.rows]
    assert data["stage_b"] == "prepared" and data["threshold"] == 0.999
    assert (tmp_path / "similarity.txt").read_text() == r.table()
    assert (tmp_path / "similarity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compiled_artifact_compares_by_its_output(digits: Digits, tmp_path: Path) -> None:
    compile_model(digits.converted, [digits.x_test[:1]], hbm=tmp_path / "d.hbm", march="bayes", check=False)
    art = load_compiled(tmp_path / "d.hbm")
    r = featuremap_similarity(digits.converted, art, digits.x_test)
    assert [row.name for row in r.rows] == ["(output)"]
    assert r.row("(output)").max_abs == 0.0  # the artifact is bit-exact with the converted model
    assert "conv0" in r.only_in_a


def test_bad_inputs_are_named(digits: Digits) -> None:
    with pytest.raises(TypeError, match="inputs must be a tensor or a tuple"):
        featuremap_similarity(digits.float_model, digits.converted, {"x": digits.x_test})
    with pytest.raises(KeyError, match="no compared layer named 'nope'"):
        featuremap_similarity(digits.float_model, digits.converted, digits.x_test).row("nope")
