"""Data movement: reshape, permute, concatenation, splitting, indexing by tensors, sizes.

All of these move or select elements without arithmetic, so quantized values keep their
scale through them (the ``Transparent`` trait) except where noted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from qir.ir.meta_shapes import cat_shape
from qir.ir.op import IRError, MovesCodes, Pure, ReadsShape, Ref, Trait, Transparent, register_op
from qir.ir.ops.torchop import TorchModuleOp, TorchOp, check_dim
from qir.ir.types import UNKNOWN_DIM, TensorType, Type

_MOVE = frozenset({Pure, Transparent})
#: one tensor's codes moved or copied: the ``quantize`` pass retypes the result with the input's spec
_LAYOUT = frozenset({Pure, Transparent, MovesCodes})
#: a number from a tensor's shape (``x.size(1)``): the same for codes
_QUERY = frozenset({Pure, ReadsShape})


def _is_shape(v: Any) -> bool:
    return isinstance(v, Ref) or (isinstance(v, tuple) and all(isinstance(d, (int, Ref)) for d in v))


def _check_shape(op: Any, field: str) -> None:
    if not _is_shape(getattr(op, field)):
        raise IRError(f"op {op.name!r}: {field} must be a tuple of ints (or Refs), got {getattr(op, field)!r}")


def _rank(t: Type) -> int | None:
    return t.rank if isinstance(t, TensorType) else None


@attrs.frozen
class _DimOp(TorchOp):
    """Ops with one ``dim`` attribute, checked against the input rank."""

    def verify_(self, operand_types: Sequence[Type]) -> None:
        r = _rank(operand_types[0])
        if r is not None:
            check_dim(self, getattr(self, "dim", None), r)


@register_op
@attrs.frozen
class Reshape(TorchOp):
    """``torch.reshape``, ``Tensor.reshape`` and ``Tensor.view`` (emitted as reshape)."""

    name: ClassVar[str] = "reshape"
    traits: ClassVar[frozenset[type[Trait]]] = _LAYOUT
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.reshape,)
    methods: ClassVar[tuple[str, ...]] = ("reshape", "view")
    signature: ClassVar[tuple[str, ...]] = ("input", "shape")
    method_varargs: ClassVar[str | None] = "shape"
    positional: ClassVar[tuple[str, ...]] = ("shape",)

    shape: Any = ()

    def __attrs_post_init__(self) -> None:
        _check_shape(self, "shape")


@register_op
@attrs.frozen
class Flatten(TorchModuleOp):
    """``torch.flatten``, ``Tensor.flatten``, ``nn.Flatten``."""

    name: ClassVar[str] = "flatten"
    traits: ClassVar[frozenset[type[Trait]]] = _LAYOUT
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    module_types: ClassVar[tuple[type, ...]] = (nn.Flatten,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.flatten,)
    methods: ClassVar[tuple[str, ...]] = ("flatten",)
    signature: ClassVar[tuple[str, ...]] = ("input", "start_dim", "end_dim")
    module_fields: ClassVar[tuple[str, ...]] = ("start_dim", "end_dim")

    start_dim: int = 0
    end_dim: int = -1


@register_op
@attrs.frozen
class Permute(TorchOp):
    """``torch.permute``, ``Tensor.permute``."""

    name: ClassVar[str] = "permute"
    traits: ClassVar[frozenset[type[Trait]]] = _LAYOUT
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.permute,)
    methods: ClassVar[tuple[str, ...]] = ("permute",)
    signature: ClassVar[tuple[str, ...]] = ("input", "dims")
    method_varargs: ClassVar[str | None] = "dims"
    positional: ClassVar[tuple[str, ...]] = ("dims",)

    dims: tuple[int, ...] = ()

    def verify_(self, operand_types: Sequence[Type]) -> None:
        r = _rank(operand_types[0])
        if r is not None and sorted(d % max(r, 1) for d in self.dims) != list(range(r)):
            raise IRError(f"op 'permute': dims {self.dims} is not a permutation of rank {r}")


@register_op
@attrs.frozen
class Transpose(TorchOp):
    """``torch.transpose``, ``Tensor.transpose``, ``torch.swapaxes``."""

    name: ClassVar[str] = "transpose"
    traits: ClassVar[frozenset[type[Trait]]] = _LAYOUT
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.transpose, torch.swapaxes, torch.swapdims)
    methods: ClassVar[tuple[str, ...]] = ("transpose", "swapaxes", "swapdims")
    signature: ClassVar[tuple[str, ...]] = ("input", "dim0", "dim1")
    positional: ClassVar[tuple[str, ...]] = ("dim0", "dim1")

    dim0: int = 0
    dim1: int = 1


@register_op
@attrs.frozen
class Contiguous(TorchOp):
    """``Tensor.contiguous``: same values, dense layout."""

    name: ClassVar[str] = "contiguous"
    traits: ClassVar[frozenset[type[Trait]]] = _LAYOUT
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.Tensor.contiguous,)
    methods: ClassVar[tuple[str, ...]] = ("contiguous",)


@register_op
@attrs.frozen
class Squeeze(TorchOp):
    """``torch.squeeze``, ``Tensor.squeeze`` (all size-1 dims when ``dim`` is None)."""

    name: ClassVar[str] = "squeeze"
    traits: ClassVar[frozenset[type[Trait]]] = _LAYOUT
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.squeeze,)
    methods: ClassVar[tuple[str, ...]] = ("squeeze",)
    signature: ClassVar[tuple[str, ...]] = ("input", "dim")
    positional: ClassVar[tuple[str, ...]] = ("dim",)
    omit_none: ClassVar[tuple[str, ...]] = ("dim",)

    dim: Any = None


@register_op
@attrs.frozen
class Unsqueeze(_DimOp):
    """``torch.unsqueeze``, ``Tensor.unsqueeze``."""

    name: ClassVar[str] = "unsqueeze"
    traits: ClassVar[frozenset[type[Trait]]] = _LAYOUT
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.unsqueeze,)
    methods: ClassVar[tuple[str, ...]] = ("unsqueeze",)
    signature: ClassVar[tuple[str, ...]] = ("input", "dim")
    positional: ClassVar[tuple[str, ...]] = ("dim",)

    dim: int = 0

    def verify_(self, operand_types: Sequence[Type]) -> None:
        r = _rank(operand_types[0])
        if r is not None:
            check_dim(self, self.dim, r + 1)


@register_op
@attrs.frozen
class Expand(TorchOp):
    """``Tensor.expand`` (broadcast view; -1 keeps a dimension)."""

    name: ClassVar[str] = "expand"
    traits: ClassVar[frozenset[type[Trait]]] = _LAYOUT
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.Tensor.expand,)
    methods: ClassVar[tuple[str, ...]] = ("expand",)
    signature: ClassVar[tuple[str, ...]] = ("input", "size")
    method_varargs: ClassVar[str | None] = "size"
    positional: ClassVar[tuple[str, ...]] = ("size",)

    size: Any = ()

    def __attrs_post_init__(self) -> None:
        _check_shape(self, "size")


@register_op
@attrs.frozen
class ExpandAs(TorchOp):
    """``Tensor.expand_as(other)``."""

    name: ClassVar[str] = "expand_as"
    traits: ClassVar[frozenset[type[Trait]]] = _MOVE
    arity: ClassVar[tuple[int, int | None]] = (2, 2)
    operand_names: ClassVar[tuple[str, ...]] = ("input", "other")
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.Tensor.expand_as,)
    methods: ClassVar[tuple[str, ...]] = ("expand_as",)
    signature: ClassVar[tuple[str, ...]] = ("input", "other")
    inputs: ClassVar[tuple[str, ...]] = ("input", "other")


@register_op
@attrs.frozen
class Repeat(TorchOp):
    """``Tensor.repeat`` (tile the tensor ``repeats`` times along each dim)."""

    name: ClassVar[str] = "repeat"
    traits: ClassVar[frozenset[type[Trait]]] = _LAYOUT
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.Tensor.repeat,)
    methods: ClassVar[tuple[str, ...]] = ("repeat",)
    signature: ClassVar[tuple[str, ...]] = ("input", "repeats")
    method_varargs: ClassVar[str | None] = "repeats"
    positional: ClassVar[tuple[str, ...]] = ("repeats",)

    repeats: Any = ()

    def __attrs_post_init__(self) -> None:
        _check_shape(self, "repeats")


@register_op
@attrs.frozen
class Tile(TorchOp):
    """``torch.tile``, ``Tensor.tile``."""

    name: ClassVar[str] = "tile"
    traits: ClassVar[frozenset[type[Trait]]] = _MOVE
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.tile,)
    methods: ClassVar[tuple[str, ...]] = ("tile",)
    signature: ClassVar[tuple[str, ...]] = ("input", "dims")
    method_varargs: ClassVar[str | None] = "dims"
    positional: ClassVar[tuple[str, ...]] = ("dims",)

    dims: Any = ()

    def __attrs_post_init__(self) -> None:
        _check_shape(self, "dims")


@register_op
@attrs.frozen
class Cat(TorchOp):
    """``torch.cat`` / ``concat`` / ``concatenate``, ``FloatFunctional.cat``: operands are the tensors."""

    name: ClassVar[str] = "cat"
    traits: ClassVar[frozenset[type[Trait]]] = _MOVE
    operand_names: ClassVar[tuple[str, ...]] = ()
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.cat, torch.concat, torch.concatenate)
    signature: ClassVar[tuple[str, ...]] = ("tensors", "dim")
    inputs: ClassVar[tuple[str, ...]] = ("tensors",)
    list_input: ClassVar[bool] = True

    dim: int = 0

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        # torch's meta kernel for cat runs a Python decomposition; float tensors of one dtype take the formula
        ts = [t for t in operand_types if isinstance(t, TensorType) and t.quant is None]
        if isinstance(self.dim, int) and ts and len(ts) == len(operand_types) and len({t.dtype for t in ts}) == 1:
            shape = cat_shape([t.shape for t in ts], self.dim) if ts[0].dtype.is_float else None
            if shape is not None:
                return TensorType(shape, ts[0].dtype)
        return super().infer_type(operand_types)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        ranks = {t.rank for t in operand_types if isinstance(t, TensorType)}
        if len(ranks) > 1:
            raise IRError(f"op 'cat': operands have different ranks {sorted(ranks)}")
        if ranks:
            check_dim(self, self.dim, ranks.pop())


@register_op
@attrs.frozen
class Stack(TorchOp):
    """``torch.stack``: operands are the tensors, stacked along a new ``dim``."""

    name: ClassVar[str] = "stack"
    traits: ClassVar[frozenset[type[Trait]]] = _MOVE
    operand_names: ClassVar[tuple[str, ...]] = ()
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.stack,)
    signature: ClassVar[tuple[str, ...]] = ("tensors", "dim")
    inputs: ClassVar[tuple[str, ...]] = ("tensors",)
    list_input: ClassVar[bool] = True

    dim: int = 0


@register_op
@attrs.frozen
class Split(TorchOp):
    """``torch.split`` / ``Tensor.split``: a tuple of slices along ``dim``."""

    name: ClassVar[str] = "split"
    traits: ClassVar[frozenset[type[Trait]]] = _LAYOUT
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.split,)
    methods: ClassVar[tuple[str, ...]] = ("split",)
    signature: ClassVar[tuple[str, ...]] = ("tensor", "split_size_or_sections", "dim")
    inputs: ClassVar[tuple[str, ...]] = ("tensor",)
    positional: ClassVar[tuple[str, ...]] = ("split_size_or_sections",)

    split_size_or_sections: Any = 1
    dim: int = 0


@register_op
@attrs.frozen
class Chunk(_DimOp):
    """``torch.chunk`` / ``Tensor.chunk``."""

    name: ClassVar[str] = "chunk"
    traits: ClassVar[frozenset[type[Trait]]] = _LAYOUT
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.chunk,)
    methods: ClassVar[tuple[str, ...]] = ("chunk",)
    signature: ClassVar[tuple[str, ...]] = ("input", "chunks", "dim")
    positional: ClassVar[tuple[str, ...]] = ("chunks",)

    chunks: int = 1
    dim: int = 0

    def unknown_dims_problem(self, operand_types: Sequence[Type]) -> str | None:
        x = operand_types[0] if operand_types else None
        if not isinstance(x, TensorType) or not isinstance(self.dim, int) or not -x.rank <= self.dim < max(x.rank, 1):
            return None  # the checks at a known size report these
        if x.rank and x.shape[self.dim] == UNKNOWN_DIM:
            return (
                f"chunk({self.chunks}) along dim {self.dim} of unknown size: torch returns fewer than "
                f"{self.chunks} pieces when the size is small for it (chunk(4) of 5 gives 3), "
                "so the piece count is not known"
            )
        return None


@register_op
@attrs.frozen
class Unbind(_DimOp):
    """``torch.unbind`` / ``Tensor.unbind``."""

    name: ClassVar[str] = "unbind"
    traits: ClassVar[frozenset[type[Trait]]] = _LAYOUT
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.unbind,)
    methods: ClassVar[tuple[str, ...]] = ("unbind",)
    signature: ClassVar[tuple[str, ...]] = ("input", "dim")

    dim: int = 0


@register_op
@attrs.frozen
class Roll(TorchOp):
    """``torch.roll`` / ``Tensor.roll`` (cyclic shift)."""

    name: ClassVar[str] = "roll"
    traits: ClassVar[frozenset[type[Trait]]] = _LAYOUT
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.roll,)
    methods: ClassVar[tuple[str, ...]] = ("roll",)
    signature: ClassVar[tuple[str, ...]] = ("input", "shifts", "dims")
    positional: ClassVar[tuple[str, ...]] = ("shifts", "dims")
    omit_none: ClassVar[tuple[str, ...]] = ("dims",)

    shifts: Any = 0
    dims: Any = None


@register_op
@attrs.frozen
class Flip(TorchOp):
    """``torch.flip`` / ``Tensor.flip``."""

    name: ClassVar[str] = "flip"
    traits: ClassVar[frozenset[type[Trait]]] = _LAYOUT
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.flip,)
    methods: ClassVar[tuple[str, ...]] = ("flip",)
    signature: ClassVar[tuple[str, ...]] = ("input", "dims")
    method_varargs: ClassVar[str | None] = "dims"
    positional: ClassVar[tuple[str, ...]] = ("dims",)

    dims: Any = ()


@register_op
@attrs.frozen
class Size(TorchOp):
    """``Tensor.size(dim=None)``: an int, or the whole size as a sequence of ints."""

    name: ClassVar[str] = "size"
    traits: ClassVar[frozenset[type[Trait]]] = _QUERY
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.Tensor.size,)
    methods: ClassVar[tuple[str, ...]] = ("size",)
    signature: ClassVar[tuple[str, ...]] = ("input", "dim")
    positional: ClassVar[tuple[str, ...]] = ("dim",)
    omit_none: ClassVar[tuple[str, ...]] = ("dim",)

    dim: int | None = None


@register_op
@attrs.frozen
class Dim(TorchOp):
    """``Tensor.dim()`` / ``Tensor.ndimension()``: the rank as an int."""

    name: ClassVar[str] = "dim"
    traits: ClassVar[frozenset[type[Trait]]] = _QUERY
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.Tensor.dim,)
    methods: ClassVar[tuple[str, ...]] = ("dim", "ndimension")


@register_op
@attrs.frozen
class Numel(TorchOp):
    """``torch.numel`` / ``Tensor.numel()``."""

    name: ClassVar[str] = "numel"
    traits: ClassVar[frozenset[type[Trait]]] = _QUERY
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.numel,)
    methods: ClassVar[tuple[str, ...]] = ("numel",)


@register_op
@attrs.frozen
class Len(TorchOp):
    """``len(x)``: the size of a tensor's first dimension as an int (qir's tracer records it)."""

    name: ClassVar[str] = "len"
    traits: ClassVar[frozenset[type[Trait]]] = _QUERY
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (len,)


@register_op
@attrs.frozen
class Gather(TorchOp):
    """``torch.gather(input, dim, index)``; ``index`` is a Ref to a tensor operand."""

    name: ClassVar[str] = "gather"
    traits: ClassVar[frozenset[type[Trait]]] = _MOVE
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.gather,)
    methods: ClassVar[tuple[str, ...]] = ("gather",)
    signature: ClassVar[tuple[str, ...]] = ("input", "dim", "index")
    positional: ClassVar[tuple[str, ...]] = ("dim", "index")

    dim: int = 0
    index: Any = None


@register_op
@attrs.frozen
class IndexSelect(TorchOp):
    """``torch.index_select(input, dim, index)``; ``index`` is a Ref to a tensor operand."""

    name: ClassVar[str] = "index_select"
    traits: ClassVar[frozenset[type[Trait]]] = _MOVE
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.index_select,)
    methods: ClassVar[tuple[str, ...]] = ("index_select",)
    signature: ClassVar[tuple[str, ...]] = ("input", "dim", "index")
    positional: ClassVar[tuple[str, ...]] = ("dim", "index")

    dim: int = 0
    index: Any = None


@attrs.frozen
class _Shuffle(TorchModuleOp):
    traits: ClassVar[frozenset[type[Trait]]] = _MOVE
    arity: ClassVar[tuple[int, int | None]] = (1, 1)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        t = operand_types[0]
        if isinstance(t, TensorType) and t.rank < 3:
            raise IRError(f"op {self.name!r}: needs an input of rank >= 3, got {t}")


@register_op
@attrs.frozen
class PixelShuffle(_Shuffle):
    """``nn.PixelShuffle``, ``F.pixel_shuffle``."""

    name: ClassVar[str] = "pixel_shuffle"
    module_types: ClassVar[tuple[type, ...]] = (nn.PixelShuffle,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.pixel_shuffle, torch.pixel_shuffle)
    signature: ClassVar[tuple[str, ...]] = ("input", "upscale_factor")
    module_fields: ClassVar[tuple[str, ...]] = ("upscale_factor",)

    upscale_factor: int = 1


@register_op
@attrs.frozen
class PixelUnshuffle(_Shuffle):
    """``nn.PixelUnshuffle``, ``F.pixel_unshuffle``."""

    name: ClassVar[str] = "pixel_unshuffle"
    module_types: ClassVar[tuple[type, ...]] = (nn.PixelUnshuffle,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.pixel_unshuffle, torch.pixel_unshuffle)
    signature: ClassVar[tuple[str, ...]] = ("input", "downscale_factor")
    module_fields: ClassVar[tuple[str, ...]] = ("downscale_factor",)

    downscale_factor: int = 1


@register_op
@attrs.frozen
class ChannelShuffle(_Shuffle):
    """``nn.ChannelShuffle``, ``F.channel_shuffle``."""

    name: ClassVar[str] = "channel_shuffle"
    module_types: ClassVar[tuple[type, ...]] = (nn.ChannelShuffle,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.channel_shuffle, torch.channel_shuffle)
    signature: ClassVar[tuple[str, ...]] = ("input", "groups")
    module_fields: ClassVar[tuple[str, ...]] = ("groups",)
    positional: ClassVar[tuple[str, ...]] = ("groups",)

    groups: int = 1
