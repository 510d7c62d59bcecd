"""Quantization ops: fake quantization (with its observer), quantize, dequantize, requantize.

These are the ops the quantization stages of the pipeline speak:

* ``fake_quant(%x, %scale, ...)`` — observation and fake quantization of a float value.
  Its :class:`ObserverSpec` attribute is the qconfig's observer reduced to data (kind,
  dtype, channel axis, options); its trailing operands are the observer's state as
  ``constant`` nodes keyed by state-dict name (``conv1.activation_post_process.scale``),
  and the node's scope is the fake quant module's path. Emitting it rebuilds a trainable
  module with the same state-dict keys. Evaluated, it is
  ``dequantize(quantize(x, scale))`` with the scale it holds.
* ``quantize(%x) {spec=QuantSpec(...)}`` — float to integer codes (half up, saturating).
* ``dequantize(%q) {spec=...}`` — integer codes to float (``code * scale``).
* ``requantize(%acc) {spec=..., multiplier=(...), shift=(...), axis=...}`` — integer codes at
  one scale to codes at another with the integer datapath:
  ``saturate((acc * multiplier + 2**(shift-1)) >> shift)``.

``quantize``, ``dequantize`` and ``requantize`` repeat the :class:`~qir.ir.types.QuantSpec`
their operand or result type carries, and the verifier checks that the two agree: the
text stays readable on its own and an edit to one without the other is caught.
The arithmetic is :mod:`qir.ir.numerics`, the one implementation the module library and
the backends also use.
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch

from qir.ir import numerics
from qir.ir.op import IRError, Op, Pure, Quantization, ShapePreserving, Trait, register_op
from qir.ir.ops.integer_values import check_scale_values
from qir.ir.printer import register_attr_class
from qir.ir.types import DType, QuantSpec, TensorType, Type

__all__ = ["Dequantize", "FakeQuant", "ObserverSpec", "Quantize", "Requantize"]

_LITERAL = (bool, int, float, str, type(None))


def _check_literal(name: str, value: Any) -> None:
    if isinstance(value, tuple):
        for v in value:
            _check_literal(name, v)
    elif not isinstance(value, _LITERAL):
        raise ValueError(
            f"observer option {name!r} must be a literal (number, string, bool, None, tuple), got {value!r}"
        )
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"observer option {name!r} must be finite, got {value!r}")


def _options(value: Any) -> tuple[tuple[str, Any], ...]:
    items = value.items() if isinstance(value, dict) else value
    out = tuple(sorted((str(k), v) for k, v in items))
    return out


@register_attr_class
@attrs.frozen
class ObserverSpec:
    """How a ``fake_quant`` finds its scale: the observer kind, its dtype, channel axis, options.

    ``observer`` names an observer kind the public layer knows (``"moving_average_minmax"``,
    ``"minmax"``, ``"percentile"``, ``"fixed_scale"``, ...); ``options`` are its keyword
    arguments as sorted ``(name, literal)`` pairs, so two specs compare equal exactly when
    they would build the same observer.
    """

    observer: str = "moving_average_minmax"
    dtype: DType = DType.qint8
    axis: int | None = None
    options: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_options)

    def __attrs_post_init__(self) -> None:
        if not self.observer.isidentifier() or keyword.iskeyword(self.observer):
            raise ValueError(f"observer kind must be an identifier, got {self.observer!r}")
        if self.dtype not in (DType.qint8, DType.qint16):
            raise ValueError(
                f"a fake quant produces qint8 or qint16, got {self.dtype.name} "
                "(qint32 is a high-precision output: no fake quant)"
            )
        names = [k for k, _ in self.options]
        if len(set(names)) != len(names):
            raise ValueError(f"observer options repeat a name: {names}")
        for k, v in self.options:
            if not k.isidentifier():
                raise ValueError(f"observer option name must be an identifier, got {k!r}")
            _check_literal(k, v)

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)


def _tensor(op: Op, role: str, t: Type) -> TensorType:
    if not isinstance(t, TensorType):
        raise IRError(f"op {op.name!r}: operand {role} must be a tensor, got {t}")
    return t


def _check_axis(op: Op, axis: int | None, t: TensorType, n: int, what: str) -> None:
    """``n`` parameters: one per tensor (axis None) or one per slice along ``axis`` of ``t``."""
    if axis is None:
        if n != 1:
            raise IRError(f"op {op.name!r}: {n} {what} need a channel axis; set axis")
        return
    if not -t.rank <= axis < t.rank:
        raise IRError(f"op {op.name!r}: axis {axis} is out of range for {t}")
    if t.shape[axis] != n:
        raise IRError(f"op {op.name!r}: {n} {what} but axis {axis} of {t} has {t.shape[axis]} entries")


@register_op
@attrs.frozen
class FakeQuant(Op):
    """Observe and fake-quantize a float tensor: operands ``(input, scale, *other state)``.

    ``state`` names the trailing constant operands (the first is always ``"scale"``); the
    rest (``min_val``, ``max_val``, histograms, ...) belong to the observer and ride along
    so that an emitted module has the same state as the one traced.
    """

    name: ClassVar[str] = "fake_quant"
    # Not Pure: in training, observing updates the observer's state.
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Quantization, ShapePreserving})
    arity: ClassVar[tuple[int, int | None]] = (2, None)
    operand_names: ClassVar[tuple[str, ...]] = ("input", "scale")

    spec: ObserverSpec = ObserverSpec()
    state: tuple[str, ...] = ("scale",)

    def compute(self, x: Any, scale: Any, *state: Any) -> Any:
        if x.device.type == "meta":
            return torch.empty_like(x)
        codes = numerics.quantize(x, scale.reshape(-1), self.spec.dtype, self.spec.axis)
        return numerics.dequantize(codes, scale.reshape(-1), self.spec.axis).to(x.dtype)

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        return operand_types[0]

    def verify_(self, operand_types: Sequence[Type]) -> None:
        if not self.state or self.state[0] != "scale":
            raise IRError(f"op {self.name!r}: state must start with 'scale', got {self.state}")
        if len(set(self.state)) != len(self.state):
            raise IRError(f"op {self.name!r}: state names repeat: {self.state}")
        if len(operand_types) != 1 + len(self.state):
            raise IRError(
                f"op {self.name!r}: state {self.state} needs {1 + len(self.state)} operands, got {len(operand_types)}"
            )
        x = _tensor(self, "input", operand_types[0])
        if not x.dtype.is_float:
            raise IRError(f"op {self.name!r}: input must be a float tensor, got {x}")
        for role, t in zip(self.state, operand_types[1:], strict=True):
            _tensor(self, role, t)
        scale = _tensor(self, "scale", operand_types[1])
        if not scale.dtype.is_float:
            raise IRError(f"op {self.name!r}: scale must be a float tensor, got {scale}")
        _check_axis(self, self.spec.axis, x, scale.numel, "scales")

    def verify_values(self, operand_types: Sequence[Type], values: Sequence[torch.Tensor | None]) -> None:
        """A bound scale is positive and finite: ``x / scale`` with a zero, negative or NaN scale
        runs, but computes nothing a quantized model can deploy."""
        if len(values) > 1 and values[1] is not None:
            check_scale_values(self.name, "scale", values[1])


def _spec_type(t: TensorType, spec: QuantSpec) -> TensorType:
    return TensorType(t.shape, spec.dtype, spec)


@register_op
@attrs.frozen
class Quantize(Op):
    """Float to integer codes: ``saturate(floor(x / scale + 0.5))``; the result carries ``spec``."""

    name: ClassVar[str] = "quantize"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, Quantization, ShapePreserving})
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    spec: QuantSpec

    def compute(self, x: Any) -> Any:
        if x.device.type == "meta":
            return torch.empty(x.shape, dtype=self.spec.dtype.to_torch(), device="meta")
        return numerics.quantize(x, self.spec.scale, self.spec.dtype, self.spec.axis)

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        self.verify_(operand_types)  # the result type cannot exist when the spec does not fit
        return _spec_type(_tensor(self, "input", operand_types[0]), self.spec)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        x = _tensor(self, "input", operand_types[0])
        if not x.dtype.is_float:
            raise IRError(f"op {self.name!r}: input must be a float tensor, got {x}")
        _check_axis(self, self.spec.axis, x, len(self.spec.scale), "scales")


@register_op
@attrs.frozen
class Dequantize(Op):
    """Integer codes to float32: ``code * scale``; ``spec`` must be the operand's own."""

    name: ClassVar[str] = "dequantize"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, Quantization, ShapePreserving})
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    spec: QuantSpec

    def compute(self, q: Any) -> Any:
        if q.device.type == "meta":
            return torch.empty(q.shape, dtype=torch.float32, device="meta")
        return numerics.dequantize(q, self.spec.scale, self.spec.axis)

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        return TensorType(_tensor(self, "input", operand_types[0]).shape, DType.float32)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        q = _tensor(self, "input", operand_types[0])
        if q.quant is None:
            raise IRError(f"op {self.name!r}: input must be a quantized tensor, got {q}")
        if q.quant != self.spec:
            raise IRError(f"op {self.name!r}: spec {self.spec} differs from the input's {q.quant}")


