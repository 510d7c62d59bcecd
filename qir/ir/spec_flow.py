"""How a :class:`~qir.ir.types.QuantSpec` flows through ops that only move codes.

A reshape, permute, squeeze, flatten, split or slice of integer codes holds the same codes
at the same scale, so its result type keeps the operand's spec (``tensor<2x16xqi8,
scale=[0.0056]>``, not a bare ``tensor<2x16xi8>`` whose scale a reader must find upstream).
Type inference runs such ops on meta tensors, which know torch dtypes only (``int8``);
:func:`carry_spec` puts the spec back on the results, and :func:`adopt_specs` gives a type
taken from an example run (the front end's) the specs inference found.

Only a per-tensor spec flows: a per-channel one is tied to an axis the op may move or
merge. Operands with different specs (a ``cat`` of codes at two scales) give no spec.
"""

from __future__ import annotations

from collections.abc import Sequence

from qir.ir.types import QuantSpec, SequenceType, TensorType, Type

__all__ = ["adopt_specs", "as_codes", "carry_spec", "operand_spec"]


def operand_spec(operand_types: Sequence[Type]) -> QuantSpec | None:
    """The one per-tensor spec the quantized tensor operands share, or None."""
    specs = {t.quant for t in operand_types if isinstance(t, TensorType) and t.dtype.is_quantized}
    if len(specs) != 1:
        return None
    spec = specs.pop()
    return spec if spec is not None and spec.axis is None else None


def as_codes(t: Type, spec: QuantSpec, *, floats: bool = False) -> Type:
    """``t`` with ``spec`` on each of its tensors (element by element in tuples and lists) that holds
    codes at it: a tensor of ``spec``'s storage dtype with no spec. With ``floats``, each float tensor
    and each tensor of codes at another spec instead: the values the ``quantize`` pass turns into
    codes (a layout op's result, retyped as its input's)."""
    if isinstance(t, TensorType):
        if floats:
            take = t.dtype.is_float or t.quant is not None
        else:
            take = t.quant is None and t.dtype.to_torch() == spec.dtype.to_torch()
        return TensorType(t.shape, spec.dtype, spec) if take else t
    if isinstance(t, SequenceType):
        return SequenceType(tuple(as_codes(e, spec, floats=floats) for e in t.elements), t.kind)
    return t


def carry_spec(operand_types: Sequence[Type], result: Type) -> Type:
    """``result`` with the operands' shared per-tensor spec on each tensor of the spec's storage
    dtype (a data-movement op's result: its elements are operand codes)."""
    spec = operand_spec(operand_types)
    return result if spec is None else as_codes(result, spec)


def adopt_specs(declared: Type, inferred: Type) -> Type:
    """``declared`` with the spec of ``inferred`` wherever the two are tensors of one shape and
    storage dtype and only ``inferred`` has a spec (element by element in tuples and lists)."""
    if isinstance(declared, TensorType) and isinstance(inferred, TensorType):
        same = declared.shape == inferred.shape and declared.dtype.to_torch() == inferred.dtype.to_torch()
        return inferred if same and declared.quant is None and inferred.quant is not None else declared
    if (
        isinstance(declared, SequenceType)
        and isinstance(inferred, SequenceType)
        and len(declared.elements) == len(inferred.elements)
    ):
        elements = tuple(adopt_specs(d, i) for d, i in zip(declared.elements, inferred.elements, strict=True))
        return SequenceType(elements, declared.kind)
    return declared
