"""``get_default_qconfig``: a qconfig from fake-quant and observer *names*, the plugin's newer interface.

    get_default_qconfig(activation_observer="mse")                 # QAT, MSE-calibrated activations
    get_default_qconfig(activation_fake_quant=None, weight_fake_quant=None,
                        activation_observer="kl")                  # calibration (observe only), KL

Names map to qir's classes in :data:`FAKE_QUANTS` and :data:`OBSERVERS`; anything else is a
``ValueError`` listing the valid names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qir.quantization.fake_quantize import CalibFakeQuantize, FakeQuantize
from qir.quantization.observer import (
    MinMaxObserver,
    ModuleFactory,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
    PercentileObserver,
)
from qir.quantization.observer_search import KLObserver, MixObserver, MSEObserver
from qir.quantization.qconfig import DEFAULT_ACTIVATION_AVERAGING, QAT_FAKE_QUANTS, QConfig, qconfig_kind

__all__ = ["FAKE_QUANTS", "OBSERVERS", "fake_quant_class", "get_default_qconfig"]

#: Fake-quant names: ``None`` observes only (a calibration qconfig); "lsq" / "pact" learn the scale.
FAKE_QUANTS: dict[str | None, type[FakeQuantize]] = {name: cls for name, cls in QAT_FAKE_QUANTS.items()}
FAKE_QUANTS[None] = CalibFakeQuantize
#: Per-tensor observer names (activations) and the observer's default arguments.
OBSERVERS: dict[str, tuple[type, dict[str, Any]]] = {
    "min_max": (MovingAveragePerTensorMinMaxObserver, {"averaging_constant": DEFAULT_ACTIVATION_AVERAGING}),
    "running_min_max": (MinMaxObserver, {}),
    "percentile": (PercentileObserver, {}),
    "mse": (MSEObserver, {}),
    "kl": (KLObserver, {}),
    "mix": (MixObserver, {}),
}
#: Weight observers: per channel along axis 0, so only the min-max family.
WEIGHT_OBSERVERS: dict[str, tuple[type, dict[str, Any]]] = {
    "min_max": (MovingAveragePerChannelMinMaxObserver, {"averaging_constant": 1.0, "ch_axis": 0}),
}


def fake_quant_class(name: str | None, field: str) -> type[FakeQuantize]:
    """The fake-quant class a name stands for (:data:`FAKE_QUANTS`); ``field`` names the argument in errors."""
    if name not in FAKE_QUANTS:
        raise ValueError(
            f"{field}={name!r} is not a fake quant; valid: 'fake_quant', 'lsq' (learned step size), "
            "'pact' (learned clipping), None (observe only)"
        )
    return FAKE_QUANTS[name]


def _observer(name: str, table: Mapping[str, tuple[type, dict[str, Any]]], field: str) -> tuple[type, dict[str, Any]]:
    if name not in table:
        extra = (
            " (weights are quantized per channel; the histogram observers percentile / mse / kl / mix are per tensor)"
            if field == "weight_observer" and name in OBSERVERS
            else ""
        )
        raise ValueError(f"{field}={name!r} is not an observer name; valid: {', '.join(table)}{extra}")
    cls, defaults = table[name]
    return cls, dict(defaults)


def _check_qkwargs(qkwargs: Mapping[str, Any] | None, field: str) -> dict[str, Any]:
    if qkwargs is None:
        return {}
    if not isinstance(qkwargs, Mapping):
        raise TypeError(f"{field} must be a dict of FakeQuantize/observer arguments, got {type(qkwargs).__name__}")
    if "observer" in qkwargs:
        raise ValueError(f"{field} must not hold 'observer': name it with {field.split('_')[0]}_observer=")
    return dict(qkwargs)


def get_default_qconfig(
    activation_fake_quant: str | None = "fake_quant",
    weight_fake_quant: str | None = "fake_quant",
    activation_observer: str = "min_max",
    weight_observer: str = "min_max",
    activation_qkwargs: Mapping[str, Any] | None = None,
    weight_qkwargs: Mapping[str, Any] | None = None,
) -> QConfig:
    """A :class:`QConfig` from names.

    - ``*_fake_quant``: ``"fake_quant"`` (QAT: observe and fake-quantize), ``"lsq"`` (QAT,
      the scale a Parameter learned with the LSQ gradient, started by the observer),
      ``"pact"`` (QAT, learned clipping) or ``None`` (calibration: observe only). Both must
      be of one kind (the three QAT names mix).
    - ``activation_observer``: ``"min_max"`` (moving average, constant 0.01),
      ``"running_min_max"``, ``"percentile"``, ``"mse"``, ``"kl"`` or ``"mix"``.
    - ``weight_observer``: ``"min_max"`` (per channel along axis 0, current weights only).
    - ``*_qkwargs``: more ``FakeQuantize.with_args`` / observer arguments, e.g.
      ``{"dtype": "qint16"}`` or ``{"percentile": 99.9}``; not ``observer`` (name it instead).
      The dicts are not modified.
    """
    act_cls = fake_quant_class(activation_fake_quant, "activation_fake_quant")
    w_cls = fake_quant_class(weight_fake_quant, "weight_fake_quant")
    act_obs, act_kw = _observer(activation_observer, OBSERVERS, "activation_observer")
    w_obs, w_kw = _observer(weight_observer, WEIGHT_OBSERVERS, "weight_observer")
    act_kw.update(_check_qkwargs(activation_qkwargs, "activation_qkwargs"))
    w_kw.update(_check_qkwargs(weight_qkwargs, "weight_qkwargs"))
    qconfig = QConfig(
        activation=ModuleFactory(act_cls, observer=act_obs, **act_kw),
        weight=ModuleFactory(w_cls, observer=w_obs, **w_kw),
    )
    qconfig_kind(qconfig)  # one kind: a mixed qconfig fails here, not later in prepare
    return qconfig
