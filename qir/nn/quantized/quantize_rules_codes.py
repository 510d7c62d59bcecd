"""The ``quantize`` pass's code rules: float ops called on codes, converted as module swapping converts them.

``convert_fx`` by module swapping keeps the ops that are exact on codes as written (``relu``,
``max`` / ``min``, ``topk``, ``argmax``, zero / reflect / replicate pads, ...), rewrites the ones
whose constants must become codes (``clamp`` -> ``clamp_codes``, a constant pad's value,
``relu6`` / ``hardtanh(0, 6)`` -> ``relu6_codes``, ``abs`` -> ``abs_codes``, a comparison with a
number -> ``compare_codes``) and drops a float32
cast (an identity on the QAT model's fake-quantized values). Each rule here gives the pass the same
op, computing its constants with the functions swapping calls (:mod:`qir.quantization.code_ops`,
:mod:`qir.quantization.code_convert`), so both paths run one arithmetic
(tests/quantization/test_convert_paths.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from passes.quantize import OnCodes, register_code_rule
from qir.frontend.lookup import qualified_name
from qir.ir.op import Op, Ref
from qir.ir.ops.core import Call
from qir.ir.types import DType, QuantSpec, TensorType, Type
from qir.quantization.code_convert import (
    compare_bounds,
    number_comparison_error,
    pad_code,
    require_per_tensor,
    tensor_comparison_error,
)
from qir.quantization.code_ops import (
    COMPARISONS,
    abs_codes,
    clamp_codes,
    compare_codes,
    constant_code,
    flipped,
)
from qir.quantization.convert import nearest_interpolate_codes, relu6_bound, relu6_codes

__all__: list[str] = []


def _data(op: Op, types: Sequence[Type]) -> tuple[QuantSpec, DType]:
    """The spec and dtype of the op's data operand (operand 0), which must be codes."""
    t = types[0]
    if not isinstance(t, TensorType) or t.quant is None:
        raise ValueError(
            f"its data input is not quantized but another input is; put a QuantStub in front of the data, "
            f"or a DeQuantStub before the other input (op {op.name!r})"
        )
    return t.quant, t.dtype


def _codes(op: Op, types: Sequence[Type]) -> tuple[torch.Tensor, DType]:
    """The per-tensor scale and dtype of the op's data operand (operand 0), which must be codes."""
    spec, dtype = _data(op, types)
    s = torch.tensor(spec.scale, dtype=torch.float32)
    require_per_tensor(s, f"{op.name} on codes", "has a constant")
    return s.reshape(-1)[:1], dtype


def _call(fn: Callable[..., Any], *consts: Any) -> OnCodes:
    """``fn(<operand 0>, *consts)``: the integer form swapping calls, named as the front end names it."""
    name = qualified_name(fn)
    return OnCodes(Call(kind="function", target=name, args=(Ref(0), *consts)), {name: fn})


def _as_written(op: Op, types: Sequence[Type]) -> OnCodes:
    """Exact on codes as written: data movement, selections of codes, indices of codes."""
    _data(op, types)
    return OnCodes(op)


def _clamp(op: Any, types: Sequence[Type]) -> OnCodes:
    for bound in ("min", "max"):
        if isinstance(getattr(op, bound), Ref):
            raise ValueError(
                f"torch.clamp has a tensor {bound} bound; only numbers (or None) are supported on quantized "
                f"tensors: use torch.{'maximum' if bound == 'min' else 'minimum'}(x, bound), which prepare_qat_fx "
                "turns into a FloatFunctional with its own output scale"
            )
    s, dt = _codes(op, types)
    return _call(clamp_codes, *(None if v is None else constant_code(float(v), s, dt) for v in (op.min, op.max)))


def _pad(op: Any, types: Sequence[Type]) -> OnCodes:
    if op.mode != "constant" or op.value is None or float(op.value) == 0.0:
        return _as_written(op, types)  # data movement, or zeros: exact on codes as written
    s, dt = _codes(op, types)
    return OnCodes(attrs.evolve(op, value=float(pad_code(float(op.value), s, dt, "pad"))))


def _relu6(op: Any, types: Sequence[Type]) -> OnCodes:
    if op.name == "hardtanh" and (float(op.min_val) != 0.0 or float(op.max_val) != 6.0):
        raise ValueError("F.hardtanh on a quantized tensor: only hardtanh(0, 6) (relu6)")
    s, _ = _codes(op, types)
    return _call(relu6_codes, relu6_bound(s))


def _abs(op: Op, types: Sequence[Type]) -> OnCodes:
    _codes(op, types)
    return _call(abs_codes)


def _cast(op: Any, types: Sequence[Type]) -> OnCodes:
    if op.dtype != torch.float32:
        raise ValueError(
            f"Tensor.to({op.dtype}) of a quantized tensor has no integer form; put a DeQuantStub before it"
        )
    return OnCodes(None)  # an identity in QAT: the codes go on


def _interpolate(op: Any, types: Sequence[Type]) -> OnCodes:
    """A functional nearest resize left on codes (prepare gives other modes a generated module):
    ``nearest_interpolate_codes`` with the call's arguments, as swapping rewrites it."""
    _data(op, types)
    if op.mode != "nearest":
        raise ValueError(
            f"F.interpolate(mode={op.mode!r}) on a quantized tensor has no integer form here; use "
            "qir.nn.Interpolate so it gets a quantized module"
        )
    name = qualified_name(nearest_interpolate_codes)
    kwargs = {f: getattr(op, f) for f in ("size", "scale_factor", "mode", "align_corners", "recompute_scale_factor")}
    call = Call(kind="function", target=name, args=(Ref(0),), kwargs={**kwargs, "antialias": op.antialias})
    return OnCodes(call, {name: nearest_interpolate_codes})


register_code_rule("relu", _as_written)
for _name in ("max", "min", "topk", "argmax", "argmin", "gather"):
    register_code_rule(_name, _as_written)
register_code_rule("pad", _pad, modules=True)
register_code_rule("clamp", _clamp)
register_code_rule("relu6", _relu6)
register_code_rule("hardtanh", _relu6)
register_code_rule("abs", _abs)
register_code_rule("cast", _cast)
register_code_rule("interpolate", _interpolate)


def _compare(op: Any, types: Sequence[Type]) -> OnCodes:
    """``x <op> c`` with a number: a range test on codes (``compare_codes``); two tensors at one
    scale: the comparison as written (codes compare as their values do). The checks and the bounds
    are module swapping's (``code_convert``)."""
    if op.other is None:
        operands = []
        for name, t in zip(("input", "other"), types[:2], strict=False):
            spec = t.quant if isinstance(t, TensorType) else None
            scale = None if spec is None else torch.tensor(spec.scale, dtype=torch.float32)
            operands.append((name, scale, t.dtype if isinstance(t, TensorType) else None))
        why = tensor_comparison_error(operands)
        if why is not None:
            raise ValueError(f"{op.name}{':' if why.startswith('operand') else ''} {why}")
        return OnCodes(op)
    why = number_comparison_error(op.other)
    if why is not None:
        raise ValueError(f"{op.name} {why}")
    cmp = flipped(op.name) if op.reverse else op.name
    s, dt = _codes(op, types)
    return _call(compare_codes, cmp, op.other, *compare_bounds(cmp, op.other, s, dt))


for _name in COMPARISONS:
    register_code_rule(_name, _compare)
