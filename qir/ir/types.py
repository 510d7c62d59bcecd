"""Value types of the IR: tensors (optionally quantized), scalars, sequences, objects.

Every value in a :class:`~qir.ir.graph.Graph` carries one of these. They are
immutable and hashable, print to a stable text form (see :func:`format_type`) and
parse back from it (:func:`parse_type`).
"""

from __future__ import annotations

import builtins
import enum
import math
import re
from collections.abc import Iterable
from typing import Any

import attrs
import torch


class DType(enum.Enum):
    """Element types. The quantized ones carry integer data plus a :class:`QuantSpec`."""

    float32 = "f32"
    float64 = "f64"
    float16 = "f16"
    bfloat16 = "bf16"
    int64 = "i64"
    int32 = "i32"
    int16 = "i16"
    int8 = "i8"
    uint8 = "u8"
    bool = "bool"
    qint8 = "qi8"
    qint16 = "qi16"
    qint32 = "qi32"
    qbool = "qbool"

    def __eq__(self, other: object) -> builtins.bool:
        # The plugin's dtypes are the strings "qint8" / "qint16" (qir.dtype keeps them), and users'
        # code branches on ``fake_quant.dtype == qint16``: an enum never equal to its name would
        # silently take the other branch. Equal to its name only; the hash is the name's already.
        if isinstance(other, str):
            return other == self.name
        return self is other

    __hash__ = enum.Enum.__hash__

    @property
    def is_quantized(self) -> builtins.bool:
        return self in _QUANT_RANGE

    @property
    def is_float(self) -> builtins.bool:
        return self in (DType.float32, DType.float64, DType.float16, DType.bfloat16)

    @property
    def qrange(self) -> tuple[int, int]:
        """Inclusive integer range of a quantized dtype."""
        try:
            return _QUANT_RANGE[self]
        except KeyError:
            raise ValueError(f"dtype {self.name} is not a quantized dtype") from None

    def to_torch(self) -> torch.dtype:
        """The torch dtype that stores this dtype's elements (quantized ones as ints)."""
        return _TO_TORCH[self]

    @staticmethod
    def from_torch(dt: torch.dtype) -> DType:
        try:
            return _FROM_TORCH[dt]
        except KeyError:
            raise ValueError(f"torch dtype {dt} has no IR dtype") from None

    @staticmethod
    def parse(text: str) -> DType:
        """Accept the short text form (``qi8``) or the enum name (``qint8``)."""
        found = _BY_TEXT.get(text) if type(text) is str else None
        if found is not None:
            return found
        for d in DType:  # not a plain string (a DType is equal to its name)
            if text in (d.value, d.name):
                return d
        raise ValueError(f"unknown dtype {text!r}; known: {', '.join(d.value for d in DType)}")


#: DType.parse's table (every fake quant's construction parses its dtype: enum iteration is slow)
_BY_TEXT: dict[str, DType] = {**{d.name: d for d in DType}, **{d.value: d for d in DType}}

_QUANT_RANGE = {
    DType.qint8: (-128, 127),
    DType.qint16: (-32768, 32767),
    DType.qint32: (-(2**31), 2**31 - 1),
    DType.qbool: (0, 1),
}

_TO_TORCH = {
    DType.float32: torch.float32,
    DType.float64: torch.float64,
    DType.float16: torch.float16,
    DType.bfloat16: torch.bfloat16,
    DType.int64: torch.int64,
    DType.int32: torch.int32,
    DType.int16: torch.int16,
    DType.int8: torch.int8,
    DType.uint8: torch.uint8,
    DType.bool: torch.bool,
    DType.qint8: torch.int8,
    DType.qint16: torch.int16,
    DType.qint32: torch.int32,
    DType.qbool: torch.bool,
}
_FROM_TORCH = {t: d for d, t in _TO_TORCH.items() if not d.is_quantized}


def _int_tuple(v: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(x) for x in v)


UNKNOWN_DIM = -1
"""A tensor dimension not known before the graph runs (text form ``?``): the QAT model's IR typed
without example inputs has an unknown batch size and spatial sizes (docs/ir.md). The rank is
always known. Every other dimension is a size >= 0."""


def _type_tuple(v: Iterable[Type]) -> tuple[Type, ...]:
    return tuple(v)


def _float_tuple(v: Any) -> tuple[float, ...]:
    if isinstance(v, torch.Tensor):
        return tuple(float(x) for x in v.detach().reshape(-1).tolist())
    if isinstance(v, (int, float)):
        return (float(v),)
    return tuple(float(x) for x in v)


