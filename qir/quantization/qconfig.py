"""QConfig: which fake quant a module's output (activation) and weight get.

A :class:`QConfig` holds two *factories* (``FakeQuantize.with_args(...)``), not modules:
prepare calls them once per tensor. ``activation=None`` means no output fake quant — the
op keeps its int32 accumulator as a high-precision qint32 output (docs/semantics.md).

QAT and calibration qconfigs differ in kind (:func:`qconfig_kind`); a model is prepared
with one kind only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

from torch import nn

from backends.common.numerics import DTypeLike, observable_qdtype
from qir.quantization.fake_quantize import CalibFakeQuantize, FakeQuantize
from qir.quantization.lsq import LSQFakeQuantize, PACTFakeQuantize
from qir.quantization.observer import (
    ModuleFactory,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
    ObserverBase,
    PercentileObserver,
)

__all__ = [
    "QConfig",
    "QConfigKind",
    "as_qir_qconfig",
    "default_calib_16bit_fake_quant_qconfig",
    "default_calib_8bit_fake_quant_qconfig",
    "default_calib_8bit_weight_32bit_out_fake_quant_qconfig",
    "default_qat_16bit_fake_quant_qconfig",
    "default_qat_8bit_fake_quant_qconfig",
    "default_qat_8bit_weight_32bit_out_fake_quant_qconfig",
    "get_default_calib_qconfig",
    "get_default_qat_out_qconfig",
    "get_default_qat_qconfig",
    "qconfig_kind",
]

QConfigKind = Literal["qat", "calibration"]
Factory = Callable[..., nn.Module]

#: Activation moving-average constant of the default QAT qconfig.
DEFAULT_ACTIVATION_AVERAGING = 0.01
#: Percentile of |x| the default calibration qconfig keeps.
DEFAULT_CALIB_PERCENTILE = 99.99
#: QAT fake-quant names (``get_default_qat_qconfig(activation_fake_quant=...)``, ``get_default_qconfig``).
QAT_FAKE_QUANTS: dict[str, type[FakeQuantize]] = {
    "fake_quant": FakeQuantize,
    "lsq": LSQFakeQuantize,
    "pact": PACTFakeQuantize,
}
#: FakeQuantize's own arguments; the rest of a factory's keywords go to its observer.
_FAKE_QUANT_ARGS = frozenset({"observer", "dtype", "ch_axis", "scale"})


class _QConfigFields(NamedTuple):
    activation: Factory | None
    weight: Factory | None


class QConfig(_QConfigFields):
    """``QConfig(activation=..., weight=...)``: factories of fake-quant modules (either may be None)."""

    __slots__ = ()

    def __new__(cls, activation: Factory | None = None, weight: Factory | None = None) -> QConfig:
        for field, value in (("activation", activation), ("weight", weight)):
            if isinstance(value, nn.Module):
                raise TypeError(
                    f"QConfig.{field} got a module instance ({type(value).__name__}); pass a factory, "
                    "e.g. FakeQuantize.with_args(observer=MovingAveragePerTensorMinMaxObserver, dtype='qint8')"
                )
            if value is not None and not callable(value):
                raise TypeError(f"QConfig.{field} must be a factory (callable) or None, got {type(value).__name__}")
        return super().__new__(cls, activation, weight)


def _is_torch_qconfig(value: Any) -> bool:
    try:
        from torch.ao.quantization.qconfig import QConfig as TorchQConfig
    except ImportError:  # torch built without the ao namespace
        return False
    return isinstance(value, TorchQConfig)


def _check_factory(factory: Any, where: str, field: str) -> Factory | None:
    if factory is None or isinstance(factory, ModuleFactory):
        return factory  # type: ignore[no-any-return]
    target = getattr(factory, "func", factory)
    if isinstance(target, type) and issubclass(target, (FakeQuantize, ObserverBase)):
        return factory  # type: ignore[no-any-return]
    raise TypeError(
        f"{where}: {field} {factory!r} is a torch.ao.quantization factory, not a qir one; build it with "
        "qir.quantization.FakeQuantize.with_args(observer=..., dtype=...) (the plugin's FakeQuantize is "
        "qir.quantization.FakeQuantize)"
    )


def as_qir_qconfig(value: Any, where: str = "qconfig") -> QConfig | None:
    """``value`` as a qir :class:`QConfig`: qir's as is, ``None`` as is, and a
    ``torch.quantization.QConfig`` holding qir factories (the plugin's users build
    ``torch.quantization.QConfig(activation=FakeQuantize.with_args(...), weight=None)``)
    converted field by field. Anything else is a ``TypeError`` naming ``where``."""
    if value is None or isinstance(value, QConfig):
        return value
    if _is_torch_qconfig(value):
        return QConfig(
            activation=_check_factory(value.activation, where, "activation"),
            weight=_check_factory(value.weight, where, "weight"),
        )
    raise TypeError(
        f"{where} must be a qir QConfig (or a torch.quantization.QConfig of qir factories), got {type(value).__name__}"
    )


def _factory_kind(factory: Factory) -> QConfigKind:
    target: Any = factory.func if isinstance(factory, ModuleFactory) else getattr(factory, "func", factory)
    if isinstance(target, type):
        if issubclass(target, FakeQuantize):
            return "calibration" if target.kind == "calibration" else "qat"
        if issubclass(target, ObserverBase):
            return "calibration"  # a bare observer only watches: the model computes in float
    raise TypeError(
        f"cannot tell whether {factory!r} is a QAT or a calibration factory; "
        "build it with FakeQuantize.with_args(...) or CalibFakeQuantize.with_args(...)"
    )


def qconfig_kind(qconfig: QConfig) -> QConfigKind:
    """``"qat"`` or ``"calibration"``; raises if the activation and weight factories disagree."""
    kinds = {f: _factory_kind(v) for f, v in (("activation", qconfig.activation), ("weight", qconfig.weight)) if v}
    if not kinds:
        return "qat"  # an all-None qconfig quantizes nothing; it mixes with either kind
    if len(set(kinds.values())) > 1:
        raise ValueError(
            f"QConfig mixes kinds: activation is {kinds['activation']}, weight is {kinds['weight']}; "
            "use calibration factories (CalibFakeQuantize) or QAT factories (FakeQuantize) for both"
        )
    return next(iter(kinds.values()))


def _merge(base: dict[str, Any], extra: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    if extra is None:
        return base
    if not isinstance(extra, Mapping):
        raise TypeError(f"{name} must be a dict of FakeQuantize/observer arguments, got {type(extra).__name__}")
    if "observer" in extra:
        # A replaced observer does not inherit the default observer's own arguments.
        base = {k: v for k, v in base.items() if k in _FAKE_QUANT_ARGS}
    return {**base, **extra}  # a new dict: the caller's mapping is never changed


def _weight_factory(
    cls: type[FakeQuantize], weight_dtype: DTypeLike, weight_qkwargs: Mapping[str, Any] | None
) -> ModuleFactory[FakeQuantize]:
    kw = _merge(
        {
            "observer": MovingAveragePerChannelMinMaxObserver,
            "dtype": observable_qdtype(weight_dtype).name,
            "ch_axis": 0,
            "averaging_constant": 1.0,  # weights: the current values only
        },
        weight_qkwargs,
        "weight_qkwargs",
    )
    return ModuleFactory(cls, **kw)


def _qat_class(name: str, field: str) -> type[FakeQuantize]:
    if name not in QAT_FAKE_QUANTS:
        raise ValueError(f"{field}={name!r} is not a QAT fake quant; valid: {', '.join(QAT_FAKE_QUANTS)}")
    return QAT_FAKE_QUANTS[name]


def get_default_qat_qconfig(
    dtype: DTypeLike = "qint8",
    weight_dtype: DTypeLike = "qint8",
    activation_qkwargs: Mapping[str, Any] | None = None,
    weight_qkwargs: Mapping[str, Any] | None = None,
    *,
    activation_fake_quant: str = "fake_quant",
    weight_fake_quant: str = "fake_quant",
) -> QConfig:
    """QAT: per-tensor moving-average activations (constant 0.01), per-channel (axis 0) weights.

    ``activation_qkwargs`` / ``weight_qkwargs`` override any ``FakeQuantize.with_args``
    argument, including ``observer``. ``activation_fake_quant`` / ``weight_fake_quant``:
    ``"fake_quant"`` (the scale follows the observer), ``"lsq"`` (a learned scale, LSQ
    gradient, started by the observer; :mod:`qir.quantization.lsq`) or ``"pact"``.
    """
    act_cls = _qat_class(activation_fake_quant, "activation_fake_quant")
    w_cls = _qat_class(weight_fake_quant, "weight_fake_quant")
    act = _merge(
        {
            "observer": MovingAveragePerTensorMinMaxObserver,
            "dtype": observable_qdtype(dtype).name,
            "averaging_constant": DEFAULT_ACTIVATION_AVERAGING,
        },
        activation_qkwargs,
        "activation_qkwargs",
    )
    weight = _weight_factory(w_cls, weight_dtype, weight_qkwargs)
    return QConfig(activation=ModuleFactory(act_cls, **act), weight=weight)


def get_default_qat_out_qconfig(
    weight_dtype: DTypeLike = "qint8",
    weight_qkwargs: Mapping[str, Any] | None = None,
    *,
    weight_fake_quant: str = "fake_quant",
) -> QConfig:
    """QAT for a last conv/linear: fake-quantized weights, no output fake quant (qint32 output)."""
    w_cls = _qat_class(weight_fake_quant, "weight_fake_quant")
    return QConfig(activation=None, weight=_weight_factory(w_cls, weight_dtype, weight_qkwargs))


def get_default_calib_qconfig(
    dtype: DTypeLike = "qint8",
    weight_dtype: DTypeLike = "qint8",
    calib_qkwargs: Mapping[str, Any] | None = None,
    weight_qkwargs: Mapping[str, Any] | None = None,
) -> QConfig:
    """Calibration: observe-only (:class:`CalibFakeQuantize`); activations by the 99.99th percentile of |x|."""
    act = _merge(
        {
            "observer": PercentileObserver,
            "dtype": observable_qdtype(dtype).name,
            "percentile": DEFAULT_CALIB_PERCENTILE,
        },
        calib_qkwargs,
        "calib_qkwargs",
    )
    return QConfig(
        activation=CalibFakeQuantize.with_args(**act),
        weight=_weight_factory(CalibFakeQuantize, weight_dtype, weight_qkwargs),
    )


default_qat_8bit_fake_quant_qconfig = get_default_qat_qconfig()
default_qat_8bit_weight_32bit_out_fake_quant_qconfig = get_default_qat_out_qconfig()
default_calib_8bit_fake_quant_qconfig = get_default_calib_qconfig()
#: Calibration for a last conv/linear: observed weights, no output fake quant (qint32 output).
default_calib_8bit_weight_32bit_out_fake_quant_qconfig = QConfig(
    activation=None, weight=_weight_factory(CalibFakeQuantize, "qint8", None)
)
# 16-bit activations; weights stay int8 (both marches' conv/linear take int8 weights).
default_qat_16bit_fake_quant_qconfig = get_default_qat_qconfig(dtype="qint16")
default_calib_16bit_fake_quant_qconfig = get_default_calib_qconfig(dtype="qint16")
