"""Composite modules kept as one op: multi-head attention and the LSTM cell.

Their weights are trailing constant operands (state-dict names as roles, e.g.
``out_proj.weight``); the reference semantics rebuilds the torch module around those
tensors, so the op computes exactly what the module computes (including its fast paths).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from qir.ir.graph import Value
from qir.ir.op import IRError, ModuleOp, Pure, Trait, register_op
from qir.ir.ops.core import EvalContext
from qir.ir.types import ObjectType, SequenceType, TensorType, Type


def load_dotted(m: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Install tensors at dotted paths (``out_proj.weight``) as parameters or buffers, sharing storage."""
    for role, t in tensors.items():
        *path, leaf = role.split(".")
        owner = m.get_submodule(".".join(path)) if path else m
        if leaf in owner._parameters:
            p = t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=t.is_floating_point())
            owner._parameters[leaf] = p
        else:
            owner._buffers[leaf] = t


FORWARD_ARGS = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)


def bind_forward_args(where: str, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``nn.MultiheadAttention.forward``'s arguments by name (float and integer attention ops);
    ``where`` starts the error message."""
    if len(args) > len(FORWARD_ARGS) or set(kwargs) - set(FORWARD_ARGS):
        raise IRError(f"{where}: unexpected arguments {sorted(set(kwargs) - set(FORWARD_ARGS))}")
    return dict(zip(FORWARD_ARGS, args, strict=False)) | kwargs


def split_masks(op: Any, inputs: Sequence[Any]) -> tuple[Any, Any, Any, Any, Any]:
    """``(query, key, value, key_padding_mask, attn_mask)`` from an attention op's data operands;
    a mask the op does not take is None."""
    q, k, v, *masks = inputs
    kpm = masks.pop(0) if op.key_padding_mask else None
    mask = masks.pop(0) if op.attn_mask else None
    return q, k, v, kpm, mask


def bind_quantized_attention(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, list[Value]]:
    """Bind a QAT or integer attention op's ``forward(query, key, value, key_padding_mask,
    need_weights, attn_mask, average_attn_weights, is_causal)``: masks must be graph values and the
    flags constant booleans; ``is_causal`` is refused (pass the causal mask as ``attn_mask``)."""
    bound = bind_forward_args(f"op {op.name!r}", args, kwargs)
    if bound.get("is_causal"):
        raise IRError(f"{op.name}: is_causal is not implemented; pass the causal mask as attn_mask")
    inputs = [bound.get("query"), bound.get("key"), bound.get("value")]
    if not all(isinstance(v, Value) for v in inputs):
        raise IRError(f"{op.name}: query, key and value must be graph values")
    kpm, mask = bound.get("key_padding_mask"), bound.get("attn_mask")
    for v in (kpm, mask):
        if v is not None and not isinstance(v, Value):
            raise IRError(f"{op.name}: masks must be graph values, got {type(v).__name__}")
    flags = (bound.get("need_weights", True), bound.get("average_attn_weights", True))
    if not all(isinstance(f, bool) for f in flags):
        raise IRError(f"{op.name}: need_weights and average_attn_weights must be constant booleans")
    bound_op = attrs.evolve(
        op,
        need_weights=flags[0],
        average_attn_weights=flags[1],
        key_padding_mask=kpm is not None,
        attn_mask=mask is not None,
    )
    return bound_op, [*inputs, *(v for v in (kpm, mask) if v is not None)]


def quantized_attention_call(op: Any, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments of a QAT or integer attention module's call for its data operands (query, key,
    value, masks)."""
    q, k, v, kpm, mask = split_masks(op, inputs)
    return (q, k, v), {
        "key_padding_mask": kpm,
        "need_weights": op.need_weights,
        "attn_mask": mask,
        "average_attn_weights": op.average_attn_weights,
    }


