"""Quantized conv / linear modules, plain and fused, generated from the same table as the QAT ones.

Integer rules (docs/semantics.md "Conv / linear", docs/modules.md "Fused conv + add"):
the int32 accumulator is computed exactly: a float kernel on integer values is exact while
every partial sum is an integer below the format's 2**24 (float32) / 2**53 (float64), in any
summation order. float32 is used when ``max_c sum |w_c| * max|x| < 2**24`` (most int8
layers; several times faster), float64 otherwise. The bias is added as int32 at ``s_in * s_w[c]``
(``quantize_bias``), and the result is requantized per output channel
(``conv_requant_params`` + ``requantize``) with ReLU / ReLU6 folded into the clamp
(ReLU6 bound ``round(6 / s_out)``). Without an output fake quant the module returns the
accumulator as qint32 with the per-channel scale ``s_in * s_w[c]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from backends.common import numerics
from backends.common.integer_rules import fused_add_int, fused_add_params
from qir.ir.numerics import abs_sum_max
from qir.ir.types import DType
from qir.nn.qat.conv import QAT_CONV_CLASSES, QATConvBase, class_name
from qir.nn.quantized._base import QuantizedModule, check_qat, march_name, output_fq, per_tensor_scale
from qir.nn.quantized.conv_weight import observed_weight_scale, weight_codes

__all__ = ["QUANTIZED_CONV_CLASSES", "QuantizedConvBase", "observed_weight_scale"]

Q = TypeVar("Q", bound="QuantizedConvBase")


def weight_scale_of(qat: QATConvBase) -> tuple[torch.Tensor, DType]:
    """The weight scale the QAT forward would use now (the QAT module is untouched)."""
    return observed_weight_scale(qat.weight_fake_quant, qat.weight, type(qat).__name__)


def conv_hyper_parameters(m: Any) -> dict[str, Any]:
    """A conv / linear module's hyper-parameters as the integer module keeps them (``hp``; None on Linear)."""
    return {
        "stride": getattr(m, "stride", None),
        "padding": getattr(m, "padding", None),
        "dilation": getattr(m, "dilation", None),
        "groups": getattr(m, "groups", 1),
        "output_padding": getattr(m, "output_padding", None),
        "padding_mode": getattr(m, "padding_mode", "zeros"),
        "reversed_padding": getattr(m, "_reversed_padding_repeated_twice", None),
    }


@dataclasses.dataclass(frozen=True)
class ConvIntegerState:
    """What converting a QAT conv / linear gives: the integer module's buffers and add parameters."""

    weight: torch.Tensor  # int8 / int16 codes
    bias: torch.Tensor  # int32 at s_in * s_w[c]
    scale: torch.Tensor  # output scale: (1,), or per channel shaped to broadcast for a qint32 output
    multiplier: torch.Tensor
    shift: torch.Tensor
    relu6_bound: torch.Tensor
    dtype: DType
    add_multiplier: int = 0
    add_shift: int = 0
    extra_bits: int = 0