@attrs.frozen
class QuantSpec:
    """Symmetric quantization parameters: ``real = int * scale`` (zero point is always 0).

    ``scale`` has one entry per tensor (``axis is None``) or one per slice along ``axis``.
    """

    scale: tuple[float, ...] = attrs.field(converter=_float_tuple)
    dtype: DType = DType.qint8
    axis: int | None = None
    zero_point: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.dtype.is_quantized:
            raise ValueError(f"QuantSpec dtype must be quantized, got {self.dtype.name}")
        if self.zero_point != 0:
            raise ValueError("qir quantization is symmetric: zero_point must be 0")
        if not self.scale:
            raise ValueError("QuantSpec needs at least one scale")
        if self.axis is None and len(self.scale) != 1:
            raise ValueError(f"per-tensor QuantSpec has {len(self.scale)} scales; set axis")
        if any(not (0.0 < s < math.inf) for s in self.scale):
            raise ValueError(f"scales must be positive and finite, got {self.scale[:4]}...")


@attrs.frozen
class Type:
    """Base of all value types."""

    def __str__(self) -> str:
        # messages show the text form (tensor<1x3xf32>), not the attrs repr
        return format_type(self)


@attrs.frozen
class TensorType(Type):
    shape: tuple[int, ...] = attrs.field(converter=_int_tuple)
    dtype: DType = DType.float32
    quant: QuantSpec | None = None

    def __attrs_post_init__(self) -> None:
        if any(d < 0 and d != UNKNOWN_DIM for d in self.shape):
            raise ValueError(f"TensorType dimensions must be >= 0 (or UNKNOWN_DIM, text '?'), got {self.shape}")
        if self.quant is not None and self.quant.dtype is not self.dtype:
            raise ValueError(
                f"TensorType dtype {self.dtype.name} disagrees with its QuantSpec dtype {self.quant.dtype.name}"
            )
        if self.quant is not None and self.quant.axis is not None:
            ax = self.quant.axis
            if not -len(self.shape) <= ax < len(self.shape):
                raise ValueError(f"QuantSpec axis {ax} out of range for shape {self.shape}")
            if self.shape[ax] == UNKNOWN_DIM:
                raise ValueError(
                    f"QuantSpec axis {ax} of shape {_dims_text(self.shape)} is unknown: "
                    "a per-channel axis needs its size"
                )
            if len(self.quant.scale) != self.shape[ax]:
                raise ValueError(
                    f"QuantSpec has {len(self.quant.scale)} scales but axis {ax} has {self.shape[ax]} entries"
                )

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def has_unknown_dims(self) -> bool:
        """Whether some dimension is :data:`UNKNOWN_DIM` (the rank is known either way)."""
        return UNKNOWN_DIM in self.shape

    @property
    def numel(self) -> int:
        if self.has_unknown_dims:
            raise ValueError(
                f"tensor<{_dims_text(self.shape)}x...> has unknown dimensions: its element count is not known"
            )
        n = 1
        for s in self.shape:
            n *= s
        return n

    def admits(self, shape: Iterable[int]) -> bool:
        """Whether a tensor of ``shape`` is of this type's shape: the same rank, and the same size
        wherever this type's dimension is known."""
        return dims_agree(self.shape, tuple(shape))

    def with_shape(self, shape: tuple[int, ...]) -> TensorType:
        return attrs.evolve(self, shape=shape)


@attrs.frozen
class ScalarType(Type):
    """A Python scalar that flows through the graph (e.g. ``x.size(0)``)."""

    kind: str  # "int" | "float" | "bool"

    def __attrs_post_init__(self) -> None:
        if self.kind not in ("int", "float", "bool"):
            raise ValueError(f"ScalarType kind must be int, float or bool, got {self.kind!r}")


@attrs.frozen
class SequenceType(Type):
    """A tuple or list of values, each with its own type (``torch.split`` results, sizes)."""

    elements: tuple[Type, ...] = attrs.field(converter=_type_tuple)
    kind: str = "tuple"  # "tuple" | "list"


@attrs.frozen
class ObjectType(Type):
    """Anything else, named by its Python type (``NoneType``, ``dict``, ``torch.device``)."""

    name: str


def type_of(value: Any) -> Type:
    """The IR type of a runtime value (used by shape propagation)."""
    if isinstance(value, torch.Tensor):
        return TensorType(tuple(value.shape), DType.from_torch(value.dtype))
    if isinstance(value, bool):
        return ScalarType("bool")
    if isinstance(value, int):
        return ScalarType("int")
    if isinstance(value, float):
        return ScalarType("float")
    if isinstance(value, torch.Size):
        return SequenceType(tuple(ScalarType("int") for _ in value), "size")
    if isinstance(value, tuple):
        return SequenceType(tuple(type_of(v) for v in value), "tuple")
    if isinstance(value, list):
        return SequenceType(tuple(type_of(v) for v in value), "list")
    return ObjectType(type(value).__name__)


# ----------------------------------------------------------------------------- text form


def _fmt_float(x: float) -> str:
    return repr(float(x))


def _dims_text(shape: tuple[int, ...]) -> str:
    return "x".join("?" if d == UNKNOWN_DIM else str(d) for d in shape)