@register_op
@attrs.frozen
class Requantize(Op):
    """Codes at one scale to codes at ``spec``'s: ``saturate((q * multiplier + 2**(shift-1)) >> shift)``.

    ``multiplier`` / ``shift`` hold one entry per tensor (``axis`` None) or one per slice
    along ``axis`` of the input (a conv accumulator is per output channel). They are
    integers chosen for one march's datapath (:func:`backends.common.numerics.requant_params`).
    """

    name: ClassVar[str] = "requantize"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, Quantization, ShapePreserving})
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    spec: QuantSpec
    multiplier: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(x) for x in v))
    shift: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(x) for x in v))
    axis: int | None = None

    def __attrs_post_init__(self) -> None:
        if len(self.multiplier) != len(self.shift) or not self.multiplier:
            raise IRError(
                f"op {self.name!r}: multiplier and shift need the same, non-zero length; "
                f"got {len(self.multiplier)} and {len(self.shift)}"
            )
        if any(not 0 <= s <= 62 for s in self.shift):
            raise IRError(f"op {self.name!r}: shifts must be in 0..62, got {self.shift}")
        if any(abs(m) >= 2**31 for m in self.multiplier):
            raise IRError(f"op {self.name!r}: multipliers must fit in 32 bits, got {self.multiplier}")

    def compute(self, q: Any) -> Any:
        if q.device.type == "meta":
            return torch.empty(q.shape, dtype=self.spec.dtype.to_torch(), device="meta")
        m = torch.tensor(self.multiplier, dtype=torch.int64)
        s = torch.tensor(self.shift, dtype=torch.int64)
        if self.axis is None:
            return numerics.requantize(q, m.reshape(()), s.reshape(()), self.spec.dtype)
        return numerics.requantize(q, m, s, self.spec.dtype, axis=self.axis)

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        self.verify_(operand_types)
        return _spec_type(_tensor(self, "input", operand_types[0]), self.spec)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        q = _tensor(self, "input", operand_types[0])
        if q.quant is None:
            raise IRError(f"op {self.name!r}: input must be a quantized tensor, got {q}")
        _check_axis(self, self.axis, q, len(self.multiplier), "multipliers")
        _check_axis(self, self.spec.axis, q, len(self.spec.scale), "output scales")
