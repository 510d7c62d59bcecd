"""Typing and checking ops whose operands have unknown dimensions (:data:`~qir.ir.types.UNKNOWN_DIM`, text ``?``).

Every op infers its result type from concrete shapes (most on meta tensors). With unknown
dimensions, :func:`infer_type` asks the op twice, the unknown dimensions taken as one size and
then as another (:data:`SIZES`), and merges the answers: a result dimension equal in both is
known (a conv's output channels, a global pool's 1x1), one that differs is unknown (the batch, a
conv's output height). The answers must agree on everything else (ranks, dtypes, scales, how many
results): what depends on an unknown size is refused with the node's name, never guessed.
:func:`verify_op` runs the op's checks at both sizes.

One case agrees at both sizes and is still not known: ``chunk(n)`` gives n pieces of a large
size but fewer of a small one (``chunk(4)`` of 5 gives 3); an op says so in
:meth:`~qir.ir.op.Op.unknown_dims_problem`, and it is refused.

The sizes are large and divisible by the small factors that views and strided layers use, so an
op a real size could satisfy is not refused for the sizes chosen: 840 = 2^3·3·5·7 and twice it.
Everything runs on meta tensors (nothing of that size is allocated).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import attrs

from qir.ir.op import CannotInfer, IRError, Op
from qir.ir.types import UNKNOWN_DIM, SequenceType, TensorType, Type, format_type, has_unknown_dims

__all__ = ["SIZES", "any_unknown_dims", "at_size", "infer_type", "merge_types", "stand_in_size", "verify_op"]

#: the two sizes an unknown dimension takes while an op is typed and checked
SIZES = (840, 1680)

_STAND_IN: contextvars.ContextVar[int | None] = contextvars.ContextVar("qir_unknown_dim_size", default=None)


def stand_in_size() -> int | None:
    """The size unknown dimensions stand at while an op is typed or checked here (None otherwise).

    A check that bounds what a run allocates (qinterpolate's output cap) cannot bound an unknown
    size: it reads a dimension of this size as unknown and bounds the output per unit of it."""
    return _STAND_IN.get()


@contextlib.contextmanager
def _standing_in(size: int) -> Iterator[None]:
    token = _STAND_IN.set(size)
    try:
        yield
    finally:
        _STAND_IN.reset(token)


def at_size(t: Type, size: int) -> Type:
    """``t`` with every unknown dimension (at any depth of a sequence) set to ``size``."""
    if isinstance(t, TensorType):
        if not t.has_unknown_dims:
            return t
        return attrs.evolve(t, shape=tuple(size if d == UNKNOWN_DIM else d for d in t.shape))
    if isinstance(t, SequenceType):
        return SequenceType(tuple(at_size(e, size) for e in t.elements), t.kind)
    return t


def merge_types(a: Type, b: Type) -> Type:
    """One type for the results at the two sizes: dimensions that differ become unknown; anything
    else that differs raises :class:`IRError` (the result's structure depends on an unknown size)."""
    if isinstance(a, TensorType) and isinstance(b, TensorType):
        if a.rank != b.rank or a.dtype is not b.dtype:
            raise IRError(
                f"its result ({format_type(a)} / {format_type(b)}) changes rank or dtype with the unknown sizes"
            )
        if a.quant != b.quant:
            raise IRError(f"its result's scales ({format_type(a)} / {format_type(b)}) depend on the unknown sizes")
        shape = tuple(x if x == y else UNKNOWN_DIM for x, y in zip(a.shape, b.shape, strict=True))
        return attrs.evolve(a, shape=shape)
    if isinstance(a, SequenceType) and isinstance(b, SequenceType):
        if a.kind != b.kind or len(a.elements) != len(b.elements):
            raise IRError(
                f"how many results it gives ({len(a.elements)} / {len(b.elements)}) depends on the unknown sizes"
            )
        return SequenceType(tuple(merge_types(x, y) for x, y in zip(a.elements, b.elements, strict=True)), a.kind)
    if a != b:
        raise IRError(f"its result ({format_type(a)} / {format_type(b)}) depends on the unknown sizes")
    return a


def any_unknown_dims(operand_types: Sequence[Type]) -> bool:
    """Whether any of the types has an unknown size (``?``)."""
    return any(has_unknown_dims(t) for t in operand_types)


def _problem(op: Op, operand_types: Sequence[Type]) -> None:
    why = op.unknown_dims_problem(operand_types)
    if why is not None:
        raise IRError(f"op {op.name!r}: {why}; {_FIX}")


_FIX = "type the graph from example inputs (the sizes it needs must be known)"


def infer_type(op: Op, operand_types: Sequence[Type], verified: bool = False) -> Type:
    """``op.infer_type`` for operands that may have unknown dimensions (see the module doc);
    ``verified``: :func:`verify_op` has accepted them (``op.infer_verified_type``, which need not check again).

    :class:`CannotInfer` passes through (the op cannot infer from types at all); any other
    failure at the chosen sizes is an :class:`IRError` saying the op needs a size it is not given."""
    infer = op.infer_verified_type if verified else op.infer_type
    if not any_unknown_dims(operand_types):
        return infer(operand_types)
    _problem(op, operand_types)
    results = []
    for size in SIZES:
        try:
            with _standing_in(size):
                results.append(infer([at_size(t, size) for t in operand_types]))
        except (CannotInfer, NotImplementedError):
            raise
        except Exception as e:
            raise IRError(
                f"op {op.name!r} cannot be typed with unknown dimensions "
                f"({', '.join(format_type(t) for t in operand_types)}): "
                f"{type(e).__name__}: {e} (at size {size}); {_FIX}"
            ) from None
    try:
        return merge_types(results[0], results[1])
    except IRError as e:
        raise IRError(f"op {op.name!r}: {e}; {_FIX}") from None


def verify_op(op: Op, operand_types: Sequence[Type]) -> None:
    """``op.verify`` for operands that may have unknown dimensions: the checks must pass at both sizes."""
    if not any_unknown_dims(operand_types):
        op.verify(operand_types)
        return
    _problem(op, operand_types)
    for size in SIZES:
        try:
            with _standing_in(size):
                op.verify([at_size(t, size) for t in operand_types])
        except IRError as e:
            raise IRError(f"{e} (its unknown dimensions taken as {size}); {_FIX}") from None
