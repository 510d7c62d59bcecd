"""A batch norm no conv feeds becomes a depthwise 1x1 conv (run by ``fuse`` after absorb-bn).

Horizon's operator tables run a standalone ``BatchNorm2d`` (densenet's pre-activation norm after a
cat) on the BPU as a convolution. In inference it is a per-channel affine map::

    batch_norm(x)  ->  conv2d(x, w, b){groups=C}     w = s.reshape(C, 1, 1, 1),  b = beta - mean * s
    s = gamma / sqrt(running_var + eps)              (gamma = 1, beta = 0 without affine)

computed in float64 as absorb-bn folds, stored in the statistics' dtype. The conv takes the batch
norm's name and scope, so prepare gives it a QAT conv at the batch norm's module path (scale and
shift then train as the conv's weight and bias), and ``relu`` / ``add`` after it fuse as after any
conv. Its tensors are keyed ``<bn>.weight`` / ``<bn>.bias``; the statistics' keys disappear.

Declines (the batch norm stays) when: its input is a conv / linear output absorb-bn declined to fold
into (a conv called at several places with a batch norm per place, a conv read elsewhere too: prepare
refuses those naming the case); the graph was traced in training mode and ``force`` is off;
the input is not a float tensor of rank 4 (BatchNorm1d / 3d, or a SyncBatchNorm on another rank:
no depthwise 2-d conv says the same); a statistic is not a constant read by this batch norm alone
(a batch norm module called at several places); the statistics' lengths disagree.
"""

from __future__ import annotations

import torch
from torch import nn

from passes.absorb_bn import FOLDABLE, _scale_and_bias
from passes.rewrite import free_constant_key
from qir.ir import Graph, Node, TensorType
from qir.ir.ops.core import Constant
from qir.ir.ops.nn import BatchNorm, Conv2d

__all__ = ["fold_standalone_batch_norms"]


def _stats(graph: Graph, bn: Node) -> dict[str, tuple[Node, torch.Tensor]] | None:
    """role -> (constant node, tensor) of ``bn``'s state; None unless each is a constant only ``bn`` reads."""
    assert isinstance(bn.op, BatchNorm)
    out: dict[str, tuple[Node, torch.Tensor]] = {}
    for role, v in zip(bn.op.param_roles(), bn.operands[1:], strict=True):
        if not (isinstance(v, Node) and isinstance(v.op, Constant)) or v.num_uses != 1:
            return None
        out[role] = (v, graph.constants[v.op.key])
    return out


def _eligible(graph: Graph, bn: Node, force: bool) -> dict[str, tuple[Node, torch.Tensor]] | None:
    op = bn.op
    if not isinstance(op, BatchNorm) or not op.track_running_stats or (graph.training and not force):
        return None
    if op.dims not in (0, 2):  # BatchNorm2d, or a SyncBatchNorm (any rank: checked below)
        return None
    x = bn.operands[0]
    if isinstance(x, Node) and isinstance(x.op, FOLDABLE):
        return None  # a conv absorb-bn declined (shared, fused, read elsewhere): prepare names that case
    t = x.type
    if not isinstance(t, TensorType) or t.rank != 4 or not t.dtype.is_float:
        return None
    stats = _stats(graph, bn)
    if stats is None or "running_mean" not in stats or "running_var" not in stats:
        return None
    # the statistics give the channel count (a graph traced without example inputs has stand-in sizes)
    channels = stats["running_mean"][1].numel()
    if any(x.numel() != channels for role, (_, x) in stats.items() if role != "num_batches_tracked"):
        return None
    if not all(x.is_floating_point() for role, (_, x) in stats.items() if role != "num_batches_tracked"):
        return None
    return stats


def _fold_one(graph: Graph, bn: Node, stats: dict[str, tuple[Node, torch.Tensor]]) -> None:
    assert isinstance(bn.op, BatchNorm)
    gamma = stats.get("weight", (None, None))[1]
    beta = stats.get("bias", (None, None))[1]
    mean, var = stats["running_mean"][1], stats["running_var"][1]
    scale, shift = _scale_and_bias(None, mean, var, gamma, beta, bn.op.eps)
    dtype = (gamma if gamma is not None else var).dtype
    channels = scale.numel()
    trainable = gamma.requires_grad if isinstance(gamma, nn.Parameter) else True
    weight = nn.Parameter(scale.to(dtype).reshape(channels, 1, 1, 1), requires_grad=trainable)
    bias = nn.Parameter(shift.to(dtype), requires_grad=trainable)
    # the statistics' constants go (their keys are freed for the conv's), the new ones take their place
    first = next(iter(stats.values()))[0]
    anchor = first.prev
    while anchor is not None and any(anchor is n for n, _ in stats.values()):
        anchor = anchor.prev
    prefix = stats["running_mean"][0].op.key.rpartition(".")[0]  # type: ignore[attr-defined]
    x = bn.operands[0]
    name, scope, meta, out_type = bn.name, bn.scope, dict(bn.meta), bn.type
    graph.rename(bn, f"{name}_replaced")
    conv_op = Conv2d(groups=channels, bias=True)
    conv = graph.create_node(conv_op, (), out_type, name, scope)
    conv.meta = meta
    graph.insert_node(conv, before=bn)
    bn.replace_all_uses_with(conv)
    graph.erase_node(bn)
    for node, _ in stats.values():
        graph.erase_node(node)
        del graph.constants[node.op.key]  # type: ignore[attr-defined]
    dot = "." if prefix else ""
    keys = [free_constant_key(graph, f"{prefix}{dot}{leaf}") for leaf in ("weight", "bias")]
    nodes: list[Node] = []
    for key, tensor in zip(keys, (weight, bias), strict=True):
        graph.constants[key] = tensor
        c_op = Constant(key=key, kind="parameter")
        c = graph.create_node(c_op, (), c_op.type_for(tensor), key, scope)
        if anchor is None:  # the statistics led the graph
            graph.insert_node(c, before=next(iter(graph.nodes)))
        else:
            graph.insert_node(c, after=anchor)
        anchor = c
        nodes.append(c)
    conv.set_operands((x, *nodes))


def fold_standalone_batch_norms(graph: Graph, force: bool = False) -> int:
    """Turn every eligible batch norm (see the module doc) into a depthwise 1x1 ``conv2d``; returns how many."""
    folded = 0
    for bn in [n for n in graph.nodes if isinstance(n.op, BatchNorm)]:
        stats = _eligible(graph, bn, force)
        if stats is None:
            continue
        _fold_one(graph, bn, stats)
        folded += 1
    return folded
