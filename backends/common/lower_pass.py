"""``lower{march=...,opt=2}``: the integer IR -> a :class:`Program` of kernels for one march.

The last pass of the compile pipeline (``legalize{march=M},lower{march=M}``). It runs
:func:`backends.common.lower_ir.lower_ir` on the graph as the passes before it left it,
reading the example inputs from ``ctx.options["example_inputs"]`` (every instruction runs
once on them: shapes, tables and the engine timing of ``opt >= 2`` depend on them), and
stores the Program under ``ctx.options["lower.program"]`` (:data:`PROGRAM_KEY`). It never
changes the graph.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from backends.common.lower_ir import lower_ir
from passes.base import Pass, PassContext, register_pass
from passes.legalize import resolve_march
from qir.ir.graph import Graph
from qir.ir.types import has_unknown_dims

__all__ = ["EXAMPLE_INPUTS_KEY", "PROGRAM_KEY", "Lower"]

#: ``ctx.options`` key of the lowered :class:`~backends.common.program.Program`.
PROGRAM_KEY = "lower.program"
#: ``ctx.options`` key the pass reads the example inputs from (a tensor or a tuple / list of them).
EXAMPLE_INPUTS_KEY = "example_inputs"


def _march_option(v: Any) -> str | None:
    from passes.legality_registry import normalize_march

    return None if v is None or v == "" else normalize_march(v)


def _opt_option(v: Any) -> int:
    level = int(v)
    if not 0 <= level <= 3:
        raise ValueError(f"lower: opt must be 0..3, got {v!r}")
    return level


@register_pass
@attrs.frozen
class Lower(Pass):
    """Lower the graph to the march's integer kernels; the Program goes to ``ctx.options['lower.program']``.

    Options: ``march`` (default: ``ctx.options['march']``, then ``qir.march.get_march()``),
    ``opt`` (``>= 2`` times every exact engine of each conv / linear and keeps the fastest;
    0 / 1 take the march's preference order).
    """

    name: ClassVar[str] = "lower"
    summary: ClassVar[str] = "lower the integer graph to a march's kernel Program (never rewrites)"

    march: str | None = attrs.field(default=None, converter=_march_option)
    opt: int = attrs.field(default=2, converter=_opt_option)

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        if EXAMPLE_INPUTS_KEY not in ctx.options:
            raise ValueError(
                f"lower needs example inputs in ctx.options[{EXAMPLE_INPUTS_KEY!r}] (a tensor or a tuple of "
                "tensors): every kernel runs once on them while lowering"
            )
        unknown = next((v for v in (*graph.inputs, *graph.nodes) if has_unknown_dims(v.type)), None)
        if unknown is not None:  # the artifact's buffers are sized from the graph's shapes
            raise ValueError(
                f"lower needs every size known, but %{unknown.name} is {unknown.type} (a graph typed without "
                "example inputs): type it from the example inputs first (compile_model traces the converted "
                "model on them)"
            )
        examples = ctx.options[EXAMPLE_INPUTS_KEY]
        inputs = (examples,) if isinstance(examples, torch.Tensor) else tuple(examples)
        with torch.no_grad():
            program = lower_ir(graph, inputs, resolve_march(self.march, ctx), self.opt)
        ctx.options[PROGRAM_KEY] = program
        ctx.count("lower.instructions", len(program.instructions))
        return False
