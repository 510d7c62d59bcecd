"""Graph well-formedness: acyclic, definitions before uses, consistent types, valid ops.

The promise: a graph :func:`verify` accepts runs under :func:`~qir.ir.run_graph` on inputs
of its declared types (benchmarks/fuzz_ir.py checks it on mutated real graphs). So besides
structure, the verifier checks what torch would otherwise reject at run time: each node's
declared type against what its op infers (tensors, and tuples / lists element by element),
operand kinds and dtypes (:mod:`qir.ir.operand_rules`), input defaults against their
declared types, opaque calls of allowlisted torch functions on meta tensors, and the values
of bound constants an op's kernel trusts (:meth:`~qir.ir.op.Op.verify_values`: requantization
multipliers and shifts, table entries, scales).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from qir.ir.graph import Argument, Graph, Node, Value
from qir.ir.op import CannotInfer, IRError, Op, Pure
from qir.ir.operand_rules import STAND_INS, check_operands, result_type, run_on_meta, same_type, value_matches
from qir.ir.stand_ins import is_stand_in
from qir.ir.types import ObjectType, QuantSpec, ScalarType, SequenceType, TensorType, Type, dims_agree
from qir.ir.unknown_dims import SIZES, any_unknown_dims, at_size, infer_type, verify_op


class VerifyError(IRError):
    """A graph failed verification. ``node`` names the offending value (when known)."""

    def __init__(self, message: str, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


def _fail(node: Value | None, msg: str) -> VerifyError:
    if node is None:
        return VerifyError(msg)
    where = f" (module {node.scope})" if isinstance(node, Node) and node.scope else ""
    return VerifyError(f"%{node.name}{where}: {msg}", node.name)


def verify(graph: Graph, check_types: bool = True) -> None:
    """Raise :class:`VerifyError` naming the first bad node; return None when the graph is sound.

    Checks: unique names, every operand defined earlier in the same graph (which also
    rules out cycles), use lists consistent with operands, op arity and per-op rules,
    constants bound (shape and dtype as declared), input defaults of their declared
    types, output values defined, and (``check_types``) that each node's declared type
    matches what its op infers where the op can infer it, operand kinds and dtypes the
    op's torch kernel needs, and opaque calls of allowlisted torch functions on meta
    tensors. Module calls need not be bound (IR text carries no modules): a verified graph
    runs once they are, and ``run_graph`` refuses an unbound one before any node runs
    (:func:`qir.ir.interpreter.check_bound`). Likewise the zeros ``parse_graph(allow_unbound=True)``
    binds are stand-ins (:mod:`qir.ir.stand_ins`): their shapes and dtypes are checked, their values
    are not, and everything that executes a graph refuses one (``StandInError``) until real tensors
    are bound.
    """
    defined: set[Value] = set()
    names: set[str] = set()
    known: dict[Value, Any] = {}  # scalars fixed by static shapes (x.shape[0]): exact meta checks
    for a in graph.inputs:
        if not isinstance(a, Argument):
            raise _fail(a, "graph input is not an Argument")
        if a.name in names:
            raise _fail(a, "name defined twice")
        if a.has_default and not value_matches(a.default, a.type):
            raise _fail(a, f"default {a.default!r} is not a value of the declared type {a.type}")
        names.add(a.name)
        defined.add(a)
    count = 0
    prev: Node | None = None
    for n in graph.nodes:
        count += 1
        if n.prev is not prev:
            raise _fail(n, "node list links are corrupt")
        prev = n
        if n.name in names:
            raise _fail(n, "name defined twice")
        names.add(n.name)
        for i, v in enumerate(n.operands):
            if v not in defined:
                if v.graph is not graph:
                    raise _fail(n, f"operand {i} %{v.name} belongs to another graph")
                raise _fail(n, f"operand {i} %{v.name} is used before it is defined (or forms a cycle)")
            if n not in v._users:
                raise _fail(n, f"operand {i} %{v.name} does not list this node as a user")
        try:
            verify_op(n.op, [v.type for v in n.operands])
        except IRError as e:
            raise _fail(n, str(e)) from None
        except Exception as e:  # an attribute of the wrong kind (axis=0.0) trips the op's own checks
            raise _fail(n, f"op {n.op.name!r} rejects its attributes: {type(e).__name__}: {e}") from None
        if n.op.name == "constant":
            key = n.op.key  # type: ignore[attr-defined]
            if key not in graph.constants:
                raise _fail(n, f"constant {key!r} has no tensor in graph.constants")
            t = graph.constants[key]
            if isinstance(n.type, TensorType):
                if tuple(t.shape) != n.type.shape:  # a bound tensor's sizes are known: no '?' here
                    raise _fail(n, f"constant {key!r} has shape {tuple(t.shape)}, declared {n.type}")
                if t.dtype != n.type.dtype.to_torch():
                    raise _fail(n, f"constant {key!r} has dtype {t.dtype}, declared {n.type}")
        else:
            if check_types:
                _check_type(n, known)
            _check_values(graph, n)
        defined.add(n)
    if count != len(graph):
        raise VerifyError(f"graph @{graph.name}: node count {len(graph)} disagrees with the list ({count})")
    for v in graph.output_values:
        if v not in defined:
            raise _fail(v, "graph output is not defined in the graph")


#: value checks that passed, by (op, operand types, each bound tensor's id and version) -> the
#: tensors (weakly: a dead tensor's id may be reused, so a hit must find the same live tensor).
#: verify runs after every pass of a pipeline; a constant no pass touched keeps its identity and
#: its version counter (which in-place torch ops bump), so it is not scanned again.
_PASSED: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], ...]] = {}
_PASSED_LIMIT = 1 << 14  # entries; past it the cache starts over (dead tensors' entries go too)


def _check_values(graph: Graph, n: Node) -> None:
    """The op's checks of its operands' bound constant values (a shift of 99, a NaN scale)."""
    if type(n.op).verify_values is Op.verify_values:  # the op checks no values
        return
    values: list[torch.Tensor | None] = []
    for v in n.operands:
        t = graph.constant_value(v)  # the constant node verified first: its key is bound
        values.append(t if t is not None and not is_stand_in(t) else None)
    bound = [t for t in values if t is not None]
    if not bound:
        return
    types = tuple(v.type for v in n.operands)
    key: tuple[Any, ...] | None = (n.op, types, tuple(None if t is None else (id(t), t._version) for t in values))
    try:
        refs = _PASSED.get(key)  # type: ignore[arg-type]
    except (TypeError, RuntimeError):  # an op attribute that does not hash or compare: check every time
        refs, key = None, None
    if refs is not None and all(r() is t for r, t in zip(refs, bound, strict=True)):
        return
    try:
        n.op.verify_values(list(types), values)
    except IRError as e:
        raise _fail(n, str(e)) from None
    if key is not None:
        if len(_PASSED) >= _PASSED_LIMIT:
            _PASSED.clear()
        _PASSED[key] = tuple(weakref.ref(t) for t in bound)


def _check_type(n: Node, known: dict[Value, Any]) -> None:
    operand_types = [v.type for v in n.operands]
    try:
        if any_unknown_dims(operand_types):  # checked at the sizes unknown dims are typed at
            for size in SIZES:
                check_operands(n.op, [at_size(t, size) for t in operand_types])
        else:
            check_operands(n.op, operand_types)
    except IRError as e:
        raise _fail(n, str(e)) from None
    try:
        inferred: Type = infer_type(n.op, operand_types, verified=True)  # verify() ran verify_op on them
    except (CannotInfer, NotImplementedError):
        _check_on_meta(n, known)  # opaque calls, scalar operands: the declared type stands unless wrong
        return
    except IRError as e:
        raise _fail(n, str(e)) from None
    except Exception as e:  # torch rejected the operand shapes on meta tensors
        raise _fail(n, f"op {n.op.name!r} rejects its operand types: {type(e).__name__}: {e}") from None
    mismatch = _mismatch(n.type, inferred)
    if mismatch is not None:
        raise _fail(n, f"declared type {n.type} but op {n.op.name!r} gives {inferred}{mismatch}")
    spec = _spec_mismatch(n.type, inferred)
    if spec is not None:
        path, declared, given = spec
        at = f" at {path}" if path else ""
        raise _fail(
            n,
            f"quant: declared {_spec_text(declared)}{at} but op {n.op.name!r} gives {_spec_text(given)} "
            "(a layout op's codes keep their operand's QuantSpec; an integer op's result has its out spec): "
            "declare the spec the op gives",
        )
    if n.op.has_trait(Pure) and isinstance(n.type, (ScalarType, SequenceType)):
        _record_known(n, known)


def _operand_values(n: Node, known: dict[Value, Any]) -> tuple[list[Any], bool] | None:
    """Meta tensors / known scalars / stand-ins for the operands, and whether all are exact."""
    values: list[Any] = []
    exact = True
    if any_unknown_dims([v.type for v in n.operands]):
        return None  # no meta tensor has an unknown size: the declared type stands
    for v in n.operands:
        t = v.type
        if isinstance(t, TensorType):
            values.append(torch.empty(t.shape, dtype=t.dtype.to_torch(), device="meta"))
        elif v in known:
            values.append(known[v])
        elif isinstance(t, ScalarType):
            values.append(STAND_INS[t.kind])
            exact = False
        elif isinstance(t, SequenceType) and t.kind != "size" and t.elements and n.op.name != "getattr":
            # a tuple of tensors where the op wants one fails on meta tensors as it would at run
            # (not for getattr: the tuple type also stands for torch's named tuples, x.max(1).values)
            tensors = [e for e in t.elements if isinstance(e, TensorType)]
            if len(tensors) != len(t.elements):
                return None
            metas = [torch.empty(e.shape, dtype=e.dtype.to_torch(), device="meta") for e in tensors]
            values.append(metas if t.kind == "list" else tuple(metas))
        else:
            return None
    return values, exact


def _record_known(n: Node, known: dict[Value, Any]) -> None:
    got = _operand_values(n, known)
    if got is None or not got[1]:
        return
    try:
        with torch.device("meta"):
            out = n.op.compute(*got[0])
    except Exception:  # not computable from metadata: stays unknown
        return
    if isinstance(out, (bool, int, float, torch.Size)) or (
        isinstance(out, tuple) and all(isinstance(o, (bool, int, float)) for o in out)
    ):
        known[n] = out


def _check_on_meta(n: Node, known: dict[Value, Any]) -> None:
    got = _operand_values(n, known)
    if got is None:
        return
    values, exact = got
    try:
        ran, out = run_on_meta(n.op, values, exact)
    except IRError as e:
        raise _fail(n, str(e)) from None
    if not ran:
        return
    if (
        isinstance(n.type, (TensorType, ScalarType))
        and isinstance(out, (torch.Tensor, bool, int, float))
        and isinstance(n.type, TensorType) != isinstance(out, torch.Tensor)
    ):  # whether a result is a tensor or a Python number follows from operand kinds alone
        raise _fail(n, f"declared type {n.type} but op {n.op.name!r} gives a {type(out).__name__}")
    if not exact:
        return
    t = result_type(out)
    if t is not None and not same_type(n.type, t):
        raise _fail(n, f"declared type {n.type} but op {n.op.name!r} gives {t}")
    if isinstance(out, (bool, int, float, torch.Size)) and n.op.has_trait(Pure):
        known[n] = out


def _mismatch(declared: Type, inferred: Type, path: str = "") -> str | None:
    """Where ``declared`` and ``inferred`` disagree ('' for the whole value), or None. An unknown
    dimension on either side agrees with any size: a declared one is the graph not knowing it, an
    inferred one the op not knowing it from unknown operands (the declared size narrows it)."""
    if isinstance(declared, TensorType) and isinstance(inferred, TensorType):
        if not dims_agree(declared.shape, inferred.shape) or declared.dtype.to_torch() != inferred.dtype.to_torch():
            return f" (at {path})" if path else ""
        return None
    if isinstance(declared, SequenceType) and isinstance(inferred, SequenceType):
        if len(declared.elements) != len(inferred.elements):
            return f" ({len(declared.elements)} elements declared, {len(inferred.elements)} produced)"
        for i, (d, t) in enumerate(zip(declared.elements, inferred.elements, strict=True)):
            m = _mismatch(d, t, f"{path}[{i}]")
            if m is not None:
                return m or f" (at {path}[{i}])"
        return None
    if isinstance(declared, TensorType) != isinstance(inferred, TensorType) and not isinstance(
        declared if isinstance(inferred, TensorType) else inferred, ObjectType
    ):
        return f" (at {path})" if path else ""  # a tensor where the op gives a tuple or a scalar, or back
    if _is_none(declared) != _is_none(inferred) and not isinstance(declared, ObjectType):
        # None is known, not an opaque object: a tensor read where the op gives None fails at run
        return f" (at {path})" if path else ""
    return None


def _spec_mismatch(declared: Type, inferred: Type, path: str = "") -> tuple[str, QuantSpec, QuantSpec] | None:
    """The first tensor (its path, declared and inferred spec) where both types carry a QuantSpec
    and the two differ, or None. A spec on one side only is not a conflict: a bare ``tensor<..xi8>``
    may stand for codes whose scale is declared upstream, and inference gives no spec where its
    operands disagree (a ``cat`` of two scales)."""
    if isinstance(declared, TensorType) and isinstance(inferred, TensorType):
        d, i = declared.quant, inferred.quant
        return (path, d, i) if d is not None and i is not None and d != i else None
    if isinstance(declared, SequenceType) and isinstance(inferred, SequenceType):
        for k, (d_el, i_el) in enumerate(zip(declared.elements, inferred.elements, strict=False)):
            found = _spec_mismatch(d_el, i_el, f"{path}[{k}]")
            if found is not None:
                return found
    return None


def _spec_text(q: QuantSpec) -> str:
    axis = "" if q.axis is None else f", axis={q.axis}"
    return (
        f"scale=[{', '.join(repr(s) for s in q.scale[:4])}{', ...' if len(q.scale) > 4 else ''}]{axis} {q.dtype.value}"
    )


def _is_none(t: Type) -> bool:
    return isinstance(t, ObjectType) and t.name == "NoneType"
