"""A trained QAT model run under eval() in QAT state still moves its activation scales: it warns once,
naming the model and the fix; calibration, validation, frozen observers and a model not yet trained
do not warn."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    FakeQuantState,
    QuantStub,
    disable_observer,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat,
    prepare_qat_fx,
    set_fake_quantize,
)

_MATCH = "runs under eval\\(\\) in QAT fake-quant state"


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU()
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dq(self.relu(self.conv(self.quant(x))))


def _ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "in QAT fake-quant state" in str(w.message)]


def _run(model: nn.Module, x: torch.Tensor) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x)
    return _ours(caught)


def _qat(qconfig: object = None) -> nn.Module:
    torch.manual_seed(0)
    with march_scope("bayes"):
        return prepare_qat_fx(_Net(), {"": qconfig or get_default_qat_qconfig()})


def test_a_trained_model_evaluated_in_qat_state_warns_once_naming_the_fix() -> None:
    qat = _qat()
    x = torch.randn(2, 3, 8, 8)
    qat.train()(x)
    scale = qat.conv.activation_post_process.scale.clone()
    with pytest.warns(UserWarning, match=_MATCH) as caught:
        qat.eval()(x * 3)
    msg = str(caught[0].message)
    assert msg.startswith("_Net runs under eval()") and "set_fake_quantize(model, FakeQuantState.VALIDATION)" in msg
    assert "scales that convert will read" in msg
    assert caught[0].filename == __file__  # pointed at the user's call, not at qir or torch
    # what it warns about: the evaluation batch moved the scale convert_fx reads
    assert not torch.equal(qat.conv.activation_post_process.scale, scale)
    assert _run(qat, x) == []  # once per model
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    assert _run(qat, x) == []


def test_no_warning_before_training_in_validation_or_with_frozen_observers() -> None:
    qat = _qat()
    x = torch.randn(2, 3, 8, 8)
    assert _run(qat.eval(), x) == []  # a prepared model checked against the float one before training
    qat.train()(x)
    set_fake_quantize(qat.eval(), "validation")
    assert _run(qat, x) == []
    set_fake_quantize(qat, "qat")
    disable_observer(qat)
    assert _run(qat, x) == []  # nothing observes: nothing moves


def test_a_calibration_flow_does_not_warn() -> None:
    # seed 003's flow: calibrate under eval(), prepare QAT from the calibrated model, run it once
    calib = _qat(get_default_calib_qconfig())
    calib.eval()
    x = torch.randn(2, 3, 8, 8)
    for _ in range(3):
        assert _run(calib, x) == []
    with march_scope("bayes"):
        qat = prepare_qat_fx(calib, {"": get_default_qat_qconfig()})
    assert _run(qat, x) == []
    calib.train()
    assert _run(calib, x) == []  # calibration state observes in training mode too: no QAT step
    calib.eval()
    assert _run(calib, x) == []


def test_an_eager_model_warns_too() -> None:
    torch.manual_seed(0)
    base = _Net()
    base.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    with march_scope("bayes"):
        qat = prepare_qat(base)
    x = torch.randn(2, 3, 8, 8)
    qat.train()(x)
    assert len(_run(qat.eval(), x)) == 1
    assert _run(qat, x) == []


def test_forwards_that_cannot_warn_do_not_walk_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from qir.quantization import eval_observers
    from qir.quantization.fake_quantize import FakeQuantize

    walks: list[int] = []
    real_scan = eval_observers._scan
    monkeypatch.setattr(eval_observers, "_scan", lambda model: walks.append(1) or real_scan(model))
    x = torch.randn(2, 3, 8, 8)
    calib = _qat(get_default_calib_qconfig()).train()
    calib(x)
    walks.clear()
    for _ in range(5):
        calib(x)  # calibration steps in training mode: answered from the cache
    assert walks == []
    qat = _qat()
    qat.train()(x)
    set_fake_quantize(qat.eval(), "validation")
    for _ in range(2):
        # the first validation batch builds the integer twin, whose new fake quants set their switches:
        # the next walks once more
        assert _run(qat, x) == []
    walks.clear()
    for _ in range(5):
        assert _run(qat, x) == []  # validation batches after training
    assert walks == []
    # a switch set directly (not by set_state) is seen: QAT state again, one observer off by hand
    set_fake_quantize(qat, "qat")
    fqs = [m for m in qat.modules() if isinstance(m, FakeQuantize)]
    for fq in fqs:
        fq.observer_enabled = False
    assert _run(qat, x) == []
    fqs[0].observer_enabled = True
    assert len(_run(qat, x)) == 1
