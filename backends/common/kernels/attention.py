"""Attention masks on codes: the masks as a bool ``masked`` tensor and additive codes on the scores'
grid, and the softmax with masked entries excluded (the ``softmax`` kernel's rule otherwise)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common.kernels.base import qbounds, register_kernel, sat_to
from backends.common.kernels.infer import ShapeError, broadcast, code, meta, meta_call, tensor_arg
from backends.common.kernels.schema import (
    INT_DTYPES,
    MAX_COUNT,
    MAX_EXTENT,
    MULT,
    OUT_DTYPE,
    SHIFT,
    Attr,
    Const,
    KernelSchema,
    floating,
    integer,
)
from backends.common.kernels.softmax import softmax_input
from backends.common.program import Instruction

_ROLES = ("attn_mask", "key_padding_mask")


def _roles_check(v: Any) -> str | None:
    if not isinstance(v, list) or len(v) > 2 or len(set(v)) != len(v) or any(r not in _ROLES for r in v):
        return f"must list distinct mask roles among {', '.join(_ROLES)}"
    return None


def _roles_match(inst: Instruction, consts: Mapping[str, torch.Tensor] | None) -> str | None:
    roles = list(inst.attrs["inputs"])
    if len(roles) != len(inst.inputs):
        return f"inputs names {len(roles)} mask role(s) for {len(inst.inputs)} input(s)"
    if set(roles) & set(inst.consts) or not (roles or inst.consts):
        return "each mask comes from one input or one constant, and there is at least one"
    return None


_MASK_ATTRS = {
    "inputs": Attr(_roles_check, "list of mask roles"),
    "heads": integer(1, MAX_EXTENT),
    "lq": integer(1, MAX_COUNT),
    "lk": integer(1, MAX_COUNT),
}
_MASK_CONSTS = {r: Const(("uint8", "float32"), (1, 3), required=False) for r in _ROLES}

#: additive codes beyond this saturate any qint8 score anyway
_CODE_LIMIT = 512


def _mask_args(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The masks by role: graph inputs in ``attrs['inputs']`` order, constants by their role."""
    found = dict(zip(inst.attrs["inputs"], args, strict=True))
    for role, t in state.items():
        found[role] = t.to(torch.bool) if t.dtype == torch.uint8 else t
    return found


def _shaped(inst: Instruction, masks: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    a = inst.attrs
    h, lq, lk = int(a["heads"]), int(a["lq"]), int(a["lk"])
    out = []
    if "attn_mask" in masks:
        m = masks["attn_mask"]
        out.append(m.reshape(1, 1, lq, lk) if m.dim() == 2 else m.reshape(m.shape[0] // h, h, lq, lk))
    if "key_padding_mask" in masks:
        m = masks["key_padding_mask"]
        out.append(m.reshape(m.shape[0], 1, 1, lk))
    return out


def _mask_shapes(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The masks as ``_shaped`` reshapes them, checked: abstract tensors in role order."""
    a = inst.attrs
    found = {r: tensor_arg(args, i, r) for i, r in enumerate(a["inputs"])}
    for role, name in inst.consts.items():
        t = consts[name]
        found[role] = meta(t.shape, torch.bool if t.dtype == torch.uint8 else t.dtype)
    h, lq, lk = int(a["heads"]), int(a["lq"]), int(a["lk"])
    out = []
    if "attn_mask" in found:
        m = found["attn_mask"]
        shape = (1, 1, lq, lk) if m.dim() == 2 else (m.shape[0] // h if m.dim() else 0, h, lq, lk)
        out.append(meta_call("attn_mask", m.reshape, shape))
    if "key_padding_mask" in found:
        m = found["key_padding_mask"]
        out.append(meta_call("key_padding_mask", m.reshape, (m.shape[0] if m.dim() else 0, 1, 1, lk)))
    broadcast(*out)
    return out


def _masked_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    return [meta(broadcast(*_mask_shapes(inst, args, consts)), torch.bool)]


def _mask_codes_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    soft = [m for m in _mask_shapes(inst, args, consts) if m.dtype != torch.bool]
    if not soft:
        raise ShapeError("additive mask codes need at least one float mask; all are bool")
    return [meta(broadcast(*soft), torch.int64)]


def _masked_softmax_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    x, masked = tensor_arg(args, 0, "scores"), tensor_arg(args, 1, "masked")
    softmax_input(inst, x, consts, -1)
    if masked.dtype != torch.bool:
        raise ShapeError(f"the mask must be bool, got {masked.dtype}")
    if broadcast(x, masked) != x.shape:
        raise ShapeError(f"the mask of shape {list(masked.shape)} does not expand to the scores' {list(x.shape)}")
    return [code(x.shape, inst.attrs["out_dtype"])]


@register_kernel(
    "attention_masked",
    schema=KernelSchema(inputs=(0, 2), attrs=_MASK_ATTRS, consts=_MASK_CONSTS, extra=_roles_match, shape=_masked_shape),
)
def attention_masked(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    """True where an entry is excluded: True in a bool mask, ``-inf`` in a float one."""
    masked: torch.Tensor | None = None
    for m in _shaped(inst, _mask_args(inst, args, state)):
        hard = m if m.dtype == torch.bool else torch.isneginf(m)
        masked = hard if masked is None else masked | hard
    assert masked is not None
    return [masked]


@register_kernel(
    "attention_mask_codes",
    schema=KernelSchema(
        inputs=(0, 2),
        attrs={**_MASK_ATTRS, "scale": floating(1e-30, 1e30)},
        consts=_MASK_CONSTS,
        extra=_roles_match,
        shape=_mask_codes_shape,
    ),
)
def attention_mask_codes(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    """The finite float masks summed, as codes ``floor(a / s + 1/2)`` (float64, exact tie test) at ``scale``."""
    total: torch.Tensor | None = None
    for m in _shaped(inst, _mask_args(inst, args, state)):
        if m.dtype == torch.bool:
            continue
        soft = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        total = soft if total is None else total + soft
    assert total is not None
    v = total.to(torch.float64) / float(inst.attrs["scale"])
    f = torch.floor(v)
    codes = f + (v - f >= 0.5).to(torch.float64)
    return [codes.clamp(-_CODE_LIMIT, _CODE_LIMIT).to(torch.int64)]


@register_kernel(
    "masked_softmax",
    schema=KernelSchema(
        inputs=(2, 2),
        attrs={"multiplier": MULT, "shift": SHIFT, "out_dtype": OUT_DTYPE},
        consts={"table": Const(INT_DTYPES, (1, 1))},
        shape=_masked_softmax_shape,
    ),
)
def masked_softmax(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    """``softmax`` over the last dim with ``masked`` entries excluded (output 0); a fully masked row is 0."""
    a = inst.attrs
    x, masked = args
    if x.dtype != torch.int8:
        raise NotImplementedError(f"masked_softmax ({inst.source}): the exp table takes qint8 codes; got {x.dtype}")
    q = x.to(torch.int64)
    keep = ~masked.expand(q.shape)
    mx = q.masked_fill(~keep, -(2**15)).amax(dim=-1, keepdim=True)
    e = state["table"].to(torch.int64)[(q - mx + 255).clamp(0, 255)] * keep
    total = e.sum(dim=-1, keepdim=True)
    empty = total == 0
    den = total.masked_fill(empty, 1) << int(a["shift"])
    out = torch.div(2 * e * int(a["multiplier"]) + den, 2 * den, rounding_mode="floor").masked_fill(empty, 0)
    dt = str(a["out_dtype"])
    lo, hi = qbounds(dt)
    return [sat_to(out.clamp_(lo, hi), dt)]
