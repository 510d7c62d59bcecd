"""A user's pass module (loaded by path in tests/quantization/test_prepare_paths.py): after
``insert-observers``, give the QAT layer at ``scope`` a qint16 output fake quant."""

from __future__ import annotations

from typing import ClassVar

import attrs

import passes
from qir.ir.graph import Graph
from qir.ir.ops.qat import QATConv
from qir.ir.types import DType


@passes.register_pass
@attrs.frozen
class QATOutputQint16(passes.Pass):
    name: ClassVar[str] = "test-qat-out-qint16"
    summary: ClassVar[str] = "make one QAT conv's output fake quant qint16 (test pass)"

    scope: str = ""

    def apply(self, ctx: passes.PassContext, graph: Graph) -> bool:
        hits = [n for n in graph.nodes if isinstance(n.op, QATConv) and n.scope == self.scope and n.op.out_fq]
        for n in hits:
            out = n.op.out_fq
            observer = attrs.evolve(out.observer, dtype=DType.qint16)
            n.op = attrs.evolve(n.op, out_fq=attrs.evolve(out, observer=observer))
        ctx.count("test-qat-out-qint16.changed", len(hits))
        return bool(hits)
