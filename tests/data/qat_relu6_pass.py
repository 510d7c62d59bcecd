"""A user's pass module (loaded by path in tests/quantization/test_convert_paths.py): clip the QAT
convs' fused ReLU at 6 before ``quantize`` converts them."""

from __future__ import annotations

from typing import ClassVar

import attrs

import passes
from qir.ir.graph import Graph
from qir.ir.ops.qat import QATConv


@passes.register_pass
@attrs.frozen
class QATReluToRelu6(passes.Pass):
    name: ClassVar[str] = "test-qat-relu-to-relu6"
    summary: ClassVar[str] = "make every QAT conv's fused relu a relu6 (test pass)"

    def apply(self, ctx: passes.PassContext, graph: Graph) -> bool:
        hits = [n for n in graph.nodes if isinstance(n.op, QATConv) and n.op.act == "relu"]
        for n in hits:
            n.op = attrs.evolve(n.op, act="relu6")
        ctx.count("test-qat-relu-to-relu6.replaced", len(hits))
        return bool(hits)
