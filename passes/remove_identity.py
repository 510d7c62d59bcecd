"""``remove-identity``: bypass nodes that return their operand unchanged."""

from __future__ import annotations

from typing import ClassVar

import attrs

from passes.base import Pass, PassContext, register_pass
from qir.ir.graph import Graph, Node
from qir.ir.op import Transparent


def is_identity(node: Node) -> bool:
    """A ``Transparent`` op with one operand, no attributes and the operand's exact type.

    Attributes rule out data movement that keeps the type but not the values (a square
    transpose); an attribute-free transparent op of unchanged type returns its input.
    """
    return (
        node.op.has_trait(Transparent)
        and len(node.operands) == 1
        and not node.op.attributes()
        and node.type == node.operands[0].type
    )


@register_pass
@attrs.frozen
class RemoveIdentity(Pass):
    """Replace every use of an identity node with its operand and erase the node.

    Reports ``remove-identity.removed`` in the context's stats.
    """

    name: ClassVar[str] = "remove-identity"
    summary: ClassVar[str] = "bypass and erase nodes that return their operand unchanged"

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        removed = 0
        for node in list(graph.nodes):
            if is_identity(node):
                node.replace_all_uses_with(node.operands[0])
                graph.erase_node(node)
                removed += 1
        ctx.count("remove-identity.removed", removed)
        return removed > 0
