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

Float ops that run on codes (``clamp``, ``pad``, ``relu``, ``max``, a float32 ``cast``, ...) follow the
*code rule* registered for their op name (:func:`register_code_rule`): the rule gives the op that
computes the same thing on codes (the op as written, an integer form with its constants as codes,
or nothing: an identity on codes), and the pass retypes the result with the input's spec. The
rules, like the layer rules, are the ones module swapping applies (``qir.nn.quantized``).

A call of a function the user keeps opaque (``qir.utils.fx_helper.wrap``: post-processing such as
anchor decoding, score thresholds, top-k) is a float call: each quantized value it receives goes
through a generated dequant stub (``_generated_wrap_dequant_<k>``, one per value, shared by the
calls that read it), so the function gets ``codes * scale`` in float32, the QAT model's values, as
module swapping gives it; its results are float. Which callables are such calls is registered with
:func:`register_float_call` (this pass imports no ``qir.utils``).

The pass covers a graph when every value it touches is one of these; :func:`uncovered` lists
the nodes it does not (``convert_fx`` then converts by module swapping and says why). Run
on such a graph the pass raises :class:`QuantizeError` naming the first one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from passes.base import Pass, PassContext, add_state_constant, drop_unused_constants, read_state, register_pass
from passes.legalize import resolve_march
from passes.one_thread import one_intra_op_thread
from qir.ir.graph import Graph, Node, Value
from qir.ir.op import IRError, ModuleOp, MovesCodes, Op
from qir.ir.ops.core import Call, Constant, GetItem
from qir.ir.ops.qat import QATDequantStub, QATModuleOp
from qir.ir.spec_flow import as_codes
from qir.ir.types import QuantSpec, SequenceType, TensorType, Type

__all__ = [
    "CodeRule",
    "OnCodes",
    "Quantize",
    "QuantizeError",
    "QuantizeRule",
    "WRAP_DEQUANT_PREFIX",
    "code_rule_covers_module",
    "register_code_rule",
    "register_float_call",
    "register_quantize_rule",
    "uncovered",
]

#: rule(op, state tensors by role, input scales (float32 tensors), march) -> (integer op, its state by role)
QuantizeRule = Callable[
    [QATModuleOp, dict[str, torch.Tensor], list[torch.Tensor], str], tuple[Op, dict[str, torch.Tensor]]
]

_RULES: dict[str, QuantizeRule] = {}


@attrs.frozen
class OnCodes:
    """What a float op computes on codes after conversion (a :data:`CodeRule`'s answer).

    ``op``: the op to run on the codes, with the node's operands (the node's own op when it is
    exact on codes as written); None: the op is an identity on codes and the node is removed.
    ``objects``: the callables ``op`` names (an opaque ``call``'s target), added to the graph's."""

    op: Op | None
    objects: Mapping[str, Any] = attrs.field(factory=dict)


#: rule(op, operand types, carrying the codes' specs) -> OnCodes; raises ValueError / TypeError
#: naming the fix when the op has no exact form on those codes
CodeRule = Callable[[Op, Sequence[Type]], OnCodes]

_CODE_RULES: dict[str, tuple[CodeRule, bool]] = {}


_FLOAT_CALLS: list[Callable[[Any], bool]] = []

#: generated dequant stubs in front of float calls are named ``<prefix><k>`` (module swapping's names)
WRAP_DEQUANT_PREFIX = "_generated_wrap_dequant_"


class QuantizeError(IRError):
    """The graph holds a node the ``quantize`` pass has no rule for; the message names it."""


def register_quantize_rule(op_name: str, rule: QuantizeRule) -> None:
    """Convert nodes of the QAT op ``op_name`` with ``rule`` (called by ``qir.nn.quantized``)."""
    _RULES[op_name] = rule


def register_code_rule(op_name: str, rule: CodeRule, *, modules: bool = False) -> None:
    """Convert nodes of the float op ``op_name`` whose operands are codes with ``rule`` (called by
    ``qir.nn.quantized``). ``modules``: the rule also covers the op's module form (``nn.ConstantPad2d``
    left float by prepare); otherwise only its functional and method calls."""
    _CODE_RULES[op_name] = (rule, modules)


def code_rule_covers_module(op_name: str) -> bool:
    """Whether a module of the float op ``op_name`` called on codes converts by its code rule."""
    entry = _CODE_RULES.get(op_name)
    return entry is not None and entry[1]


def register_float_call(is_float_call: Callable[[Any], bool]) -> None:
    """Opaque function calls whose callable satisfies ``is_float_call`` run in float on dequantized
    inputs (``qir.nn.quantized`` registers ``fx_helper.wrap``-ed functions and methods)."""
    if is_float_call not in _FLOAT_CALLS:
        _FLOAT_CALLS.append(is_float_call)