@register_op
@attrs.frozen
class MultiheadAttention(ModuleOp):
    """``nn.MultiheadAttention`` with packed q/k/v projections.

    Operands: ``(query, key, value[, key_padding_mask][, attn_mask], in_proj_weight
    [, in_proj_bias], out_proj.weight[, out_proj.bias])``. The result is ``(output, weights)``
    with ``weights`` None unless ``need_weights``.
    """

    name: ClassVar[str] = "multihead_attention"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure})
    operand_names: ClassVar[tuple[str, ...]] = ("query", "key", "value")
    module_types: ClassVar[tuple[type, ...]] = (nn.MultiheadAttention,)

    embed_dim: int
    num_heads: int
    dropout: float = 0.0
    bias: bool = True
    batch_first: bool = False
    need_weights: bool = True
    average_attn_weights: bool = True
    is_causal: bool = False
    key_padding_mask: bool = False
    attn_mask: bool = False

    def num_inputs(self) -> int:
        return 3 + int(self.key_padding_mask) + int(self.attn_mask)

    def param_roles(self) -> tuple[str, ...]:
        if self.bias:
            return ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
        return ("in_proj_weight", "out_proj.weight")

    @classmethod
    def from_module(cls, m: Any) -> MultiheadAttention:
        if not m._qkv_same_embed_dim or m.bias_k is not None or m.add_zero_attn:
            raise NotImplementedError(
                "nn.MultiheadAttention with separate kdim/vdim, add_bias_kv or add_zero_attn is kept as an opaque call"
            )
        return cls(
            embed_dim=m.embed_dim,
            num_heads=m.num_heads,
            dropout=m.dropout,
            bias=m.in_proj_bias is not None,
            batch_first=m.batch_first,
        )

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[MultiheadAttention, list[Value]]:
        """Bind ``forward(query, key, value, key_padding_mask, need_weights, attn_mask, ...)``."""
        bound = bind_forward_args(f"op {self.name!r}", args, kwargs)
        inputs = [bound["query"], bound["key"], bound["value"]]
        kpm, mask = bound.get("key_padding_mask"), bound.get("attn_mask")
        for v in (kpm, mask):
            if v is not None and not isinstance(v, Value):
                raise IRError(f"op {self.name!r}: masks must be graph values, got {type(v).__name__}")
        inputs += [v for v in (kpm, mask) if v is not None]
        op = attrs.evolve(
            self,
            need_weights=bool(bound.get("need_weights", True)),
            average_attn_weights=bool(bound.get("average_attn_weights", True)),
            is_causal=bool(bound.get("is_causal", False)),
            key_padding_mask=kpm is not None,
            attn_mask=mask is not None,
        )
        return op, inputs

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Arguments of the module call for the data operands (query, key, value, masks)."""
        q, k, v, kpm, mask = split_masks(self, inputs)
        return (q, k, v), {
            "key_padding_mask": kpm,
            "need_weights": self.need_weights,
            "attn_mask": mask,
            "average_attn_weights": self.average_attn_weights,
            "is_causal": self.is_causal,
        }

    def to_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        m = nn.MultiheadAttention(
            self.embed_dim,
            self.num_heads,
            dropout=self.dropout,
            bias=self.bias,
            batch_first=self.batch_first,
            device="meta",
        )
        load_dotted(m, tensors)
        return m

    def _run(self, operands: Sequence[Any], training: bool) -> Any:
        n = self.num_inputs()
        m = self.to_module(dict(zip(self.param_roles(), operands[n:], strict=False)))
        m.train(training)
        args, kwargs = self.module_call(operands[:n])
        return m(*args, **kwargs)

    def evaluate(self, ctx: EvalContext, operands: Sequence[Any]) -> Any:
        return self._run(operands, ctx.training)

    def compute(self, *operands: Any) -> Any:
        return self._run(operands, False)

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        q, k = operand_types[0], operand_types[1]
        if not (isinstance(q, TensorType) and isinstance(k, TensorType)):
            raise IRError(f"op {self.name!r}: query and key must be tensors")
        if not self.need_weights:
            return SequenceType((q, ObjectType("NoneType")))
        batched = q.rank == 3
        b = (q.shape[0] if self.batch_first else q.shape[1]) if batched else None
        lq = q.shape[1 if self.batch_first else 0] if batched else q.shape[0]
        lk = k.shape[1 if self.batch_first else 0] if batched else k.shape[0]
        w: tuple[int, ...] = (lq, lk) if self.average_attn_weights else (self.num_heads, lq, lk)
        return SequenceType((q, TensorType((b, *w) if b is not None else w, q.dtype)))

    def verify_(self, operand_types: Sequence[Type]) -> None:
        n = self.num_inputs() + len(self.param_roles())
        if len(operand_types) != n:
            raise IRError(f"op {self.name!r}: expects {n} operands, got {len(operand_types)}")


@register_op
@attrs.frozen
class LstmCell(ModuleOp):
    """``nn.LSTMCell``: operands ``(input[, h, c], weight_ih, weight_hh[, bias_ih, bias_hh])``;
    the result is ``(h', c')``."""

    name: ClassVar[str] = "lstm_cell"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure})
    operand_names: ClassVar[tuple[str, ...]] = ("input", "h", "c")
    module_types: ClassVar[tuple[type, ...]] = (nn.LSTMCell,)

    bias: bool = True
    has_state: bool = False

    def num_inputs(self) -> int:
        return 3 if self.has_state else 1

    def param_roles(self) -> tuple[str, ...]:
        return ("weight_ih", "weight_hh", "bias_ih", "bias_hh") if self.bias else ("weight_ih", "weight_hh")

    @classmethod
    def from_module(cls, m: Any) -> LstmCell:
        return cls(bias=m.bias)

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[LstmCell, list[Value]]:
        """Bind ``forward(input, hx=None)`` with ``hx`` a pair ``(h, c)``."""
        bound = dict(zip(("input", "hx"), args, strict=False)) | kwargs
        hx = bound.get("hx")
        if hx is None:
            return attrs.evolve(self, has_state=False), [bound["input"]]
        if not (isinstance(hx, (tuple, list)) and len(hx) == 2 and all(isinstance(v, Value) for v in hx)):
            raise IRError(f"op {self.name!r}: hx must be a pair of graph values (h, c)")
        return attrs.evolve(self, has_state=True), [bound["input"], hx[0], hx[1]]

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Arguments of the module call: ``(input, (h, c))`` or ``(input,)``."""
        return ((inputs[0], (inputs[1], inputs[2])) if self.has_state else (inputs[0],)), {}

    def to_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        w = tensors["weight_ih"]
        m = nn.LSTMCell(w.shape[1], w.shape[0] // 4, bias=self.bias, device="meta")
        load_dotted(m, tensors)
        return m

    def compute(self, *operands: Any) -> Any:
        n = self.num_inputs()
        m = self.to_module(dict(zip(self.param_roles(), operands[n:], strict=False)))
        args, kwargs = self.module_call(operands[:n])
        return m(*args, **kwargs)

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        x = operand_types[0]
        w = operand_types[self.num_inputs() + 1]  # weight_hh: (4*hidden, hidden)
        if not (isinstance(x, TensorType) and isinstance(w, TensorType)):
            raise IRError(f"op {self.name!r}: input and weights must be tensors")
        h = TensorType((*x.shape[:-1], w.shape[1]), x.dtype)
        return SequenceType((h, h))
