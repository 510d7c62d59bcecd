"""Shared pieces of the integer layer ops that take and give code tensors.

* :func:`code_dtype`: the quantized dtype a value's codes are (an ``i8`` tensor from an opaque
  producer holds ``qi8`` codes);
* :class:`SameScaleOp`: layers whose output keeps the input's scale and dtype (ReLU, max pool,
  nearest resize, identity). The module records no dtype ("same as the input"), so the op's
  ``out`` takes its dtype from the input when the front end binds the call (``bind_call``) and
  ``verify`` checks that the two agree;
* :func:`register_float_class` / :func:`float_class`: module classes the operator tables list
  integer layers under that no IR op stands for and that ``qir.ir`` cannot import
  (``qir.nn.Div``, ``qir.nn.Exp``): the layer defining them registers them by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from qir.ir.graph import Value
from qir.ir.op import IRError
from qir.ir.ops.integer import IntegerModuleOp
from qir.ir.types import DType, QuantSpec, TensorType, Type

__all__ = [
    "MARCHES",
    "SameScaleOp",
    "check_int",
    "check_march",
    "check_scales",
    "check_window",
    "code_dtype",
    "float_class",
    "float_shaped",
    "input_values",
    "per_tensor_scale",
    "register_float_class",
    "same_scale_spec",
    "shaped_like",
]

_F32_MAX = float(torch.finfo(torch.float32).max)
_CODES = {DType.int8: DType.qint8, DType.int16: DType.qint16, DType.int32: DType.qint32}


def code_dtype(op: str, t: Type) -> DType:
    """The quantized dtype of the codes ``t`` holds; raises naming ``op`` for a float or non-tensor value."""
    if not isinstance(t, TensorType):
        raise IRError(f"op {op!r} takes a tensor of integer codes, got {t}")
    if t.dtype.is_quantized:
        return t.dtype
    if t.dtype in _CODES:
        return _CODES[t.dtype]
    raise IRError(f"op {op!r} takes integer codes (qint8 / qint16 / qint32), got {t}; quantize the input first")


def check_scales(op: str, what: str, scales: Sequence[float]) -> None:
    """Scales are float32 buffers in the modules: each must be positive and finite as a float32."""
    for v in scales:
        if not 0.0 < v < _F32_MAX or float(torch.tensor(v, dtype=torch.float32)) == 0.0:
            raise IRError(f"op {op!r}: {what} must be positive and finite float32 values, got {v!r}")


def check_int(op: str, name: str, v: Any, lo: int, hi: int) -> None:
    """An integer attribute in ``[lo, hi]`` (the datapath's range for it)."""
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise IRError(f"op {op!r}: {name} must be an integer in [{lo}, {hi}], got {v!r}")


MARCHES = ("bayes", "bernoulli2")


def check_march(op: str, march: Any) -> None:
    if march not in MARCHES:
        raise IRError(f"op {op!r}: march must be one of {MARCHES}, got {march!r}")


def check_window(op: str, kernel: Any, stride: Any, padding: Any, dilation: Any = 1) -> None:
    """A 2-D pooling window torch accepts: positive kernel / stride / dilation, padding at most
    half the effective kernel."""

    def pair(v: Any, what: str) -> tuple[int, int]:
        t = (v, v) if isinstance(v, int) else tuple(v)
        if len(t) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in t):
            raise IRError(f"op {op!r}: {what} must be an int or a pair of ints, got {v!r}")
        return t[0], t[1]

    k, d, p = pair(kernel, "kernel_size"), pair(dilation, "dilation"), pair(padding, "padding")
    s = pair(kernel if stride is None else stride, "stride")
    if min(*k, *s, *d) < 1 or min(p) < 0:
        raise IRError(f"op {op!r}: kernel_size, stride and dilation must be >= 1 and padding >= 0")
    for kk, dd, pp in zip(k, d, p, strict=True):
        if pp > (dd * (kk - 1) + 1) // 2:
            raise IRError(f"op {op!r}: padding {p} exceeds half the window ({k}, dilation {d})")


