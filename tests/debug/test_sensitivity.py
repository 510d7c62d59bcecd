"""layer_sensitivity ranks a deliberately degraded layer first; auto_int16 promotes only what the march runs."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from qir.quantization import FakeQuantize, prepare_qat_fx
from qir.quantization.debug import auto_int16, layer_sensitivity
from qir.quantization.debug.sensitivity import quantized_layers
from tests.debug.conftest import Digits


@pytest.mark.parametrize("metric", ["cosine", "sqnr", "relative_l2"])
def test_degraded_layer_ranks_first(digits: Digits, metric: str) -> None:
    bad = copy.deepcopy(digits.calibrated)
    bad.add.activation_post_process.scale.mul_(0.15)  # saturates the residual block's output
    before = {k: v.clone() for k, v in bad.state_dict().items()}
    rep = layer_sensitivity(bad, digits.x_test, metric)
    assert rep.ranked()[0] == "add", rep.table()
    row = rep.layers[0]
    others = rep.layers[1:]
    # Keeping only `add` float recovers the most.
    better = (lambda a, b: a > b) if rep.higher_is_better else (lambda a, b: a < b)
    assert all(better(row.only_float, o.only_float) for o in others), rep.table()
    assert all(torch.equal(before[k], v) for k, v in bad.state_dict().items())


def test_exactly_quantized_input_has_no_error(digits: Digits) -> None:
    rep = layer_sensitivity(digits.calibrated, digits.x_test)
    quant = next(r for r in rep.layers if r.layer == "quant")
    assert quant.only_quantized == pytest.approx(1.0, abs=1e-12)  # 1/128 grid holds the 1/32-step pixels
    assert set(rep.ranked()) == set(quantized_layers(digits.calibrated))


def test_sensitivity_needs_a_prepared_model(digits: Digits) -> None:
    with pytest.raises(ValueError, match="prepared"):
        layer_sensitivity(digits.float_model, digits.x_test)
    with pytest.raises(ValueError, match="not quantized layers"):
        layer_sensitivity(digits.calibrated, digits.x_test, layers=["pool"])


def test_auto_int16_on_bayes_meets_the_target_with_legal_layers(digits: Digits) -> None:
    t0 = time.perf_counter()
    base = auto_int16(digits.float_model, digits.x_train, digits.x_test, target=0.0, march="bayes")
    assert base.met and base.promoted == []  # already met: nothing promoted
    # Halfway between today's similarity and 1 needs some promotion.
    target = base.before + 0.5 * (1.0 - base.before)
    res = auto_int16(digits.float_model, digits.x_train, digits.x_test, target=target, march="bayes")
    print(res.summary(), f"{time.perf_counter() - t0:.1f}s")
    assert res.met and res.after >= target and 1 <= len(res.promoted) <= len(res.candidates)
    assert set(res.promoted) <= set(res.candidates)
    # Bayes' max pool takes qint8 only: `add` (which feeds it) cannot be promoted.
    assert "add" in res.illegal and "add" not in res.candidates
    qd = res.qconfig_dict()
    prepared = prepare_qat_fx(digits.float_model, qd)
    mods = dict(prepared.named_modules())
    for name in res.promoted:
        fq = mods[name].activation_post_process
        assert isinstance(fq, FakeQuantize) and fq.dtype.name == "qint16"


def test_auto_int16_on_bernoulli2_has_no_int16_outputs(digits: Digits) -> None:
    res = auto_int16(digits.float_model, digits.x_train, digits.x_test, target=0.9999999, march="bernoulli2")
    assert not res.met and res.promoted == [] and res.candidates == []
    assert all("qint16" in why for why in res.illegal.values()), res.illegal


def test_auto_int16_stops_at_the_bound_when_no_promotion_can_meet_the_target(digits: Digits) -> None:
    res = auto_int16(digits.float_model, digits.x_train, digits.x_test, target=0.99999999, march="bayes")
    assert not res.met and res.promoted == [] and res.bound is not None
    assert res.before < res.bound < 0.99999999
    assert [len(p) for p, _ in res.steps] == [len(res.candidates)]  # one step: all candidates at once
    assert "short of the target" in res.summary()


def test_all_on_sensitivity_matches_fake_quant_in_validation_state(digits: Digits) -> None:
    from qir.quantization.fake_quantize import float_fake_quant

    rep = layer_sensitivity(digits.calibrated, digits.x_test)
    with torch.no_grad(), float_fake_quant():
        ref = digits.calibrated(digits.x_test)
    from qir.quantization import set_fake_quantize
    from qir.quantization.debug import cosine

    work = copy.deepcopy(digits.calibrated)
    set_fake_quantize(work, "calibration")  # observers on, fake quant off: the float reference
    for fq in work.modules():
        if isinstance(fq, FakeQuantize):
            fq.disable_observer()
    with torch.no_grad():
        float_out = work(digits.x_test)
    assert rep.all_quantized == pytest.approx(cosine(float_out, ref), abs=1e-12)
