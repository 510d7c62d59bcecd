"""Normalisations other than batch norm: layer norm and group norm, with affine state
as trailing constant operands (``weight``, ``bias``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from qir.ir.meta_modules import load_tensors
from qir.ir.op import IRError, ModuleOp, Pure, ShapePreserving, Trait, register_op
from qir.ir.types import TensorType, Type


@attrs.frozen
class _AffineNorm(ModuleOp):
    """Operands ``(input[, weight][, bias])``; ``weight`` / ``bias`` say which are present."""

    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, ShapePreserving})
    arity: ClassVar[tuple[int, int | None]] = (1, 3)
    operand_names: ClassVar[tuple[str, ...]] = ("input", "weight", "bias")

    def param_roles(self) -> tuple[str, ...]:
        return tuple(r for r in ("weight", "bias") if getattr(self, r))

    def params(self, operands: Sequence[Any]) -> dict[str, Any]:
        return dict(zip(self.param_roles(), operands[1:], strict=False))

    def verify_(self, operand_types: Sequence[Type]) -> None:
        n = 1 + len(self.param_roles())
        if len(operand_types) != n:
            raise IRError(
                f"op {self.name!r}: expects {n} operands ({', '.join(('input', *self.param_roles()))}), "
                f"got {len(operand_types)}"
            )


@register_op
@attrs.frozen
class LayerNorm(_AffineNorm):
    """``nn.LayerNorm`` / ``F.layer_norm`` over the trailing ``normalized_shape`` dims."""

    name: ClassVar[str] = "layer_norm"
    module_types: ClassVar[tuple[type, ...]] = (nn.LayerNorm,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.layer_norm,)

    normalized_shape: tuple[int, ...] = attrs.field(converter=tuple)
    eps: float = 1e-5
    weight: bool = True
    bias: bool = True

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        p = self.params(operands)
        return F.layer_norm, (operands[0], self.normalized_shape, p.get("weight"), p.get("bias"), self.eps), {}

    def compute(self, *operands: Any) -> Any:
        fn, args, kwargs = self.torch_call(operands)
        return fn(*args, **kwargs)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        t = operand_types[0]
        k = len(self.normalized_shape)
        if isinstance(t, TensorType) and tuple(t.shape[t.rank - k :]) != self.normalized_shape:
            raise IRError(f"op 'layer_norm': input {t} does not end in normalized_shape {self.normalized_shape}")

    @classmethod
    def from_module(cls, m: Any) -> LayerNorm:
        return cls(normalized_shape=m.normalized_shape, eps=m.eps, weight=m.weight is not None, bias=m.bias is not None)

    def to_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        if self.weight != self.bias and not self.weight:
            raise IRError("op 'layer_norm': a bias without a weight has no nn.LayerNorm form")
        m = nn.LayerNorm(
            self.normalized_shape, eps=self.eps, elementwise_affine=self.weight, bias=self.bias, device="meta"
        )
        load_tensors(m, tensors)
        return m


@register_op
@attrs.frozen
class GroupNorm(_AffineNorm):
    """``nn.GroupNorm`` / ``F.group_norm``."""

    name: ClassVar[str] = "group_norm"
    module_types: ClassVar[tuple[type, ...]] = (nn.GroupNorm,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.group_norm,)

    num_groups: int
    eps: float = 1e-5
    weight: bool = True
    bias: bool = True

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        p = self.params(operands)
        return F.group_norm, (operands[0], self.num_groups, p.get("weight"), p.get("bias"), self.eps), {}

    def compute(self, *operands: Any) -> Any:
        fn, args, kwargs = self.torch_call(operands)
        return fn(*args, **kwargs)

    @classmethod
    def from_module(cls, m: Any) -> GroupNorm:
        return cls(num_groups=m.num_groups, eps=m.eps, weight=m.affine, bias=m.affine)

    def to_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        if self.weight != self.bias:
            raise IRError("op 'group_norm': nn.GroupNorm has both weight and bias or neither")
        w = tensors.get("weight")
        if w is None:
            raise IRError("op 'group_norm': without affine state the channel count is unknown; emit F.group_norm")
        m = nn.GroupNorm(self.num_groups, w.shape[0], eps=self.eps, affine=self.weight, device="meta")
        load_tensors(m, tensors)
        return m
