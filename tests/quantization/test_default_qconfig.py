"""get_default_qconfig: names to classes, kinds, errors; a KL-calibrated model converts."""

from __future__ import annotations

import pytest
import torch

from qir.examples import DeployableDigitsNet
from qir.march import march_scope
from qir.quantization import (
    CalibFakeQuantize,
    FakeQuantize,
    KLObserver,
    MixObserver,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
    MSEObserver,
    PercentileObserver,
    convert_fx,
    get_default_qconfig,
    prepare_qat_fx,
    qconfig_kind,
    set_fake_quantize,
)


def test_defaults_are_a_qat_min_max_qconfig() -> None:
    qc = get_default_qconfig()
    assert qconfig_kind(qc) == "qat"
    act, w = qc.activation(), qc.weight()
    assert type(act) is FakeQuantize and isinstance(act.observer, MovingAveragePerTensorMinMaxObserver)
    assert isinstance(w.observer, MovingAveragePerChannelMinMaxObserver) and w.ch_axis == 0


@pytest.mark.parametrize(
    ("name", "cls"),
    [("percentile", PercentileObserver), ("mse", MSEObserver), ("kl", KLObserver), ("mix", MixObserver)],
)
def test_observer_names(name: str, cls: type) -> None:
    qc = get_default_qconfig(None, None, activation_observer=name, activation_qkwargs={"dtype": "qint16"})
    act = qc.activation()
    assert qconfig_kind(qc) == "calibration" and type(act) is CalibFakeQuantize
    assert isinstance(act.observer, cls) and act.dtype.name == "qint16"


def test_bad_names_and_mixed_kinds_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="valid: min_max, running_min_max, percentile, mse, kl, mix"):
        get_default_qconfig(activation_observer="entropy")
    with pytest.raises(ValueError, match="per channel"):
        get_default_qconfig(weight_observer="mse")
    with pytest.raises(ValueError, match="valid: 'fake_quant', 'lsq'"):
        get_default_qconfig(activation_fake_quant="learned")
    with pytest.raises(ValueError, match="QConfig mixes kinds"):
        get_default_qconfig(activation_fake_quant=None)
    with pytest.raises(ValueError, match="activation_observer="):
        get_default_qconfig(activation_qkwargs={"observer": KLObserver})
    with pytest.raises(TypeError, match="unknown argument"):
        get_default_qconfig(activation_observer="kl", activation_qkwargs={"percentile": 99.0})


def test_qkwargs_are_not_modified() -> None:
    kw = {"dtype": "qint16"}
    get_default_qconfig(activation_qkwargs=kw)
    assert kw == {"dtype": "qint16"}


def test_kl_calibrated_digits_model_converts() -> None:
    torch.manual_seed(0)
    model = DeployableDigitsNet().eval()
    x = torch.rand(64, 1, 8, 8) - 0.5
    with march_scope("bayes"):
        calib = prepare_qat_fx(model, {"": get_default_qconfig(None, None, activation_observer="kl")})
        set_fake_quantize(calib, "calibration")
        calib(x)
        set_fake_quantize(calib, "validation")
        kls = [m for m in calib.modules() if isinstance(m, KLObserver)]
        assert kls and all(float(o.scale) > 0 for o in kls)
        out = convert_fx(calib)(x)
    assert out.shape == (64, 10) and torch.isfinite(out).all()
