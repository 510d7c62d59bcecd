"""fuse: merge add and relu/relu6 into the conv / conv_transpose / linear before them.

The seeds' combinations (conv[-bn][-add][-relu|relu6], the conv on either side of the
add) on the IR, as two rules the driver applies to a fixed point after absorb-bn's::

    add(conv{add=False, act=None}, other)  ->  conv{add=True}(..., other)
    relu|relu6(conv{act=None})             ->  conv{act="relu"|"relu6"}

so conv-bn-add-relu ends as one conv node with ``add=True, act="relu"`` and the addend
as its last operand. The conv keeps its name and scope; ``node.meta["fused_from"]``
(see :func:`passes.rewrite.fused_from`) lists the batch norm, add and activation it
absorbed, with their scopes and the conv's side of the add. Nothing fuses across a
value with other users: a relu whose conv has other users, or an add whose conv
operand has other users, stays as it is; the addend must have the conv's shape.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from passes.absorb_bn import absorb_bn_rule, fold_shared_sites
from passes.base import Pass, PassContext, register_pass
from passes.patterns import Match, OpPattern, P
from passes.rewrite import FusedFrom, Rule, apply_rewrites, rebuild
from passes.standalone_bn import fold_standalone_batch_norms
from qir.ir import Graph, Node, TensorType, Value
from qir.ir.ops.elementwise import Add, Relu, Relu6
from qir.ir.ops.nn import ConvNd, ConvTransposeNd, Linear

#: Op classes that execute a fused add and activation (they have ``add`` / ``act``).
FUSABLE = (ConvNd, ConvTransposeNd, Linear)
#: Activation op class -> the conv's ``act`` attribute value.
ACTS: dict[type, str] = {Relu: "relu", Relu6: "relu6"}


def _same_tensor_type(add: Node) -> bool:
    """The addend must have the conv's shape and dtype: the fused op adds no broadcast."""
    if len(add.operands) != 2:
        return False
    a, b = add.operands[0].type, add.operands[1].type
    return isinstance(a, TensorType) and isinstance(b, TensorType) and (a.shape, a.dtype) == (b.shape, b.dtype)


def add_pattern() -> OpPattern:
    conv = P(FUSABLE, P.any()).named("conv").where(add=False, act=None)
    return P(Add, conv, P.any("other"), name="add", other=None).where(_same_tensor_type)


def act_pattern() -> OpPattern:
    return P(tuple(ACTS), P(FUSABLE, P.any()).named("conv").where(act=None), name="act")


def _fuse_add(graph: Graph, m: Match) -> Value | None:
    conv, add = m.node("conv"), m.node("add")
    assert isinstance(conv.op, FUSABLE)
    return rebuild(
        graph,
        conv,
        attrs.evolve(conv.op, add=True),
        (*conv.operands, m["other"]),
        before=add,
        fused=(FusedFrom("add", add.op.name, add.name, add.scope, m.slot("conv")),),
    )


def _fuse_act(graph: Graph, m: Match) -> Value | None:
    conv, act = m.node("conv"), m.node("act")
    assert isinstance(conv.op, FUSABLE)
    return rebuild(
        graph,
        conv,
        attrs.evolve(conv.op, act=ACTS[type(act.op)]),
        conv.operands,
        before=act,
        fused=(FusedFrom("act", act.op.name, act.name, act.scope),),
    )


def fuse_rules() -> list[Rule]:
    """The add and activation rules (without absorb-bn)."""
    return [Rule("fuse-add", add_pattern(), _fuse_add), Rule("fuse-act", act_pattern(), _fuse_act)]


@register_pass
@attrs.frozen
class Fuse(Pass):
    """Fuse conv/linear [+ add] [+ relu/relu6] into one node, absorbing batch norms first."""

    name: ClassVar[str] = "fuse"
    summary: ClassVar[str] = "fuse conv/linear with a following add and relu/relu6 (and absorb batch norms)"

    #: Also fold batch norms (the absorb-bn rule runs in the same rewrite).
    absorb_bn: bool = True
    #: Passed to absorb-bn: fold batch norms even in a graph traced in training mode.
    force_bn: bool = False
    #: A 2-d batch norm absorb-bn cannot fold (no conv feeds it alone) becomes a depthwise 1x1
    #: conv (passes/standalone_bn.py), as the march runs it; with ``absorb_bn`` only.
    standalone_bn: bool = True

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        # a conv+BN called at several places folds once for all its call sites first
        shared = fold_shared_sites(graph, self.force_bn) if self.absorb_bn else 0
        ctx.count("fuse.absorb-bn.shared_sites", shared)
        rules = ([absorb_bn_rule(self.force_bn)] if self.absorb_bn else []) + fuse_rules()
        stats = apply_rewrites(graph, rules)
        standalone = fold_standalone_batch_norms(graph, self.force_bn) if self.absorb_bn and self.standalone_bn else 0
        ctx.count("fuse.standalone-bn.applied", standalone)
        runs = [stats]
        if standalone:  # the relu / add (or another batch norm) after a batch norm that became a conv fuse into it
            runs.append(apply_rewrites(graph, rules))
        for run in runs:
            for name, r in run.rules.items():
                ctx.count(f"fuse.{name}.matched", r.matched)
                ctx.count(f"fuse.{name}.applied", r.applied)
        return stats.changed or shared > 0 or standalone > 0
