"""``insert-observers``: the prepare step as a pass — float layers become QAT ops.

Each node whose scope (module path) the options name is replaced by the QAT op its
observer rule builds (``conv2d`` -> ``qat_conv``, ``max_pool2d`` -> ``qat_max_pool2d``, the
input ``QuantStub`` call -> ``qat_quant_stub``, a FloatFunctional's ``add`` ->
``qat_functional``, ...), with that module's resolved qconfig: the weight fake quant and the
output fake quant as :class:`~qir.ir.ops.qat.FakeQuantSpec` data. The rules are registered
per float op name, per opaque module class, or per FloatFunctional class (its method nodes:
the rule gets a :class:`MethodCall`) with :func:`register_observer_rule` by the layer
that defines the QAT modules (``qir.nn.qat``, whose ``from_float`` they reuse), so this pass
imports no module library and the trainable model it leads to computes what module swapping
builds.

Options are plain data, so the pass prints and parses back:

* ``fake_quants``: the distinct fake quants, each the IR text of a ``FakeQuantSpec``;
* ``qconfigs``: ``[[scope, activation, weight], ...]``; ``activation`` / ``weight`` index
  ``fake_quants``, or are ``none`` (no such fake quant: a high-precision output).
  Which module gets which qconfig (``""``, ``module_type``, ``module_name``, ``.qconfig``
  attributes, hybrid placement) is decided by the public driver (``prepare_qat_fx``) before
  the pass runs; a node whose scope is not listed stays float.
* ``call_sites``: ``[[scope, [site, ...]], ...]``: a module called at several places gets a
  QAT op per call; call ``k`` (``k`` >= 1, graph order) takes scope ``sites[k - 1]``. The
  call sites share the first call's weight, bias and weight fake quant (constants), and
  each has its own output fake quant (``activation_post_process.*``; the roles the QAT op's
  ``own_per_site`` names): one observer per call.

A float tensor two layers share (one constant operand of both, or a parameter of an opaque
call's module: a conv + batch norm called twice, fused into a ConvReLU2d at one call and a
ConvAdd2d at the other) stays one tensor: the second layer's QAT op takes the first one's QAT
parameter of that role, as module swapping ties them. An opaque module sharing a tensor that
becomes no role of its QAT op is refused.

The new state (weight, bias, every fake-quant buffer) is added as constants keyed by
state-dict name under the node's scope (``conv.weight_fake_quant.scale``), so emitting the
graph rebuilds the trainable modules with the keys module swapping gives them. A rule that
returns the QAT module it built too has it kept in the new node's ``meta`` for emit to install
(:mod:`qir.ir.prebuilt`): each layer is built once, as module swapping builds it. An opaque
call's op is bound to the call afterwards (``bind_call``: a RoIAlign's box list, an
AnchorGenerator's level count, a run-time resize size); binding sets only the call's form, which no
module builder reads, so the module is kept for the bound op.
:func:`uncovered` lists the listed nodes no rule converts (``prepare_qat_fx`` then prepares
the whole model by module swapping and says why); run on them, the pass raises
:class:`InsertObserversError` naming the first.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from passes.base import Pass, PassContext, add_state_constant, drop_unused_constants, read_state, register_pass
from qir.ir.graph import Graph, Node, Value
from qir.ir.op import IRError, ModuleOp, Op, resolve
from qir.ir.ops.core import Call, Constant
from qir.ir.ops.qat import FakeQuantSpec, QATModuleOp
from qir.ir.parser import parse_value
from qir.ir.prebuilt import PREBUILT_MODULE_KEY, PrebuiltModule
from qir.ir.printer import format_value

__all__ = [
    "InsertObservers",
    "InsertObserversError",
    "MethodCall",
    "ObserveRule",
    "fake_quant_text",
    "params_by_role",
    "register_observer_rule",
    "tensor_key",
    "uncovered",
]

#: rule(float op, module object of an opaque call (a :class:`MethodCall` for a FloatFunctional
#: method node) or None, float state by role, activation fake quant, weight fake quant)
#: -> (QAT op, its state by role) or (QAT op, its state by role, the QAT module it was read from);
#: the QAT op takes the node's operands in their order. A rule that gives the module spares emit
#: building it again (:mod:`qir.ir.prebuilt`: used only while op and state are still the same)
ObserveRule = Callable[
    [Op, Any, dict[str, torch.Tensor], FakeQuantSpec | None, FakeQuantSpec | None],
    tuple[QATModuleOp, dict[str, torch.Tensor]] | tuple[QATModuleOp, dict[str, torch.Tensor], torch.nn.Module],
]

#: float op name or opaque module class -> rule
_RULES: dict[str | type, ObserveRule] = {}


class InsertObserversError(IRError):
    """A node the options name cannot get observers; the message names it and why."""


@attrs.frozen
class MethodCall:
    """What a rule registered for a FloatFunctional class gets for one of its method nodes (the
    front end's ``meta["float_functional"]``): the module object, the method called and how
    many operands the node has (the QAT op takes them in their order)."""

    module: Any
    method: str
    operands: int


def register_observer_rule(key: str | type, rule: ObserveRule) -> None:
    """Give nodes of float op ``key`` (an op name), or opaque calls of modules of class ``key`` (or
    of the class whose ``module.qualname`` is ``key``: an optional library's, never imported),
    observers with ``rule`` (called by ``qir.nn.qat``)."""
    _RULES[key] = rule


def fake_quant_text(spec: FakeQuantSpec) -> str:
    """A fake quant as the pass's ``fake_quants`` option spells it (IR attribute text)."""
    return format_value(spec)


def _fake_quant(text: str, index: int) -> FakeQuantSpec:
    try:
        value = parse_value(text)
    except IRError as e:
        raise InsertObserversError(f"insert-observers: fake_quants[{index}] {text!r}: {e}") from None
    if not isinstance(value, FakeQuantSpec):
        raise InsertObserversError(f"insert-observers: fake_quants[{index}] must be a FakeQuantSpec(...), got {text!r}")
    return value


def _module_object(graph: Graph, n: Node) -> Any:
    op = n.op
    if isinstance(op, Call) and op.kind == "module":
        return graph.objects.get(f"module:{op.target}")
    return None


def _rule(graph: Graph, n: Node) -> tuple[ObserveRule | None, Any, str]:
    """The node's rule, its module object (opaque calls; a :class:`MethodCall` for a
    FloatFunctional method) and what the node is, for messages."""
    obj = _module_object(graph, n)
    if obj is not None:
        cls = type(obj)
        return _RULES.get(cls) or _RULES.get(f"{cls.__module__}.{cls.__qualname__}"), obj, f"module {cls.__name__}"
    op = n.op
    # a FloatFunctional method: its float op, or an opaque call of it when it has none (add_relu)
    method = n.meta.get("float_functional")
    ff = graph.objects.get(f"module:{n.scope}") if method else None
    if ff is not None:
        call = MethodCall(ff, str(method), len(n.operands))
        return _RULES.get(type(ff)), call, f"{type(ff).__name__}.{method} (op {op.name!r})"
    if isinstance(op, Call):
        return None, None, f"call of {op.target!r}"
    if isinstance(op, QATModuleOp):
        return None, None, f"op {op.name!r} (already a QAT op)"
    return _RULES.get(op.name), None, f"op {op.name!r}"


def uncovered(graph: Graph, scopes: Mapping[str, Any] | set[str]) -> list[tuple[str, str]]:
    """``(node, reason)`` for each node with a scope in ``scopes`` that no rule converts, and
    each scope no node has (empty: the pass converts every listed module)."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for n in graph.nodes:
        if n.scope is None or n.scope not in scopes or isinstance(n.op, Constant):
            continue
        seen.add(n.scope)
        rule, _, what = _rule(graph, n)
        if rule is None:
            out.append((n.name, f"{what} at '{n.scope}' has no observer rule (register_observer_rule)"))
    for scope in scopes:
        if scope not in seen:
            out.append((scope, f"module '{scope}' is not called in the graph as a layer of its own"))
    return out


#: where the float state of the converted layers waits while the pass runs
_ASIDE = "_qir_float_state."


def _move_float_state(graph: Graph, specs: Mapping[str, Any]) -> dict[str, str]:
    """Re-key the constant operands of the listed layers under :data:`_ASIDE` (one rebuild of
    ``graph.constants``, keeping its order); returns new key -> old key."""
    renames: dict[str, str] = {}
    for n in graph.nodes:
        if n.scope is None or n.scope not in specs or not isinstance(n.op, ModuleOp):
            continue
        for v in n.op.module_params(n.operands):
            if isinstance(v, Node) and isinstance(v.op, Constant) and not v.op.key.startswith(_ASIDE):
                renames[v.op.key] = _ASIDE + v.op.key
                v.op = attrs.evolve(v.op, key=_ASIDE + v.op.key)
    if renames:
        graph.constants = {renames.get(k, k): t for k, t in graph.constants.items()}
    return {new: old for old, new in renames.items()}


def _restore_float_state(graph: Graph, moved: Mapping[str, str]) -> None:
    """Give float constants some other (float) node still reads their keys back."""
    back: dict[str, str] = {}
    for n in graph.nodes:
        op = n.op
        if isinstance(op, Constant) and op.key in moved:
            old = moved[op.key]
            if old in graph.constants:
                raise InsertObserversError(
                    f"insert-observers: the float tensor {old!r} is read by a layer that stays float and by one "
                    "whose QAT state now has that key; give the float layer its own tensor"
                )
            back[op.key] = old
            n.op = attrs.evolve(op, key=old)
    if back:
        graph.constants = {back.get(k, k): t for k, t in graph.constants.items()}


def _bind_call(new_op: QATModuleOp, call: Call, operands: Sequence[Value]) -> tuple[QATModuleOp, list[Value]]:
    """The QAT op and its inputs for an opaque module call's arguments, as the front end binds a
    QAT module's call: the op's ``bind_call`` (a run-time size), else graph values only, in order."""
    args, kwargs = resolve(call.args, list(operands)), resolve(call.kwargs, list(operands))
    bind = getattr(new_op, "bind_call", None)
    if bind is not None:
        bound, inputs = bind(list(args), dict(kwargs))
        return bound, list(inputs)
    if kwargs or not all(isinstance(a, Value) for a in args):
        raise NotImplementedError(f"{new_op.name} takes graph values only; the call passes {call.args!r} {kwargs!r}")
    return new_op, list(args)


def _tensor_owners(graph: Graph) -> dict[int, set[int]]:
    """Storage pointer -> who holds a tensor there: ``id`` of each module object of an opaque
    call, and 0 for the graph's constants. Built once per run of the pass, before any layer is
    converted, so a tensor a converted layer read still counts (one pass over the graph's
    state instead of one per opaque call)."""
    owners: dict[int, set[int]] = {}
    for t in graph.constants.values():
        if t.numel():
            owners.setdefault(t.data_ptr(), set()).add(0)
    for key, obj in graph.objects.items():
        if key.startswith("module:") and isinstance(obj, torch.nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                if t.numel():
                    owners.setdefault(t.data_ptr(), set()).add(id(obj))
    return owners


def tensor_key(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """What makes two float tensors one: storage address, shape and strides (module swapping
    ties the QAT parameters of such tensors, and so does this pass)."""
    return t.data_ptr(), tuple(t.shape), tuple(t.stride())


@attrs.define
class _SharedState:
    """The QAT constants made for float state that several layers hold, found again two ways."""

    #: (float constant, role) -> its QAT constant: a constant another layer reads too
    by_constant: dict[tuple[Node, str], Node] = attrs.field(factory=dict)
    #: :func:`tensor_key` of a float tensor -> (that tensor, its QAT constant): one weight two
    #: modules hold, as module swapping ties them (the tensor kept alive: its address stays its own)
    by_tensor: dict[tuple[int, tuple[int, ...], tuple[int, ...]], tuple[torch.Tensor, Node]] = attrs.field(factory=dict)


def params_by_role(module: Any, roles: Collection[str]) -> dict[str, torch.Tensor]:
    """A float module's non-empty parameters by the name each has in its QAT module, among
    ``roles`` (a fused ConvReLU2d's ``0.weight`` is ``weight``): how module swapping and this
    pass find the tensors two layers share."""
    if not isinstance(module, torch.nn.Module):
        return {}
    out: dict[str, torch.Tensor] = {}
    for fname, t in module.named_parameters(remove_duplicate=False):
        qname = fname if fname in roles else fname.split(".", 1)[-1]
        if qname in roles and t.numel():
            out[qname] = t
    return out


def _check_unshared(owners: Mapping[int, set[int]], module: Any, tied: Sequence[torch.Tensor] = ()) -> None:
    """Refuse an opaque call's module holding a tensor another layer reads that the pass does not
    tie (``tied``: the parameters that become a role of its QAT op, shared as module swapping
    shares them): its QAT state would not follow the other layer's. ``owners``: :func:`_tensor_owners`."""
    if not isinstance(module, torch.nn.Module):
        return
    me = id(module)
    ok = {t.data_ptr() for t in tied}
    for t in (*module.parameters(), *module.buffers()):
        if t.numel() and t.data_ptr() not in ok and owners.get(t.data_ptr(), set()) - {me}:
            raise NotImplementedError(
                f"{type(module).__name__} shares a tensor with another layer; module swapping ties their QAT state"
            )


@register_pass
@attrs.frozen
class InsertObservers(Pass):
    """Replace the listed layers by QAT ops with fake quants from their qconfigs.

    Reports ``insert-observers.converted`` in the context's stats.
    """

    name: ClassVar[str] = "insert-observers"
    summary: ClassVar[str] = "float layers -> QAT ops with weight / output fake quants (per-module qconfigs)"

    fake_quants: tuple[str, ...] = ()
    qconfigs: tuple[tuple[str, int | None, int | None], ...] = ()
    call_sites: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def resolved(self) -> dict[str, tuple[FakeQuantSpec | None, FakeQuantSpec | None]]:
        """scope -> (activation, weight) fake quants, parsed from the options."""
        specs = [_fake_quant(text, i) for i, text in enumerate(self.fake_quants)]

        def pick(scope: str, what: str, i: int | None) -> FakeQuantSpec | None:
            if i is None:
                return None
            if not 0 <= i < len(specs):
                raise InsertObserversError(
                    f"insert-observers: qconfigs entry {scope!r}: {what} {i} is not an index of fake_quants "
                    f"(0..{len(specs) - 1})"
                )
            return specs[i]

        return {s: (pick(s, "activation", a), pick(s, "weight", w)) for s, a, w in self.qconfigs}

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        specs = self.resolved()
        if not specs:
            return False
        bad = uncovered(graph, specs)
        if bad:
            node, why = bad[0]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise InsertObserversError(f"insert-observers: %{node}: {why}{more}")
        sites = dict(self.call_sites)
        # the float state moves aside first: a QAT layer's keys may be the float layer's own
        # (an unfused conv's ``down.0.weight``), and the float tensors go once no layer reads them
        moved = _move_float_state(graph, specs)
        owners = _tensor_owners(graph)
        calls: dict[str, int] = {}
        first: dict[str, dict[str, Node]] = {}  # scope -> role -> constant of its first call
        shared = _SharedState()
        converted = 0
        methods: set[str] = set()  # scopes of converted FloatFunctional method nodes
        for n in list(graph.nodes):
            if n.scope is None or n.scope not in specs or isinstance(n.op, Constant):
                continue
            k = calls.get(n.scope, 0)
            calls[n.scope] = k + 1
            site = n.scope
            if k:
                names = sites.get(n.scope, ())
                if len(names) < k:
                    raise InsertObserversError(
                        f"insert-observers: %{n.name}: module '{n.scope}' is called more than {len(names) + 1} "
                        "time(s) but call_sites names no scope for this call; give every call after the first one"
                    )
                site = names[k - 1]
            if self._convert(graph, n, specs[n.scope], site, first.get(n.scope), shared, first, owners):
                methods.add(n.scope)
            converted += 1
        for scope in methods:  # the float FloatFunctional: emit installs the QAT ops' modules instead
            graph.objects.pop(f"module:{scope}", None)
        _restore_float_state(graph, moved)
        ctx.count("insert-observers.converted", converted)
        return converted > 0

    def _convert(
        self,
        graph: Graph,
        n: Node,
        spec: tuple[FakeQuantSpec | None, FakeQuantSpec | None],
        site: str,
        owner: dict[str, Node] | None,
        shared: _SharedState,
        first: dict[str, dict[str, Node]],
        owners: Mapping[int, set[int]],
    ) -> bool:
        """Replace ``n`` by its QAT op; True when it was a FloatFunctional method node."""
        rule, obj, _ = _rule(graph, n)
        assert rule is not None  # uncovered() checked
        op = n.op
        if isinstance(op, ModuleOp):
            roles, params = op.param_roles(), op.module_params(n.operands)
            inputs: list[Value] = op.module_inputs(n.operands)
        else:
            roles, params, inputs = (), [], list(n.operands)
        where = f"insert-observers: %{n.name} (module {n.scope})"
        tensors, float_consts = read_state(graph, roles, params, where, InsertObserversError)
        module_params: dict[str, torch.Tensor] = {}
        try:
            new_op, state, *built = rule(op, obj, tensors, *spec)
            # binding sets only the call's form (a RoIAlign's box list, an AnchorGenerator's level
            # count, a run-time size), which no module builder reads: the module built is the bound op's
            if isinstance(op, Call):
                new_op, inputs = _bind_call(new_op, op, n.operands)
                module_params = params_by_role(obj, new_op.param_roles())
                _check_unshared(owners, obj, list(module_params.values()))
        except (ValueError, TypeError, NotImplementedError, IRError) as e:
            raise InsertObserversError(f"insert-observers: %{n.name} (module {n.scope}): {e}") from e
        if new_op.num_inputs() != len(inputs):
            raise InsertObserversError(
                f"insert-observers: %{n.name} (module {n.scope}): {new_op.name} takes {new_op.num_inputs()} "
                f"input(s), the call passes {len(inputs)}"
            )
        prefix = f"{site}." if site else ""
        consts: dict[str, Node] = {}
        for role in new_op.param_roles():
            if role not in state:
                raise InsertObserversError(f"insert-observers: %{n.name}: the rule gave no {role} for {new_op.name}")
            if owner is not None and not new_op.own_per_site(role):
                consts[role] = owner[role]  # a later call site: the first call's weight and weight fake quant
                continue
            source = float_consts.get(role)
            if source is not None and (source, role) in shared.by_constant:
                consts[role] = shared.by_constant[(source, role)]  # a float tensor another layer holds too
                continue
            # the float tensor itself: an opaque call's parameter, or the constant's tensor
            float_t = module_params.get(role, tensors.get(role) if source is not None else None)
            key = tensor_key(float_t) if float_t is not None else None
            if key is not None and key in shared.by_tensor:
                consts[role] = shared.by_tensor[key][1]  # one weight for both layers, as module swapping ties them
                continue
            consts[role] = add_state_constant(graph, prefix + role, state[role], InsertObserversError)
            if source is not None:
                shared.by_constant[(source, role)] = consts[role]
            if float_t is not None and key is not None:
                shared.by_tensor[key] = (float_t, consts[role])
        if owner is None:
            first[n.scope or ""] = consts
        name = n.name
        new = graph.create_node(
            new_op, [*inputs, *(consts[r] for r in new_op.param_roles())], n.type, name=f"{name}_qat", scope=site
        )
        graph.insert_node(new, after=n)
        new.meta.update(n.meta)
        if built:
            new.meta[PREBUILT_MODULE_KEY] = PrebuiltModule(new_op, built[0])
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        drop_unused_constants(graph, float_consts.values())
        graph.rename(new, name)
        return isinstance(obj, MethodCall)