def integer_conv_state(
    cls: type[QuantizedConvBase],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    c_out: int,
    weight_scale: tuple[torch.Tensor, DType],
    input_scales: Sequence[torch.Tensor],
    out: tuple[torch.Tensor, DType] | None,
    march: str,
    codes: torch.Tensor | None = None,
) -> ConvIntegerState:
    """The integer state of quantized conv class ``cls`` (docs/semantics.md "Conv / linear").

    ``weight`` / ``bias``: the float parameters; ``c_out``: the output channels; ``weight_scale``:
    the weight fake quant's scale and dtype as the QAT forward would use them (:func:`weight_scale_of`);
    ``input_scales``: the input's (and the addend's) float32 scale tensors; ``out``: the output fake
    quant's scale and dtype (None: a high-precision qint32 output); ``codes``: the weight's codes at
    ``weight_scale`` when the caller has them (:func:`~qir.nn.quantized.conv_weight.weight_codes`, which
    observes and quantizes in one pass), else quantized here. The one arithmetic of conversion:
    ``from_qat`` and the ``quantize`` pass's rule (quantize_rules.py) both call it."""
    name = cls.__name__
    s_in = per_tensor_scale(name, input_scales[0], 0)
    s_w, w_dtype = weight_scale
    w_axis = cls.qat_class.weight_axis if s_w.numel() > 1 else None
    if codes is None:
        # the verifier's accumulator bound and the module's weight_l1_max read the codes' L1 norms next
        codes = numerics.quantize(weight, s_w, w_dtype, axis=w_axis, note_abs_sums=True)
    if s_w.numel() > 1 and s_w.numel() != c_out:  # grouped conv transpose: axis 1 holds out/groups channels
        s_w = s_w.repeat(c_out // s_w.numel())
    s_w_out = s_w if s_w.numel() > 1 else s_w.reshape(())
    b = bias if bias is not None else torch.zeros(c_out)
    acc_scale = numerics.accumulator_scale(s_in, s_w_out)  # once: the bias's, the requantization's, a qint32 output's
    int_bias = numerics.bias_codes(b, acc_scale).to(torch.int32)
    s_acc = acc_scale.reshape(-1).expand(c_out).clone()
    add = (0, 0, 0)
    if out is None:
        if cls.has_add:
            raise NotImplementedError(
                f"{name}: a fused add with a high-precision (qint32) output is not implemented; "
                "give the module an activation fake quant (qconfig.activation) or unfuse the add"
            )
        dtype = DType.qint32
        shape = [c_out] + [1] * _OUT_NDIM_AFTER_CHANNEL[cls.kind]
        scale = s_acc.to(torch.float32).reshape(shape)
        mult, sh = torch.ones(c_out, dtype=torch.int64), torch.zeros(c_out, dtype=torch.int64)
        bound = numerics.quantize(torch.full((c_out,), 6.0, dtype=torch.float64), s_acc, "qint32", axis=0)
    else:
        s_out, dtype = out
        if s_out.numel() != 1:
            raise ValueError(f"{name}: the output fake quant must be per tensor, got {s_out.numel()} scales")
        scale = s_out.to(torch.float32).reshape(1).clone()
        if cls.has_add:
            s_add = per_tensor_scale(name, input_scales[1], 1)
            p = fused_add_params(s_acc, s_add, float(s_out), march, dtype)
            mult, sh = p.acc_multiplier.expand(c_out).clone(), p.acc_shift.expand(c_out).clone()
            add = (p.add_multiplier, p.add_shift, p.extra_bits)
        else:
            m, s = numerics.acc_requant_params(acc_scale, s_out, march, dtype)
            mult, sh = m.reshape(-1).expand(c_out).clone(), s.reshape(-1).expand(c_out).clone()
        bound = numerics.quantize(torch.tensor([6.0]), s_out, dtype).to(torch.int64).expand(c_out).clone()
    return ConvIntegerState(codes, int_bias, scale, mult, sh, bound.to(torch.int64), dtype, *add)


#: dimensions after the channel axis of each kind's output
_OUT_NDIM_AFTER_CHANNEL = {"Conv1d": 1, "Conv2d": 2, "Conv3d": 3, "ConvTranspose2d": 2, "Linear": 0}


class QuantizedConvBase(QuantizedModule):
    """Behaviour shared by every generated quantized conv / linear class."""

    derived: ClassVar[tuple[str, ...]] = ("weight_l1_max", "add_multiplier", "add_shift", "extra_bits")

    qat_class: ClassVar[type[QATConvBase]]
    kind: ClassVar[str] = "Conv2d"
    has_add: ClassVar[bool] = False
    act: ClassVar[str | None] = None
    out_axis: ClassVar[int] = 1
    weight: torch.Tensor
    bias: torch.Tensor
    multiplier: torch.Tensor
    shift: torch.Tensor
    relu6_bound: torch.Tensor
    hp: dict[str, Any]
    weight_l1_max: int  # max over output channels of sum |w|: bounds every partial sum / max|x|
    march: str
    add_multiplier: int
    add_shift: int
    extra_bits: int

    @classmethod
    def from_qat(cls: type[Q], qat: nn.Module, input_scales: Sequence[Any], march: Any) -> Q:
        """Integer module from a QAT one; ``input_scales``: the input's (and the addend's) scale."""
        check_qat(cls, qat, cls.qat_class)
        assert isinstance(qat, QATConvBase)
        new = cls()
        new._convert(qat, input_scales, march_name(march))
        return new

    def _convert(self, qat: QATConvBase, input_scales: Sequence[Any], march: str) -> None:
        fq = output_fq(qat)
        self._set_scales(input_scales, None, None, 2 if self.has_add else 1)
        self.hp = conv_hyper_parameters(qat)
        s_w, w_dtype, codes = weight_codes(qat.weight_fake_quant, qat.weight, type(qat).__name__, qat.weight_axis)
        st = integer_conv_state(
            type(self),
            qat.weight.detach(),
            None if qat.bias is None else qat.bias.detach(),
            self._out_channels(qat),
            (s_w, w_dtype),
            self.input_scales,
            None if fq is None else (fq.scale.detach(), fq.dtype),
            march,
            codes,
        )
        self.dtype = st.dtype
        for role in ("weight", "bias", "scale", "multiplier", "shift", "relu6_bound"):
            self.register_buffer(role, getattr(st, role))
        self.weight_l1_max = abs_sum_max(self.weight, qat.weight_axis)
        if self.has_add:
            self.add_multiplier, self.add_shift, self.extra_bits = st.add_multiplier, st.add_shift, st.extra_bits
        self.march = march

    def _out_channels(self, qat: QATConvBase) -> int:
        m: Any = qat
        return int(m.out_features if self.kind == "Linear" else m.out_channels)

    def _out_ndim_after_channel(self) -> int:
        return _OUT_NDIM_AFTER_CHANNEL[self.kind]

    def _accumulate(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            raise TypeError(f"{type(self).__name__} takes integer code tensors, got {x.dtype}; quantize with QuantStub")
        xmax = {torch.int8: 128, torch.int16: 32768}.get(x.dtype)
        ct = torch.float32 if xmax is not None and self.weight_l1_max * xmax < 2**24 else torch.float64
        xf = x.to(ct)
        w = self.weight.to(ct)
        hp = self.hp
        if self.kind == "Linear":
            y = F.linear(xf, w)
        elif self.kind == "ConvTranspose2d":
            y = F.conv_transpose2d(
                xf, w, None, hp["stride"], hp["padding"], hp["output_padding"], hp["groups"], hp["dilation"]
            )
        else:
            conv = {"Conv1d": F.conv1d, "Conv2d": F.conv2d, "Conv3d": F.conv3d}[self.kind]
            padding = hp["padding"]
            if hp["padding_mode"] != "zeros":
                xf = F.pad(xf, hp["reversed_padding"], mode=hp["padding_mode"])
                padding = 0
            y = conv(xf, w, None, hp["stride"], padding, hp["dilation"], hp["groups"])
        acc = y.to(torch.int64)
        return acc + numerics.broadcast_along(self.bias.to(torch.int64), self.out_axis, acc.dim())

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``FloatFunctional.add``'s call form (eager models fused at the add): ``self(x, y)``."""
        if not self.has_add:
            raise TypeError(f"{type(self).__name__} has no fused add; call it as a module")
        out: torch.Tensor = self(x, y)
        return out

    def forward(self, x: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
        acc = self._accumulate(x)
        ax = self.out_axis
        if self.has_add:
            if addend is None:
                raise TypeError(f"{type(self).__name__}.forward needs the addend (second input)")
            assert self.dtype is not None
            out = fused_add_int(
                acc,
                addend,
                self.multiplier,
                self.shift,
                self.add_multiplier,
                self.add_shift,
                self.extra_bits,
                self.dtype,
                ax,
            )
        elif addend is not None:
            raise TypeError(f"{type(self).__name__} has no fused add; got a second input")
        elif self.dtype is DType.qint32:
            out = acc
        else:
            assert self.dtype is not None
            out = numerics.requantize(acc, self.multiplier, self.shift, self.dtype, axis=ax)
        if self.act is not None:
            wide = out.to(torch.int64).clamp(min=0)
            if self.act == "relu6":
                wide = torch.minimum(wide, numerics.broadcast_along(self.relu6_bound, ax, wide.dim()))
            out = wide
        assert self.dtype is not None
        return numerics.saturate(out, self.dtype) if out.dtype != self.dtype.to_torch() else out


#: QAT class -> quantized class
QUANTIZED_CONV_CLASSES: dict[type[QATConvBase], type[QuantizedConvBase]] = {}

_SUFFIX = {
    (False, None): "",
    (False, "relu"): "ReLU",
    (False, "relu6"): "ReLU6",
    (True, None): "Add",
    (True, "relu"): "AddReLU",
    (True, "relu6"): "AddReLU6",
}


def _make() -> dict[str, Any]:
    made: dict[str, Any] = {}
    for (torch_cls, has_add, act), qat_cls in QAT_CONV_CLASSES.items():
        kind = torch_cls.__name__
        name = class_name(kind, _SUFFIX[(has_add, act)])
        cls = type(
            name,
            (QuantizedConvBase,),
            {
                "qat_class": qat_cls,
                "kind": kind,
                "has_add": has_add,
                "act": act,
                "out_axis": qat_cls.out_axis,
                "__module__": __name__,
                "__qualname__": name,
                "__doc__": f"Quantized {kind}{' + add' if has_add else ''}{' + ' + act if act else ''} "
                "(integer codes).",
            },
        )
        QUANTIZED_CONV_CLASSES[qat_cls] = cls
        made[name] = cls
    return made


_GENERATED = _make()
globals().update(_GENERATED)
__all__ += sorted(_GENERATED)

Conv1d: type[QuantizedConvBase]
Conv2d: type[QuantizedConvBase]
Conv3d: type[QuantizedConvBase]
ConvTranspose2d: type[QuantizedConvBase]
Linear: type[QuantizedConvBase]
ConvReLU1d: type[QuantizedConvBase]
ConvReLU2d: type[QuantizedConvBase]
ConvReLU3d: type[QuantizedConvBase]
ConvReLU61d: type[QuantizedConvBase]
ConvReLU62d: type[QuantizedConvBase]
ConvReLU63d: type[QuantizedConvBase]
ConvAdd1d: type[QuantizedConvBase]
ConvAdd2d: type[QuantizedConvBase]
ConvAdd3d: type[QuantizedConvBase]
ConvAddReLU1d: type[QuantizedConvBase]
ConvAddReLU2d: type[QuantizedConvBase]
ConvAddReLU3d: type[QuantizedConvBase]
ConvAddReLU61d: type[QuantizedConvBase]
ConvAddReLU62d: type[QuantizedConvBase]
ConvAddReLU63d: type[QuantizedConvBase]
ConvTransposeReLU2d: type[QuantizedConvBase]
ConvTransposeReLU62d: type[QuantizedConvBase]
ConvTransposeAdd2d: type[QuantizedConvBase]
ConvTransposeAddReLU2d: type[QuantizedConvBase]
ConvTransposeAddReLU62d: type[QuantizedConvBase]
LinearReLU: type[QuantizedConvBase]
LinearReLU6: type[QuantizedConvBase]
LinearAdd: type[QuantizedConvBase]
LinearAddReLU: type[QuantizedConvBase]
LinearAddReLU6: type[QuantizedConvBase]


# ----------------------------------------------------------------------------- the IR's qconv op

#: the qconv / qat_conv op's ``kind`` -> the quantized class's ``kind``
MODULE_KIND = {"conv1d": "Conv1d", "conv2d": "Conv2d", "conv3d": "Conv3d", "conv_transpose2d": "ConvTranspose2d"}
MODULE_KIND["linear"] = "Linear"

#: (kind, fused add, activation) -> the quantized conv class (the first registered, as a search would give)
CONV_CLASS_OF: dict[tuple[str, bool, Any], type[QuantizedConvBase]] = {}
for _c in QUANTIZED_CONV_CLASSES.values():
    CONV_CLASS_OF.setdefault((_c.kind, _c.has_add, _c.act), _c)


def _from_qconv(op: Any, tensors: dict[str, torch.Tensor]) -> QuantizedConvBase:
    """The integer module a ``qconv`` op stands for, holding ``tensors`` (emit and evaluation)."""
    kind = MODULE_KIND[op.kind]
    cls = CONV_CLASS_OF.get((kind, op.add, op.act))
    if cls is None:
        raise ValueError(f"qconv: no quantized {kind} class with add={op.add} act={op.act!r}")
    m = cls()
    m.hp = op.hyper_parameters()
    m.num_input_scales = len(op.in_scales)
    for i, s in enumerate(op.in_scales):
        m.register_buffer(f"input_scale_{i}", torch.tensor([s], dtype=torch.float32))
    m.register_buffer("weight", tensors["weight"])
    m.register_buffer("bias", tensors["bias"])
    m.dtype = op.out.dtype
    scale = torch.tensor(op.out.scale, dtype=torch.float32)
    if op.out.axis is not None:  # a qint32 accumulator's per-channel scale, shaped to broadcast
        scale = scale.reshape([len(op.out.scale)] + [1] * m._out_ndim_after_channel())
    m.register_buffer("scale", scale)  # where from_qat registers it: the state-dict order is the same
    for role in ("multiplier", "shift", "relu6_bound"):
        m.register_buffer(role, tensors[role])
    w_axis = 1 if kind == "ConvTranspose2d" else 0
    m.weight_l1_max = abs_sum_max(m.weight, w_axis)
    m.march = op.march
    if op.add:
        m.add_multiplier, m.add_shift, m.extra_bits = op.add_multiplier, op.add_shift, op.extra_bits
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import QConv, register_integer_module

    for cls in QUANTIZED_CONV_CLASSES.values():
        register_integer_module(QConv, cls, _from_qconv)


_register_ir()