def _is_float_call(graph: Graph, op: Op) -> bool:
    if not isinstance(op, Call) or op.kind != "function":
        return False
    fn = graph.objects.get(op.target)
    return fn is not None and any(pred(fn) for pred in _FLOAT_CALLS)


def uncovered(graph: Graph) -> list[tuple[str, str]]:
    """``(node, reason)`` for each node the pass cannot convert (empty: it converts the whole graph).

    Only values the QAT ops make codes count: an already-integer graph is covered (nothing to do)."""
    return _walk(graph).bad


@attrs.frozen
class _Plan:
    """What the pass does beyond the QAT ops: retype ``layout`` nodes, convert ``on_codes`` nodes
    by their code rules, dequantize the quantized inputs of ``float_calls``; ``bad``: what it cannot.
    ``quantized``: the values that are codes after conversion."""

    layout: list[Node]
    on_codes: list[Node]
    float_calls: list[Node]
    bad: list[tuple[str, str]]
    quantized: set[Value]


def _walk(graph: Graph) -> _Plan:
    """The pass's plan for ``graph``: one walk over its nodes in order."""
    out: list[tuple[str, str]] = []
    layout: list[Node] = []
    on_codes: list[Node] = []
    float_calls: list[Node] = []
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
        if op.reads_only_shape():
            continue  # sizes of the codes are the float tensor's: numbers, not codes
        tensors = [v for v in n.operands if isinstance(v.type, TensorType)]
        if op.has_trait(MovesCodes) and (len(tensors) == 1 or _item_of_codes(n, quantized)):
            if _holds_floats(n.type):  # the indices of a (values, indices) pair are exact, not codes
                quantized.add(n)
            layout.append(n)
            continue
        if _is_float_call(graph, op):  # runs in float: its quantized inputs are dequantized, its results float
            pairs = [v for v in n.operands if v in quantized and not isinstance(v.type, TensorType)]
            if pairs:
                what = f"wrapped function {op.target!r}"  # type: ignore[attr-defined]
                out.append((n.name, f"{what} receives the whole tuple %{pairs[0].name}; pass its tensors one by one"))
            float_calls.append(n)
            continue
        entry = _CODE_RULES.get(op.name)
        if entry is not None and (entry[1] or not (isinstance(op, ModuleOp) and n.scope)):
            if _holds_floats(n.type):  # an argmax's indices, a comparison's booleans: exact values
                quantized.add(n)
            on_codes.append(n)
            continue
        what = f"call of {op.target!r}" if op.name == "call" else f"op {op.name!r}"  # type: ignore[attr-defined]
        out.append((n.name, f"{what} on quantized values has no quantize rule"))
    return _Plan(layout, on_codes, float_calls, out, quantized)


def _holds_floats(t: Type) -> bool:
    """Whether ``t`` is, or holds, a float tensor (what becomes codes after conversion)."""
    if isinstance(t, TensorType):
        return t.dtype.is_float
    if isinstance(t, SequenceType):
        return any(_holds_floats(e) for e in t.elements)
    return False


def _input_scale(node: Node, v: Value) -> torch.Tensor:
    t = v.type
    if not isinstance(t, TensorType) or t.quant is None:
        raise QuantizeError(f"%{node.name}: input %{v.name} has no scale ({t}); it must come from a quantized layer")
    scale = torch.tensor(t.quant.scale, dtype=torch.float32)
    if t.quant.axis is not None and t.rank:
        # per channel (a qint32 accumulator): shaped to broadcast from its axis, as the layer keeps it
        scale = scale.reshape([scale.numel()] + [1] * (t.rank - 1 - t.quant.axis % t.rank))
    return scale


def _reads_codes(op: QATModuleOp, index: int, v: Value) -> bool:
    """Input ``index`` of ``op`` is codes whose scale the rule reads (a RoIAlign's float boxes are not)."""
    if not isinstance(v.type, TensorType):
        return False  # a run-time number or size
    reads = op.reads_codes_at(index)
    return v.type.quant is not None if reads is None else reads


def _item_of_codes(n: Node, quantized: set[Value]) -> bool:
    """``n`` is a ``getitem`` of a tuple of codes (a split's result)."""
    return isinstance(n.op, GetItem) and n.operands[0] in quantized and isinstance(n.operands[0].type, SequenceType)


def _moved(n: Node) -> Value:
    """The value a layout node moves: the tuple a ``getitem`` indexes, else its one tensor operand."""
    if isinstance(n.op, GetItem) and isinstance(n.operands[0].type, SequenceType):
        return n.operands[0]
    return next(v for v in n.operands if isinstance(v.type, TensorType))


