"""``dce``: remove pure nodes whose results nobody uses, and constants left unreferenced."""

from __future__ import annotations

from typing import ClassVar

import attrs

from passes.base import Pass, PassContext, register_pass
from qir.ir.graph import Graph


@register_pass
@attrs.frozen
class DeadCodeElimination(Pass):
    """Erase unused nodes of ``Pure`` ops (last to first, so chains go in one sweep).

    Nodes of impure or opaque ops stay even when unused: they may have effects. Reports
    ``dce.removed`` in the context's stats.
    """

    name: ClassVar[str] = "dce"
    summary: ClassVar[str] = "remove unused pure nodes and unreferenced constants"

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        constants = len(graph.constants)
        removed = graph.eliminate_dead_code()
        ctx.count("dce.removed", removed)
        return removed > 0 or len(graph.constants) != constants
