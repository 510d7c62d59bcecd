"""The IR's QAT ops for qir's QAT modules: readers (module -> op) and builders (op -> module).

``qir.ir.ops.qat`` defines ``qat_conv``, ``qat_quant_stub`` and ``qat_dequant_stub`` without
naming a module class (``qir.ir`` sits below ``qir.nn``); importing :mod:`qir.nn.qat` registers
here which classes each op is read from and how a module is rebuilt from an op and its state
tensors. A fake quant becomes a :class:`~qir.ir.ops.qat.FakeQuantSpec` when its class and its
observer's class are ones qir knows by name (:data:`OBSERVER_KINDS`); any other (a learnable
scale, a user observer) keeps its module an opaque call, with the reason in the node's note.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qir.ir.ops.qat import FakeQuantSpec, QATConv, QATDequantStub, QATQuantStub, register_qat_module
from qir.ir.ops.quant import ObserverSpec
from qir.nn.qat.conv import QAT_CONV_CLASSES, QATConvBase
from qir.nn.qat.stubs import DeQuantStub, QuantStub
from qir.quantization.fake_quantize import CalibFakeQuantize, FakeQuantize, FakeQuantState
from qir.quantization.observer import (
    FixedScaleObserver,
    MinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
    ObserverBase,
    PercentileObserver,
)
from qir.quantization.qconfig import QConfig

__all__ = ["OBSERVER_KINDS", "build_fake_quant", "fake_quant_spec"]

#: observer kind (an ObserverSpec's ``observer``) -> class, and the constructor options each reads
OBSERVER_KINDS: dict[str, tuple[type[ObserverBase], tuple[str, ...]]] = {
    "moving_average_minmax": (MovingAveragePerTensorMinMaxObserver, ("averaging_constant",)),
    "moving_average_per_channel_minmax": (MovingAveragePerChannelMinMaxObserver, ("averaging_constant",)),
    "minmax": (MinMaxObserver, ()),
    "percentile": (PercentileObserver, ("percentile", "bins")),
    "fixed_scale": (FixedScaleObserver, ()),
}
_KIND_OF = {cls: kind for kind, (cls, _) in OBSERVER_KINDS.items()}
#: options every observer takes (ObserverBase's constructor)
_COMMON = ("eps", "sync_ranks", "nonfinite")


def fake_quant_spec(fq: Any, where: str) -> FakeQuantSpec:
    """``fq`` as data; NotImplementedError (the module stays an opaque call) when it has no data form."""
    if type(fq) not in (FakeQuantize, CalibFakeQuantize):
        raise NotImplementedError(f"{where}: {type(fq).__name__} is not a FakeQuantize the IR can describe")
    obs = fq.observer
    kind = _KIND_OF.get(type(obs))
    if kind is None:
        raise NotImplementedError(f"{where}: observer {type(obs).__name__} has no IR observer kind")
    if kind == "fixed_scale":
        # FakeQuantize(scale=...) builds the observer with default options: the scale is all there is
        options: dict[str, Any] = {"scale": float(obs.scale.reshape(-1)[0])}
    else:
        names = OBSERVER_KINDS[kind][1] + _COMMON
        options = {k: getattr(obs, k) for k in names}
    state = fq.state.value if isinstance(fq.state, FakeQuantState) else None
    return FakeQuantSpec(
        observer=ObserverSpec(kind, obs.dtype, obs.ch_axis, options),
        calibration=type(fq) is CalibFakeQuantize,
        observe=bool(fq.observer_enabled),
        fake_quant=bool(fq.fake_quant_enabled),
        state=state,
    )


def _factory(spec: FakeQuantSpec) -> Any:
    cls = CalibFakeQuantize if spec.calibration else FakeQuantize
    obs = spec.observer
    opts = dict(obs.options)
    if obs.observer == "fixed_scale":
        return cls.with_args(dtype=obs.dtype.name, scale=float(opts["scale"]))
    observer_cls = OBSERVER_KINDS[obs.observer][0]
    if obs.axis is not None:
        opts["ch_axis"] = obs.axis
    return cls.with_args(observer=observer_cls, dtype=obs.dtype.name, **opts)


def build_fake_quant(spec: FakeQuantSpec, tensors: dict[str, torch.Tensor], prefix: str) -> FakeQuantize:
    """A fake quant as ``spec`` describes it, holding ``tensors[prefix + '.' + role]`` (shared, not copied)."""
    if spec.observer.observer not in OBSERVER_KINDS:
        raise ValueError(
            f"{prefix}: unknown observer kind {spec.observer.observer!r}; the kinds are {', '.join(OBSERVER_KINDS)}"
        )
    fq: FakeQuantize = _factory(spec)()
    for role in spec.roles():
        owner: nn.Module = fq
        leaf = role
        if role.startswith("observer."):
            owner, leaf = fq.observer, role.partition(".")[2]
        owner._buffers[leaf] = tensors[f"{prefix}.{role}"]
    fq.observer_enabled = spec.observe
    fq.fake_quant_enabled = spec.fake_quant
    fq.state = None if spec.state is None else FakeQuantState(spec.state)
    return fq


# ----------------------------------------------------------------------------- conv / linear

_KIND = {nn.Conv1d: "conv1d", nn.Conv2d: "conv2d", nn.Conv3d: "conv3d", nn.ConvTranspose2d: "conv_transpose2d"}
_KIND[nn.Linear] = "linear"
_TORCH = {v: k for k, v in _KIND.items()}


def _read_conv(m: Any) -> QATConv:
    kind = _KIND[m.float_conv]
    apq = m.activation_post_process
    common: dict[str, Any] = {
        "weight_fq": fake_quant_spec(m.weight_fake_quant, f"{type(m).__name__}.weight_fake_quant"),
        "out_fq": None if apq is None else fake_quant_spec(apq, f"{type(m).__name__}.activation_post_process"),
        "bias": m.bias is not None,
        "add": bool(m.has_add),
        "act": m.act,
    }
    if kind == "linear":
        return QATConv(kind=kind, in_channels=m.in_features, out_channels=m.out_features, **common)
    if m.padding_mode != "zeros" and kind == "conv_transpose2d":
        raise NotImplementedError("a conv transpose pads with zeros only")
    return QATConv(
        kind=kind,
        in_channels=m.in_channels,
        out_channels=m.out_channels,
        kernel_size=m.kernel_size,
        stride=m.stride,
        padding=m.padding,
        dilation=m.dilation,
        groups=m.groups,
        output_padding=m.output_padding if kind == "conv_transpose2d" else None,
        padding_mode=m.padding_mode,
        **common,
    )


def _param(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=t.is_floating_point())


def _build_conv(op: Any, tensors: dict[str, torch.Tensor]) -> QATConvBase:
    cls = QAT_CONV_CLASSES[(_TORCH[op.kind], op.add, op.act)]
    out_factory = None if op.out_fq is None else _factory(op.out_fq)
    qc = QConfig(activation=out_factory, weight=_factory(op.weight_fq))
    kw: dict[str, Any] = {"bias": op.bias, "device": "meta", "qconfig": qc}
    if op.kind == "linear":
        m: Any = cls(op.in_channels, op.out_channels, **kw)
    else:
        kw.update(stride=op.stride, padding=op.padding, dilation=op.dilation, groups=op.groups)
        if op.kind == "conv_transpose2d":
            kw["output_padding"] = op.output_padding
        else:
            kw["padding_mode"] = op.padding_mode
        m = cls(op.in_channels, op.out_channels, op.kernel_size, **kw)
    m.weight = _param(tensors["weight"])
    if op.bias:
        m.bias = _param(tensors["bias"])
    m.weight_fake_quant = build_fake_quant(op.weight_fq, tensors, "weight_fake_quant")
    if op.out_fq is not None:
        m.activation_post_process = build_fake_quant(op.out_fq, tensors, "activation_post_process")
    return m  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- stubs


def _read_quant_stub(m: Any) -> QATQuantStub:
    return QATQuantStub(out_fq=fake_quant_spec(m.activation_post_process, "QuantStub.activation_post_process"))


def _build_quant_stub(op: Any, tensors: dict[str, torch.Tensor]) -> QuantStub:
    fq = build_fake_quant(op.out_fq, tensors, "activation_post_process")
    return QuantStub(fq, QConfig(activation=_factory(op.out_fq)))


def _read_dequant_stub(m: Any) -> QATDequantStub:
    return QATDequantStub()


def _build_dequant_stub(op: Any, tensors: dict[str, torch.Tensor]) -> DeQuantStub:
    return DeQuantStub()


def _register() -> None:
    for cls in QAT_CONV_CLASSES.values():
        register_qat_module(QATConv, cls, _read_conv, _build_conv)
    register_qat_module(QATQuantStub, QuantStub, _read_quant_stub, _build_quant_stub)
    register_qat_module(QATDequantStub, DeQuantStub, _read_dequant_stub, _build_dequant_stub)


_register()