def dims_agree(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Same rank, and equal sizes wherever both are known (an unknown dimension agrees with any size)."""
    return len(a) == len(b) and all(x == y or UNKNOWN_DIM in (x, y) for x, y in zip(a, b, strict=True))


def has_unknown_dims(t: Type) -> bool:
    """Whether a tensor in ``t`` (a tensor type, or a sequence of them at any depth) has an unknown dimension."""
    if isinstance(t, TensorType):
        return t.has_unknown_dims
    if isinstance(t, SequenceType):
        return any(has_unknown_dims(e) for e in t.elements)
    return False


def format_type(t: Type) -> str:
    """Stable, space-free text of a type; :func:`parse_type` inverts it exactly."""
    if isinstance(t, TensorType):
        dims = _dims_text(t.shape)
        body = f"{dims}x{t.dtype.value}" if t.shape else t.dtype.value
        if t.quant is not None:
            q = t.quant
            scales = ",".join(_fmt_float(s) for s in q.scale)
            body += f",scale=[{scales}]"
            if q.axis is not None:
                body += f",axis={q.axis}"
        return f"tensor<{body}>"
    if isinstance(t, ScalarType):
        return t.kind
    if isinstance(t, SequenceType):
        return f"{t.kind}<{','.join(format_type(e) for e in t.elements)}>"
    if isinstance(t, ObjectType):
        return f"!{t.name}"
    raise TypeError(f"cannot format {t!r}")


_TOKEN = re.compile(r"\s*(tensor<|tuple<|list<|size<|<|>|,|\[|\]|=|![\w.]+|[^\s<>,\[\]=]+)")


class _TypeParser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks: list[str] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                if text[pos:].strip() == "":
                    break
                raise ValueError(f"bad type text {text!r} at column {pos}")
            self.toks.append(m.group(1))
            pos = m.end()
        self.i = 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise ValueError(f"bad type text {self.text!r}: expected {expected or 'more'}, got {tok!r}")
        self.i += 1
        return tok

    def parse(self, depth: int = 0) -> Type:
        if depth > MAX_TYPE_DEPTH:
            raise ValueError(f"bad type text {self.text[:40]!r}...: nested deeper than {MAX_TYPE_DEPTH} levels")
        tok = self.take()
        if tok == "tensor<":
            return self._tensor()
        if tok in ("tuple<", "list<", "size<"):
            elems: list[Type] = []
            if self.peek() != ">":
                elems.append(self.parse(depth + 1))
                while self.peek() == ",":
                    self.take(",")
                    elems.append(self.parse(depth + 1))
            self.take(">")
            return SequenceType(tuple(elems), tok[:-1])
        if tok in ("int", "float", "bool"):
            return ScalarType(tok)
        if tok.startswith("!"):
            return ObjectType(tok[1:])
        raise ValueError(f"bad type text {self.text!r}: unexpected {tok!r}")

    def _tensor(self) -> TensorType:
        parts = self.take().split("x")
        dtype = DType.parse(parts[-1])
        shape = tuple(UNKNOWN_DIM if p == "?" else _dim(self.text, p) for p in parts[:-1])
        if any(d >= MAX_DIM for d in shape):
            # torch sizes are int64: a larger dimension would escape as TypeError/OverflowError later
            raise ValueError(f"bad type text {self.text!r}: a dimension must be below 2**62")
        scale: list[float] | None = None
        axis: int | None = None
        while self.peek() == ",":
            self.take(",")
            key = self.take()
            self.take("=")
            if key == "scale":
                self.take("[")
                scale = [float(self.take())]
                while self.peek() == ",":
                    self.take(",")
                    scale.append(float(self.take()))
                self.take("]")
            elif key == "axis":
                axis = int(self.take())
            else:
                raise ValueError(f"bad type text {self.text!r}: unknown tensor field {key!r}")
        self.take(">")
        quant = QuantSpec(tuple(scale), dtype, axis) if scale is not None else None
        return TensorType(shape, dtype, quant)


def _dim(text: str, part: str) -> int:
    if not (
        part.isascii() and part.isdigit()
    ):  # int() takes "-1", "+3", " 4", "1_0": one spelling per dimension keeps the round trip exact
        raise ValueError(f"bad type text {text!r}: dimension {part!r} is not a size (digits, or ? when unknown)")
    return int(part)


MAX_DIM = 2**62
"""Exclusive bound on one dimension in type text (torch sizes are int64)."""

MAX_TYPE_DEPTH = 64
"""How deeply ``tuple<...>`` / ``list<...>`` may nest in type text (the parser recurses)."""


def parse_type(text: str) -> Type:
    p = _TypeParser(text)
    t = p.parse()
    if p.peek() is not None:
        raise ValueError(f"bad type text {text!r}: trailing {p.peek()!r}")
    return t