def _codes_spec(t: Type) -> QuantSpec | None:
    """The spec of the codes a value holds (a tensor, or a tuple of codes at one spec)."""
    if isinstance(t, TensorType):
        return t.quant
    if isinstance(t, SequenceType):
        specs = {_codes_spec(e) for e in t.elements}
        return specs.pop() if len(specs) == 1 else None
    return None


def _module_paths(graph: Graph) -> set[str]:
    """The module paths the graph uses: node scopes, state-dict owners, kept module objects."""
    used: set[str] = set()
    for n in graph.nodes:
        if n.scope:
            used.add(n.scope)
        if isinstance(n.op, Constant):
            used.add(n.op.key.rpartition(".")[0])
    used.update(k.removeprefix("module:") for k in graph.objects if isinstance(k, str) and k.startswith("module:"))
    return used


def _dequantize_float_call_inputs(graph: Graph, calls: list[Node], quantized: set[Value]) -> None:
    """A generated ``qat_dequant_stub`` after each QAT-produced value a float call reads (converted
    with the other QAT ops), named and numbered as module swapping names its stubs."""
    if not calls:
        return
    used = _module_paths(graph)
    made: dict[Value, Node] = {}
    k = 0
    for call in calls:
        for v in call.operands:
            if v not in quantized:
                continue
            if v not in made:
                while f"{WRAP_DEQUANT_PREFIX}{k}" in used:
                    k += 1
                path = f"{WRAP_DEQUANT_PREFIX}{k}"
                used.add(path)
                stub = graph.create_node(QATDequantStub(), [v], v.type, name=path, scope=path)
                graph.insert_node(stub, after=v)  # type: ignore[arg-type]  # a quantized value is a node's
                made[v] = stub
            call.replace_operand(v, made[v])


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
        plan = _walk(graph)
        bad = plan.bad
        if bad:
            node, why = bad[0]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise QuantizeError(f"quantize: %{node}: {why}{more}")
        if not any(isinstance(n.op, QATModuleOp) for n in graph.nodes):
            return False  # nothing to convert (an integer or float graph)
        march = resolve_march(self.march, ctx)
        if march in ("", "none"):
            raise QuantizeError("quantize needs a march: quantize{march=bayes}, or qir.march.set_march(...) first")
        _dequantize_float_call_inputs(graph, plan.float_calls, plan.quantized)
        converted = 0
        moves, rules = set(plan.layout), set(plan.on_codes)
        # the rules' passes over each weight run on one thread, set once for the graph (one_thread.py says why)
        with one_intra_op_thread():
            for n in list(graph.nodes):
                op = n.op
                if isinstance(op, QATModuleOp):
                    self._convert(graph, n, op, str(march))
                    converted += 1
                elif n in moves:
                    moved = _moved(n).type
                    if isinstance(op, GetItem) and isinstance(moved, SequenceType) and isinstance(op.index, int):
                        n.type = moved.elements[op.index]  # the item as retyped: a split's piece, a layer's h' or c'
                        continue
                    src = _codes_spec(moved)
                    if src is not None:
                        n.type = as_codes(n.type, src, floats=True)
                elif n in rules:
                    self._on_codes(graph, n)
        if converted:
            graph.training = False
        ctx.count("quantize.converted", converted)
        return converted > 0

    def _on_codes(self, graph: Graph, n: Node) -> None:
        """Convert float op ``n`` on codes by its code rule: its codes' op, its result retyped as
        codes of its (first) codes operand's spec, or the node removed when it is an identity."""
        rule, _ = _CODE_RULES[n.op.name]
        codes = next((v for v in n.operands if _codes_spec(v.type) is not None), None)
        if codes is None:
            raise QuantizeError(f"quantize: %{n.name} ({n.op.name}): none of its operands has a scale")
        try:
            on = rule(n.op, [v.type for v in n.operands])
        except (ValueError, TypeError, NotImplementedError) as e:
            raise QuantizeError(f"quantize: %{n.name} ({n.op.name}): {e}") from e
        if on.op is None:  # an identity on codes (a float32 cast: the fake-quantized values were float already)
            n.replace_all_uses_with(codes)
            graph.erase_node(n)
            return
        graph.objects.update(on.objects)
        n.op = on.op
        n.type = as_codes(n.type, _codes_spec(codes.type), floats=True)  # type: ignore[arg-type]

    def _convert(self, graph: Graph, n: Node, op: QATModuleOp, march: str) -> None:
        where = f"quantize: %{n.name} ({op.name})"
        tensors, const_nodes = read_state(graph, op.param_roles(), op.module_params(n.operands), where, QuantizeError)
        inputs = op.module_inputs(n.operands)
        # one scale per code tensor (a run-time number or size has none)
        scales = [_input_scale(n, v) for i, v in enumerate(inputs) if _reads_codes(op, i, v)]
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
