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

A conv module called at several places, each call followed by the same batch norm module
(one conv+BN tower applied to every FPN level), reads one weight constant from every call
site: :func:`fold_shared_sites` folds it once and rewrites every site, before the rule runs.
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
from qir.ir.ops.core import Constant
from qir.ir.ops.nn import BatchNorm, ConvNd, ConvTransposeNd, Linear

#: Op classes whose output channels a batch norm can be folded into.
FOLDABLE = (ConvNd, ConvTransposeNd, Linear)


def _scale_and_bias(
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel weight scale and the folded bias, in float64."""
    scale = (gamma.detach().double() if gamma is not None else 1.0) / torch.sqrt(var.detach().double() + eps)
    shift = beta.detach().double() if beta is not None else torch.zeros_like(scale)
    b = bias.detach().double() if bias is not None else torch.zeros_like(scale)
    return scale, (b - mean.detach().double()) * scale + shift


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
    scale, b = _scale_and_bias(bias, mean, var, gamma, beta, eps)
    # a float64 copy, scaled in place below (the weights are the bulk of a model: one temporary, not two)
    w = weight.detach().to(torch.float64, copy=True)
    if isinstance(conv, ConvTransposeNd):
        # weight is (in, out/groups, *k); output channel g*out_g + j uses column j of group g
        groups = conv.groups
        in_g, out_g = w.shape[0] // groups, w.shape[1]
        s = scale.reshape(groups, 1, out_g, *([1] * (w.dim() - 2)))
        w = (w.reshape(groups, in_g, out_g, *w.shape[2:]) * s).reshape(w.shape)
    else:  # conv (out, in/groups, *k) and linear (out, in): out channels on axis 0
        w.mul_(scale.reshape(-1, *([1] * (w.dim() - 1))))
    return w, b


#: elements of the float64 temporary :func:`folded_in_dtype` scales at a time (2 MiB: cache-sized, and
#: few blocks per weight; on resnet50's convs 0.019 s against 0.030 s for whole-weight float64 copies)
_BLOCK = 1 << 18


def folded_in_dtype(
    conv: ConvNd | ConvTransposeNd | Linear,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fold_batch_norm` with the weight rounded to ``weight``'s dtype (the bias stays
    float64): the same bits, each element computed in float64 and rounded once, without a
    float64 copy of the whole weight (the bulk of a model): the weight is scaled by blocks of
    output channels into the result."""
    if isinstance(conv, ConvTransposeNd) or weight.dim() == 0 or weight.shape[0] == 0:
        w64, b64 = fold_batch_norm(conv, weight, bias, mean, var, gamma, beta, eps)
        return w64.to(weight.dtype), b64
    scale, b = _scale_and_bias(bias, mean, var, gamma, beta, eps)
    w = weight.detach()
    out = torch.empty_like(w)
    s = scale.reshape(-1, *([1] * (w.dim() - 1)))
    step = max(1, _BLOCK // max(1, w[0].numel()))
    for i in range(0, w.shape[0], step):
        out[i : i + step] = w[i : i + step].double().mul_(s[i : i + step])  # the store rounds to w's dtype
    return out, b


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


@attrs.frozen
class _FoldPlan:
    """What folding one batch norm into a conv's constants needs (checked, not yet applied)."""

    w_node: Node
    weight: torch.Tensor
    bias: tuple[Node, torch.Tensor] | None
    stats: dict[str, torch.Tensor]


def _plan(graph: Graph, bn: Node, conv: Node, force: bool, weight_users: int) -> _FoldPlan | None:
    """The fold of ``bn`` into ``conv``, or None when it must not happen. The conv's weight
    (and bias) constants must be read by exactly ``weight_users`` nodes (1, or every call
    site of a shared conv, which :func:`fold_shared_sites` checks)."""
    if graph.training and not force:
        return None
    op = conv.op
    assert isinstance(op, FOLDABLE) and isinstance(bn.op, BatchNorm)
    w_const = constant_of(graph, conv.operands[1])
    if w_const is None or w_const[0].num_uses != weight_users:
        return None  # computed or shared weight: folding would change other users
    w_node, weight = w_const
    b_const = None
    if op.bias:
        b_const = constant_of(graph, conv.operands[2])
        if b_const is None or b_const[0].num_uses != weight_users:
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
    return _FoldPlan(w_node, weight, b_const, stats)


def _apply_plan(graph: Graph, plan: _FoldPlan, conv_op: ConvNd | ConvTransposeNd | Linear, eps: float) -> Node:
    """Write the folded weight and bias into the constants; returns the bias constant node."""
    new_w, new_b = folded_in_dtype(
        conv_op,
        plan.weight,
        plan.bias[1] if plan.bias else None,
        plan.stats["running_mean"],
        plan.stats["running_var"],
        plan.stats.get("weight"),
        plan.stats.get("bias"),
        eps,
    )
    w_node = plan.w_node
    # the weight constant node stays (same key, name, shape); only its tensor changes
    graph.constants[w_node.op.key] = like(plan.weight, new_w)  # type: ignore[attr-defined]
    if plan.bias is not None:
        b_node = plan.bias[0]
        graph.constants[b_node.op.key] = like(plan.bias[1], new_b)  # type: ignore[attr-defined]
        return b_node
    wkey: str = w_node.op.key  # type: ignore[attr-defined]
    prefix, dot, last = wkey.rpartition(".")
    key = free_constant_key(graph, f"{prefix}{dot}bias" if last == "weight" else f"{wkey}_bias")
    return add_constant_after(graph, w_node, key, like(plan.weight, new_b), "parameter", w_node.scope)


def _fold(graph: Graph, bn: Node, conv: Node, force: bool) -> Value | None:
    plan = _plan(graph, bn, conv, force, weight_users=1)
    if plan is None:
        return None
    op = conv.op
    assert isinstance(op, FOLDABLE) and isinstance(bn.op, BatchNorm)
    b_node = _apply_plan(graph, plan, op, bn.op.eps)
    return rebuild(
        graph,
        conv,
        attrs.evolve(op, bias=True),
        (conv.operands[0], plan.w_node, b_node),
        before=bn,
        fused=(FusedFrom("bn", bn.op.name, bn.name, bn.scope),),
    )


def _shared_sites(w_node: Node) -> list[tuple[Node, Node]] | None:
    """``[(conv, bn)]`` when every reader of ``w_node`` is a call of one conv module followed
    by a call of one batch norm module: a conv+BN tower applied at several places (a detection
    head on every FPN level). Else None."""
    sites: list[tuple[Node, Node]] = []
    for conv in w_node.users:
        op = conv.op
        if not isinstance(op, FOLDABLE) or op.add or op.act is not None or conv.operands[1] is not w_node:
            return None
        users = conv.users
        if conv.num_uses != 1 or len(users) != 1:
            return None
        bn = users[0]
        if not isinstance(bn.op, BatchNorm) or not bn.op.track_running_stats or bn.operands[0] is not conv:
            return None
        sites.append((conv, bn))
    if len(sites) < 2 or w_node.num_uses != len(sites):
        return None
    conv0, bn0 = sites[0]
    for conv, bn in sites[1:]:
        # the same module: the same op, parameters and batch norm state at every call site
        if conv.op != conv0.op or conv.operands[1:] != conv0.operands[1:] or conv.scope != conv0.scope:
            return None
        if bn.op != bn0.op or bn.operands[1:] != bn0.operands[1:] or bn.scope != bn0.scope:
            return None
    return sites


def fold_shared_sites(graph: Graph, force: bool = False) -> int:
    """Fold batch norms into convs called at several places, each call followed by the same
    batch norm module (one conv+BN tower applied to every FPN level): the fold is the same
    at every call site, so the shared weight and bias are folded once and every site becomes
    one conv reading them. The per-node rule cannot do this (it declines shared weights).

    Returns the number of call sites rewritten."""
    rewritten = 0
    for w_node in [n for n in graph.nodes if isinstance(n.op, Constant)]:
        if w_node.graph is None or w_node.num_uses < 2:
            continue
        sites = _shared_sites(w_node)
        if sites is None:
            continue
        conv0, bn0 = sites[0]
        plan = _plan(graph, bn0, conv0, force, weight_users=len(sites))
        if plan is None:
            continue
        op = conv0.op
        assert isinstance(op, FOLDABLE) and isinstance(bn0.op, BatchNorm)
        b_node = _apply_plan(graph, plan, op, bn0.op.eps)
        bn_inputs = {v for v in bn0.operands[1:] if isinstance(v, Node)}
        for conv, bn in sites:
            new = rebuild(
                graph,
                conv,
                attrs.evolve(op, bias=True),
                (conv.operands[0], plan.w_node, b_node),
                before=bn,
                fused=(FusedFrom("bn", bn.op.name, bn.name, bn.scope),),
            )
            bn.replace_all_uses_with(new)
            graph.erase_node(bn)
            graph.erase_node(conv)
            rewritten += 1
        for c in bn_inputs:
            if c.graph is not None and not c.num_uses:
                graph.erase_node(c)
        graph.prune_constants()
    return rewritten


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
        shared = fold_shared_sites(graph, self.force)
        stats = apply_rewrites(graph, [absorb_bn_rule(self.force)])
        r = stats.rules["absorb-bn"]
        ctx.count("absorb-bn.matched", r.matched)
        ctx.count("absorb-bn.applied", r.applied)
        ctx.count("absorb-bn.shared_sites", shared)
        return stats.changed or shared > 0
