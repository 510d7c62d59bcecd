"""``quantize``: the convert step as a pass — QAT ops become integer ops.

Each QAT op (``qat_conv``, ``qat_quant_stub``, ``qat_dequant_stub``: :mod:`qir.ir.ops.qat`)
is replaced by the integer op its conversion rule builds (``qconv``, ``qquant_stub``,
``qdequant_stub``) from the op, its state tensors, the scales of its inputs and the march:
int32 bias at ``s_in * s_w``, the integer multiplier / shift of the march's requantization.
The rules are registered by op name with :func:`register_quantize_rule` by the layer that
defines the integer modules (``qir.nn.quantized``, whose ``from_qat`` conversions they reuse),
so this pass imports no module library.

Scales flow through the graph in the types: an integer op's result type carries its output
``QuantSpec``, and the layout ops between layers (ops with the
:class:`~qir.ir.op.MovesCodes` trait: reshape, permute, getitem, repeat, ...) are retyped to
carry their input's, so a rule reads each input's scale from its operand type.
The integer state replaces the QAT state under the same state-dict prefix (``conv.weight``
is the int8 weight afterwards); the graph leaves training mode.

The pass covers a graph when every value it touches is one of these; :func:`uncovered` lists
the nodes it does not (``convert_fx`` then converts by module swapping and says why). Run
on such a graph the pass raises :class:`QuantizeError` naming the first one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import attrs
import torch

from passes.base import Pass, PassContext, add_state_constant, drop_unused_constants, read_state, register_pass
from passes.legalize import resolve_march
from qir.ir.graph import Graph, Node, Value
from qir.ir.op import IRError, MovesCodes, Op
from qir.ir.ops.core import Constant
from qir.ir.ops.qat import QATModuleOp
from qir.ir.types import DType, QuantSpec, SequenceType, TensorType, Type

__all__ = [
    "QUERY_OPS",
    "SPLIT_OPS",
    "Quantize",
    "QuantizeError",
    "QuantizeRule",
    "register_quantize_rule",
    "uncovered",
]

#: rule(op, state tensors by role, input scales (float32 tensors), march) -> (integer op, its state by role)
QuantizeRule = Callable[
    [QATModuleOp, dict[str, torch.Tensor], list[torch.Tensor], str], tuple[Op, dict[str, torch.Tensor]]
]

_RULES: dict[str, QuantizeRule] = {}

#: ops that split codes into a tuple of codes at the input's scale (``y.chunk(2, 1)``); a
#: ``getitem`` of their result moves codes of the tuple
SPLIT_OPS = frozenset({"split", "chunk", "unbind"})
#: ops that read only the shape of codes (``x.size(1)``; ``x.shape`` is a ``getattr``)
QUERY_OPS = frozenset({"size", "dim", "numel"})


class QuantizeError(IRError):
    """The graph holds a node the ``quantize`` pass has no rule for; the message names it."""


def register_quantize_rule(op_name: str, rule: QuantizeRule) -> None:
    """Convert nodes of the QAT op ``op_name`` with ``rule`` (called by ``qir.nn.quantized``)."""
    _RULES[op_name] = rule


def uncovered(graph: Graph) -> list[tuple[str, str]]:
    """``(node, reason)`` for each node the pass cannot convert (empty: it converts the whole graph).

    Only values the QAT ops make codes count: an already-integer graph is covered (nothing to do)."""
    return _walk(graph)[1]


def _walk(graph: Graph) -> tuple[list[Node], list[tuple[str, str]]]:
    """The layout nodes that carry codes after conversion, and the nodes the pass cannot convert."""
    out: list[tuple[str, str]] = []
    layout: list[Node] = []
    quantized: set[Value] = set()  # values that are codes after conversion
    for n in graph.nodes:
        op = n.op
        if isinstance(op, Constant):
            continue
        if isinstance(op, QATModuleOp):
            if op.name not in _RULES:
                out.append((n.name, f"op {op.name!r} has no quantize rule (import qir.nn.quantized registers qir's)"))
            elif op.makes_codes:
                quantized.add(n)
            continue
        if not any(v in quantized for v in n.operands):
            continue
        if op.name in QUERY_OPS or (op.name == "getattr" and op.attr in ("shape", "ndim")):  # type: ignore[attr-defined]
            continue  # sizes of the codes are the float tensor's: numbers, not codes
        tensors = [v for v in n.operands if isinstance(v.type, TensorType)]
        if (op.has_trait(MovesCodes) or op.name in SPLIT_OPS) and (len(tensors) == 1 or _item_of_codes(n, quantized)):
            quantized.add(n)
            layout.append(n)
            continue
        what = f"call of {op.target!r}" if op.name == "call" else f"op {op.name!r}"  # type: ignore[attr-defined]
        out.append((n.name, f"{what} on quantized values has no quantize rule"))
    return layout, out


def _input_scale(node: Node, v: Value) -> torch.Tensor:
    t = v.type
    if not isinstance(t, TensorType) or t.quant is None:
        raise QuantizeError(f"%{node.name}: input %{v.name} has no scale ({t}); it must come from a quantized layer")
    scale = torch.tensor(t.quant.scale, dtype=torch.float32)
    if t.quant.axis is not None and t.rank:
        # per channel (a qint32 accumulator): shaped to broadcast from its axis, as the layer keeps it
        scale = scale.reshape([scale.numel()] + [1] * (t.rank - 1 - t.quant.axis % t.rank))
    return scale


def _item_of_codes(n: Node, quantized: set[Value]) -> bool:
    """``n`` is a ``getitem`` of a tuple of codes (a split's result)."""
    return n.op.name == "getitem" and n.operands[0] in quantized and isinstance(n.operands[0].type, SequenceType)


def _moved(n: Node) -> Value:
    """The value a layout node moves: the tuple a ``getitem`` indexes, else its one tensor operand."""
    if n.op.name == "getitem" and isinstance(n.operands[0].type, SequenceType):
        return n.operands[0]
    return next(v for v in n.operands if isinstance(v.type, TensorType))


def _codes_spec(t: Type) -> tuple[DType, QuantSpec] | None:
    """The dtype and spec of the codes a value holds (a tensor, or a tuple of codes at one spec)."""
    if isinstance(t, TensorType):
        return None if t.quant is None else (t.dtype, t.quant)
    if isinstance(t, SequenceType):
        specs = {_codes_spec(e) for e in t.elements}
        return specs.pop() if len(specs) == 1 else None
    return None


def _as_codes(t: Type, dtype: DType, spec: QuantSpec) -> Type:
    """``t`` retyped as codes of ``dtype`` at ``spec`` (each tensor of a tuple)."""
    if isinstance(t, TensorType):
        return TensorType(t.shape, dtype, spec)
    if isinstance(t, SequenceType):
        return SequenceType(tuple(_as_codes(e, dtype, spec) for e in t.elements), t.kind)
    return t


@register_pass
@attrs.frozen
class Quantize(Pass):
    """Replace every QAT op by its integer op, converted for ``march`` (default: ``ctx.options['march']``,
    then ``qir.march.get_march()``).

    Reports ``quantize.converted`` in the context's stats.
    """

    name: ClassVar[str] = "quantize"
    summary: ClassVar[str] = "QAT ops -> integer ops (int32 bias, integer multiplier / shift)"

    march: str | None = None

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        layout, bad = _walk(graph)
        if bad:
            node, why = bad[0]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise QuantizeError(f"quantize: %{node}: {why}{more}")
        if not any(isinstance(n.op, QATModuleOp) for n in graph.nodes):
            return False  # nothing to convert (an integer or float graph)
        march = resolve_march(self.march, ctx)
        if march in ("", "none"):
            raise QuantizeError("quantize needs a march: quantize{march=bayes}, or qir.march.set_march(...) first")
        converted = 0
        moves = set(layout)
        for n in list(graph.nodes):
            op = n.op
            if isinstance(op, QATModuleOp):
                self._convert(graph, n, op, str(march))
                converted += 1
            elif n in moves:
                moved = _moved(n).type
                index = getattr(n.op, "index", None)
                if n.op.name == "getitem" and isinstance(moved, SequenceType) and isinstance(index, int):
                    n.type = moved.elements[index]  # one result of a tuple-valued layer (h' or c')
                    continue
                src = _codes_spec(moved)
                if src is not None:
                    n.type = _as_codes(n.type, *src)
        if converted:
            graph.training = False
        ctx.count("quantize.converted", converted)
        return converted > 0

    def _convert(self, graph: Graph, n: Node, op: QATModuleOp, march: str) -> None:
        where = f"quantize: %{n.name} ({op.name})"
        tensors, const_nodes = read_state(graph, op.param_roles(), op.module_params(n.operands), where, QuantizeError)
        inputs = op.module_inputs(n.operands)
        # one scale per code tensor (a run-time number or size has none)
        scales = [_input_scale(n, v) for v in inputs if isinstance(v.type, TensorType)] if op.reads_codes else []
        try:
            new_op, new_state = _RULES[op.name](op, tensors, scales, march)
        except (ValueError, TypeError, NotImplementedError) as e:
            where = f" (module {n.scope})" if n.scope else ""
            raise QuantizeError(f"quantize: %{n.name}{where}: {e}") from e
        bind = getattr(new_op, "bind_call", None)
        if bind is not None:  # as the front end binds it: a layer keeping its input's dtype reads the codes'
            call = getattr(op, "module_call", None)  # the call's form (an LSTM cell's ``(x, (h, c))``)
            args, kwargs = call(inputs) if call is not None else (list(inputs), {})
            try:
                new_op, _ = bind(list(args), dict(kwargs))
            except IRError as e:
                raise QuantizeError(f"quantize: %{n.name}: {e}") from e
        name, scope = n.name, n.scope
        typed = getattr(new_op, "typed_result", None)  # each element's spec of a tuple-valued layer
        new_type = typed(n.type) if typed is not None else n.type
        new = graph.create_node(new_op, list(inputs), new_type, name=f"{name}_q", scope=scope)
        graph.insert_node(new, after=n)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        drop_unused_constants(graph, const_nodes.values())
        graph.rename(new, name)
        prefix = f"{scope}." if scope else ""
        params = [add_state_constant(graph, prefix + role, t, QuantizeError) for role, t in new_state.items()]
        new.set_operands([*inputs, *params])