def shaped_like(op: str, t: Type, out: QuantSpec | None) -> TensorType:
    """``t``'s shape with ``out``'s dtype and spec (float32 when ``out`` is None): the result type
    of a layer that keeps its input's shape, so the verifier checks the declared one."""
    if not isinstance(t, TensorType):
        raise IRError(f"op {op!r} takes a tensor, got {t}")
    return TensorType(t.shape, DType.float32) if out is None else TensorType(t.shape, out.dtype, out)


def float_shaped(op: Any, operand_types: Sequence[Type], out: QuantSpec) -> TensorType:
    """The result type of a layer whose shape rule is its float op's (a pool window, a resize):
    that op's shape on a float32 input of ``operand_types[0]``'s shape, at ``out``."""
    x = operand_types[0]
    if not isinstance(x, TensorType):
        raise IRError(f"op {op.name!r} takes a tensor, got {x}")
    try:
        t = op.float_op().infer_type([TensorType(x.shape, DType.float32)])
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        raise IRError(f"op {op.name!r} rejects its input {x}: {e}") from None
    if not isinstance(t, TensorType):
        raise IRError(f"op {op.name!r}: its float op gives {t}, not a tensor")
    return TensorType(t.shape, out.dtype, out)


def per_tensor_scale(m: Any, buffer: str) -> float:
    """A module's per-tensor scale buffer as a float (NotImplementedError for a per-channel one:
    the front end then keeps the module an opaque call)."""
    s = getattr(m, buffer)
    if s.numel() != 1:
        raise NotImplementedError(f"{type(m).__name__}.{buffer} is per channel ({s.numel()} scales)")
    return float(s.reshape(-1)[0])


def same_scale_spec(m: Any) -> QuantSpec:
    """A scale-keeping module's ``out``: its scale (equal to its input scale), dtype bound later."""
    s_in, s_out = per_tensor_scale(m, "input_scale_0"), per_tensor_scale(m, "scale")
    if s_in != s_out:
        raise NotImplementedError(f"{type(m).__name__}: output scale {s_out} differs from its input scale {s_in}")
    return QuantSpec((s_out,), DType.qint8)


def input_values(op: str, n: int, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Value]:
    """The ``n`` positional tensor arguments of a module call (no keywords)."""
    if kwargs or len(args) != n or not all(isinstance(a, Value) for a in args):
        raise IRError(
            f"op {op!r} binds calls with {n} positional tensor argument(s), got {len(args)} and {sorted(kwargs)}"
        )
    return list(args)


@attrs.frozen
class SameScaleOp(IntegerModuleOp):
    """An integer layer whose output has its input's scale and dtype (``out`` states both)."""

    out: QuantSpec

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[SameScaleOp, list[Value]]:
        """The call's inputs, and this op with ``out``'s dtype set to the input codes' dtype."""
        inputs = input_values(self.name, self.num_inputs(), args, kwargs)
        dtype = code_dtype(self.name, inputs[0].type)
        return attrs.evolve(self, out=attrs.evolve(self.out, dtype=dtype)), inputs

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        """The input's shape at ``out`` (pools that change the shape override this)."""
        return shaped_like(self.name, operand_types[0], self.out)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "out scales", self.out.scale)
        if self.out.axis is not None:
            raise IRError(f"op {self.name!r}: out must be one per-tensor scale, got axis {self.out.axis}")
        dtype = code_dtype(self.name, operand_types[0])
        if dtype is not self.out.dtype:
            raise IRError(
                f"op {self.name!r} keeps its input's dtype: out is {self.out.dtype.name} but the input holds "
                f"{dtype.name} codes ({operand_types[0]})"
            )


#: name -> module class the tables list an integer layer under (filled by the module library)
_FLOAT_CLASSES: dict[str, type] = {}


def register_float_class(name: str, cls: type) -> None:
    """Check integer layers whose float form is ``name`` (``"Div"``, ``"Exp"``) as ``cls``'s table rows."""
    _FLOAT_CLASSES[name] = cls


def float_class(name: str) -> type | None:
    return _FLOAT_CLASSES.get(name)
