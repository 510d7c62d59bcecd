"""absorb-bn: fold an inference batch norm into the conv / linear that feeds it.

One pattern and one rewriter::

    batch_norm(conv(x, weight[, bias]))  ->  conv(x, weight', bias')

    s = gamma / sqrt(running_var + eps)          (gamma = 1, beta = 0 without affine)
    weight' = weight * s   along the output-channel axis
    bias'   = (bias - running_mean) * s + beta   (bias = 0 when the conv had none)

The folded tensors replace the conv's under the conv's own keys (``conv.weight``,
``conv.bias``), so state-dict names survive; the batch norm's keys disappear. A conv
without bias gains one, keyed next to its weight. Folding declines when the conv has
other users, is already fused (``add``/``act``), its weight or bias is not a constant
used only by it, the stats are not constants, the channel counts or layouts disagree,
or the graph was traced in training mode (batch statistics; ``force=True`` folds the
running statistics anyway).
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from passes.base import Pass, PassContext, register_pass
from passes.patterns import OpPattern, P
from passes.rewrite import (
    FusedFrom,
    Rule,
    add_constant_after,
    apply_rewrites,
    constant_of,
    free_constant_key,
    like,
    rebuild,
)
from qir.ir import Graph, Node, TensorType, Value
from qir.ir.ops.nn import BatchNorm, ConvNd, ConvTransposeNd, Linear

#: Op classes whose output channels a batch norm can be folded into.
FOLDABLE = (ConvNd, ConvTransposeNd, Linear)


def fold_batch_norm(
    conv: ConvNd | ConvTransposeNd | Linear,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight', bias')`` of ``conv`` followed by an eval batch norm, computed in float64."""
    w = weight.detach().double()
    scale = (gamma.detach().double() if gamma is not None else 1.0) / torch.sqrt(var.detach().double() + eps)
    shift = beta.detach().double() if beta is not None else torch.zeros_like(scale)
    b = bias.detach().double() if bias is not None else torch.zeros_like(scale)
    if isinstance(conv, ConvTransposeNd):
        # weight is (in, out/groups, *k); output channel g*out_g + j uses column j of group g
        groups = conv.groups
        in_g, out_g = w.shape[0] // groups, w.shape[1]
        s = scale.reshape(groups, 1, out_g, *([1] * (w.dim() - 2)))
        w = (w.reshape(groups, in_g, out_g, *w.shape[2:]) * s).reshape(w.shape)
    else:  # conv (out, in/groups, *k) and linear (out, in): out channels on axis 0
        w = w * scale.reshape(-1, *([1] * (w.dim() - 1)))
    b = (b - mean.detach().double()) * scale + shift
    return w, b


def _out_channels(conv: ConvNd | ConvTransposeNd | Linear, weight: torch.Tensor) -> int:
    if isinstance(conv, ConvTransposeNd):
        return weight.shape[1] * conv.groups
    return weight.shape[0]


def _channel_axis_is_1(conv_node: Node, weight: torch.Tensor) -> bool:
    """Batch norm normalises axis 1; the conv's output channels must sit there."""
    t = conv_node.type
    if not isinstance(t, TensorType):
        return False
    if isinstance(conv_node.op, Linear):
        return t.rank == 2  # (N, out); (N, L, out) would normalise L
    return t.rank == weight.dim()  # batched (N, C, *spatial)


def _fold(graph: Graph, bn: Node, conv: Node, force: bool) -> Value | None:
    if graph.training and not force:
        return None
    op = conv.op
    assert isinstance(op, FOLDABLE) and isinstance(bn.op, BatchNorm)
    w_const = constant_of(graph, conv.operands[1])
    if w_const is None or w_const[0].num_uses != 1:
        return None  # computed or shared weight: folding would change other users
    w_node, weight = w_const
    b_const = None
    if op.bias:
        b_const = constant_of(graph, conv.operands[2])
        if b_const is None or b_const[0].num_uses != 1:
            return None
    stats: dict[str, torch.Tensor] = {}
    for role in bn.op.param_roles():
        idx = bn.op.param_index(role)
        assert idx is not None
        c = constant_of(graph, bn.operands[idx])
        if c is None:
            return None
        stats[role] = c[1]
    if "running_mean" not in stats or "running_var" not in stats:
        return None
    channels = _out_channels(op, weight)
    if any(t.numel() != channels for k, t in stats.items() if k != "num_batches_tracked"):
        return None
    if not _channel_axis_is_1(conv, weight) or not weight.is_floating_point():
        return None

    new_w, new_b = fold_batch_norm(
        op,
        weight,
        b_const[1] if b_const else None,
        stats["running_mean"],
        stats["running_var"],
        stats.get("weight"),
        stats.get("bias"),
        bn.op.eps,
    )
    # the weight constant node stays (same key, name, shape); only its tensor changes
    graph.constants[w_node.op.key] = like(weight, new_w)  # type: ignore[attr-defined]
    if b_const is not None:
        b_node = b_const[0]
        graph.constants[b_node.op.key] = like(b_const[1], new_b)  # type: ignore[attr-defined]
    else:
        wkey: str = w_node.op.key  # type: ignore[attr-defined]
        prefix, dot, last = wkey.rpartition(".")
        key = free_constant_key(graph, f"{prefix}{dot}bias" if last == "weight" else f"{wkey}_bias")
        b_node = add_constant_after(graph, w_node, key, like(weight, new_b), "parameter", w_node.scope)
    return rebuild(
        graph,
        conv,
        attrs.evolve(op, bias=True),
        (conv.operands[0], w_node, b_node),
        before=bn,
        fused=(FusedFrom("bn", bn.op.name, bn.name, bn.scope),),
    )


def bn_pattern() -> OpPattern:
    """``batch_norm(conv)`` with an unfused conv/linear whose output only the BN reads."""
    conv = P(FOLDABLE, P.any("x"), P.const("weight")).named("conv").where(add=False, act=None)
    return P(BatchNorm, conv, name="bn", track_running_stats=True)


def absorb_bn_rule(force: bool = False) -> Rule:
    """The absorb-bn rule, for pipelines that combine it with other rewrites."""
    return Rule("absorb-bn", bn_pattern(), lambda g, m: _fold(g, m.node("bn"), m.node("conv"), force))


@register_pass
@attrs.frozen
class AbsorbBatchNorm(Pass):
    """Fold each batch norm into the conv / conv_transpose / linear before it."""

    name: ClassVar[str] = "absorb-bn"
    summary: ClassVar[str] = "fold eval batch norms into the preceding conv/linear weights"

    #: Fold even in a graph traced in training mode (uses the current running stats).
    force: bool = False

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        stats = apply_rewrites(graph, [absorb_bn_rule(self.force)])
        r = stats.rules["absorb-bn"]
        ctx.count("absorb-bn.matched", r.matched)
        ctx.count("absorb-bn.applied", r.applied)
        return stats.changed
