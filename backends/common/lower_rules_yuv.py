"""Lowering of ``qir.functional.centered_yuv2rgb`` / ``centered_yuv2bgr`` on codes: the 1x1 conv and
per-channel clamp of :mod:`backends.common.yuv_rules`, as ``conv2d`` + ``maximum`` + ``minimum``
instructions (the converted model calls :func:`~backends.common.yuv_rules.yuv2rgb_codes`, which
computes the same codes)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from backends.common.lower import LowerContext, LoweringError, RuleNode, register_function_rule, tensor_ref
from backends.common.lower_rules import lower_conv
from backends.common.program import ValueRef
from backends.common.yuv_rules import yuv2rgb_params
from qir.ir.types import DType

_PARAMS = ("input", "swing", "mean", "std", "q_scale")
_DEFAULTS: dict[str, Any] = {"swing": "studio", "mean": (128.0,), "std": (128.0,), "q_scale": 1.0 / 128.0}
_HP = {
    "stride": [1, 1],
    "padding": [0, 0],
    "dilation": [1, 1],
    "groups": 1,
    "padding_mode": "zeros",
    "reversed_padding": [0, 0, 0, 0],
}


def _yuv_rule(bgr: bool) -> Any:
    what = "centered_yuv2bgr" if bgr else "centered_yuv2rgb"

    def rule(ctx: LowerContext, node: RuleNode, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
        if len(args) > len(_PARAMS) or not set(kwargs) <= set(_PARAMS[1:]):
            raise LoweringError(f"node '{node.name}': {what} takes {', '.join(_PARAMS)}; got {len(args)} arguments")
        bound = {**_DEFAULTS, **dict(zip(_PARAMS, args, strict=False)), **kwargs}
        x = tensor_ref(bound["input"], node)
        xv = ctx.values[x]
        if xv.is_floating_point() or xv.dim() != 4 or xv.shape[1] != 3:
            raise LoweringError(
                f"node '{node.name}': {what} lowers on (N, 3, H, W) integer codes (after a QuantStub whose scale is "
                f"1); got a {xv.dtype} tensor of shape {tuple(xv.shape)}"
            )
        consts = {k: bound[k] for k in ("swing", "mean", "std", "q_scale")}
        if any(isinstance(v, ValueRef) for v in consts.values()):
            raise LoweringError(f"node '{node.name}': {what}'s swing, mean, std and q_scale must be constants")
        try:
            p = yuv2rgb_params(str(consts["swing"]), consts["mean"], consts["std"], consts["q_scale"], bgr)
        except ValueError as e:
            raise LoweringError(f"node '{node.name}': {e}") from None
        conv = SimpleNamespace(
            weight=p.weight,
            bias=p.bias,
            multiplier=p.multiplier,
            shift=p.shift,
            relu6_bound=torch.zeros(3, dtype=torch.int32),
            has_add=False,
            kind="Conv2d",
            dtype=DType.qint8,
            act=None,
            hp=_HP,
        )
        out = lower_conv(ctx, RuleNode(node.name, node.name), conv, [ValueRef(x)], {})
        lo = ctx.const(f"{node.name}.rgb_lo", p.lo.reshape(1, 3, 1, 1))
        hi = ctx.const(f"{node.name}.rgb_hi", p.hi.reshape(1, 3, 1, 1))
        lo_v = ctx.emit("constant", [], {}, {"value": lo}, node.name, f"{node.name}_rgb_lo")
        hi_v = ctx.emit("constant", [], {}, {"value": hi}, node.name, f"{node.name}_rgb_hi")
        clamped = ctx.emit("maximum", [out.name, lo_v], {}, {}, node.name, "maximum")
        return ValueRef(ctx.emit("minimum", [clamped, hi_v], {}, {}, node.name, what))

    return rule


register_function_rule("qir.functional.centered_yuv2rgb", _yuv_rule(bgr=False))
register_function_rule("qir.functional.centered_yuv2bgr", _yuv_rule(bgr=True))
