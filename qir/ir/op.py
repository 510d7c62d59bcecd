"""Op kinds: one attrs class per kind, with typed attributes, traits, inference and checks.

An op instance holds only *attributes* (static configuration such as stride). The
values it consumes are the operands of the :class:`~qir.ir.graph.Node` that carries it.
Attribute values may embed :class:`Ref` placeholders that point at operands, for
arguments that are only known at run time (``x.reshape(x.size(0), -1)``).

Define an op::

    @register_op
    @attrs.frozen
    class Relu(Op):
        name: ClassVar[str] = "relu"
        traits: ClassVar[frozenset[type[Trait]]] = frozenset({Elementwise, ShapePreserving})
        arity: ClassVar[tuple[int, int | None]] = (1, 1)

        def compute(self, x): return torch.relu(x)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

import attrs
import torch

from qir.ir.spec_flow import carry_spec
from qir.ir.types import DType, SequenceType, TensorType, Type, type_of


class IRError(Exception):
    """A malformed graph or op. The message names the node at fault."""


class CannotInfer(IRError):
    """An op cannot infer its result type from operand types alone (opaque calls, scalar
    operands): the declared type stands. Any other :class:`IRError` from ``infer_type``
    means the operands are wrong, and :func:`~qir.ir.verify` reports it."""


# --------------------------------------------------------------------------- traits


class Trait:
    """Marker classes attached to op kinds; passes test traits, never op names."""


class Pure(Trait):
    """No side effects: the node can be removed when unused and deduplicated."""


class Elementwise(Trait):
    """Output element i depends only on input elements i (after broadcasting)."""


class ShapePreserving(Trait):
    """Output shape equals the (first) input's shape."""


class Commutative(Trait):
    """The first two operands can be swapped without changing the result."""


class Transparent(Trait):
    """Moves data without changing values (reshape, permute, identity, dropout in eval)."""


class MovesCodes(Trait):
    """The result is its one tensor operand's elements, moved or copied without arithmetic
    (reshape, permute, getitem, repeat, ...), or a tuple of pieces of them (split, chunk, unbind):
    codes in, the same codes out, so after conversion each result tensor keeps the operand's scale
    and dtype (the ``quantize`` pass retypes it). Not every ``Transparent`` op (``cat`` takes
    several tensors), and ``getitem`` is one without being ``Transparent``."""


class ReadsShape(Trait):
    """The result is computed from the operands' shapes alone, never their values (``size``, ``dim``,
    ``numel``, ``len``): a number, the same for codes as for the float tensor they stand for, so the
    ``quantize`` pass leaves it as it is."""


class HasWeight(Trait):
    """Operand 1 is a weight tensor (conv, linear, ...); operand 2 an optional bias."""


class SameDtypeOperands(Trait):
    """Float operands must share one dtype: the torch kernel does not promote (f32 @ f64 fails)."""


class Quantization(Trait):
    """Quantize / dequantize boundaries and fake quant."""


class Opaque(Trait):
    """The front end did not recognise the call; kept verbatim, never optimised."""


# --------------------------------------------------------------------------- refs


@attrs.frozen
class Ref:
    """Placeholder inside an attribute for operand ``index`` of the same node."""

    index: int


def resolve(value: Any, operands: Sequence[Any]) -> Any:
    """Replace :class:`Ref` placeholders in a (nested) attribute value with operands."""
    if isinstance(value, Ref):
        return operands[value.index]
    if isinstance(value, tuple):
        return tuple(resolve(v, operands) for v in value)
    if isinstance(value, list):
        return [resolve(v, operands) for v in value]
    if isinstance(value, dict):
        return {k: resolve(v, operands) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(resolve(value.start, operands), resolve(value.stop, operands), resolve(value.step, operands))
    return value


def iter_refs(value: Any) -> Iterator[Ref]:
    if isinstance(value, Ref):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from iter_refs(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_refs(v)
    elif isinstance(value, slice):
        for v in (value.start, value.stop, value.step):
            yield from iter_refs(v)


def freeze(value: Any) -> Any:
    """Lists to tuples recursively, so attribute values are hashable where possible."""
    if isinstance(value, list):
        return tuple(freeze(v) for v in value)
    if isinstance(value, tuple):
        return tuple(freeze(v) for v in value)
    return value


# --------------------------------------------------------------------------- ops


def meta_tensor(t: Type) -> Any:
    """An empty meta tensor of tensor type ``t`` (what :meth:`Op.infer_type` runs ``compute`` on)."""
    if isinstance(t, TensorType):
        return torch.empty(t.shape, dtype=t.dtype.to_torch(), device="meta")
    raise NotImplementedError


@attrs.frozen
class Op:
    """Base of all op kinds. Subclasses are frozen attrs classes registered by name."""

    name: ClassVar[str] = ""
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure})
    #: (min, max) number of operands; max None means variadic.
    arity: ClassVar[tuple[int, int | None]] = (0, None)
    #: Names of the leading operands, for messages and docs.
    operand_names: ClassVar[tuple[str, ...]] = ()
    #: torch spellings of this op, used by the front end and by pattern specs:
    #: callables seen as fx ``call_function`` targets (``torch.add``, ``operator.add``,
    #: ``F.relu``), and method names seen as ``call_method`` (``"add"``, ``"relu"``).
    functions: ClassVar[tuple[Callable[..., Any], ...]] = ()
    methods: ClassVar[tuple[str, ...]] = ()

    # -- introspection ---------------------------------------------------------
    @classmethod
    def has_trait(cls, trait: type[Trait]) -> bool:
        return any(issubclass(t, trait) for t in cls.traits)

    def attributes(self) -> dict[str, Any]:
        """Attribute name -> value, in declaration order."""
        return {f.name: getattr(self, f.name) for f in attrs.fields(type(self))}

    def reads_only_shape(self) -> bool:
        """Whether this node's result depends on its operands' shapes alone (the :class:`ReadsShape`
        trait; an op whose answer depends on an attribute, such as ``getattr``, overrides this)."""
        return self.has_trait(ReadsShape)

    # -- semantics -------------------------------------------------------------
    def evaluate(self, ctx: Any, operands: Sequence[Any]) -> Any:
        """Run the op inside a graph (``ctx`` gives constants and objects)."""
        return self.compute(*operands)

    def compute(self, *operands: Any) -> Any:
        """Float reference semantics (torch). Runs on real or meta tensors."""
        raise NotImplementedError(f"op {self.name!r} has no reference implementation")

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        """Result type from operand types. Default: run :meth:`compute` on meta tensors.

        Ops whose inputs are not all tensors (or whose results depend on data)
        override this; :class:`IRError` says which op could not be inferred.
        """
        try:
            args = [meta_tensor(t) for t in operand_types]
            out = self.compute(*args)
        except NotImplementedError:
            raise CannotInfer(f"op {self.name!r}: cannot infer the result type of {operand_types}") from None
        t = meta_type(out)
        # meta tensors hold int8, not qint8 at a scale: codes moved without arithmetic keep theirs
        return carry_spec(operand_types, t) if self.has_trait(Transparent) else t

    def infer_verified_type(self, operand_types: Sequence[Type]) -> Type:
        """:meth:`infer_type` of operand types :meth:`verify` has just accepted (the verifier checks each
        node, then types it). An op whose ``infer_type`` runs its own checks first (it may be typed
        unchecked: ``Graph.create_node``) overrides this to skip them. Default: :meth:`infer_type`."""
        return self.infer_type(operand_types)

    def verify(self, operand_types: Sequence[Type]) -> None:
        """Check operands against this op; raise :class:`IRError` with the reason."""
        lo, hi = self.arity
        n = len(operand_types)
        if n < lo or (hi is not None and n > hi):
            want = f"{lo}" if lo == hi else f"{lo}..{'' if hi is None else hi}"
            raise IRError(f"op {self.name!r} takes {want} operands, got {n}")
        for ref in _all_refs(self):
            if ref.index >= n:
                raise IRError(f"op {self.name!r}: attribute refers to operand {ref.index}, node has {n}")
        self.verify_(operand_types)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        """Op-specific checks across fields (override)."""

    def unknown_dims_problem(self, operand_types: Sequence[Type]) -> str | None:
        """Why the result cannot be typed when some operand dimensions are unknown, although the
        op types fine at any one size (override; None: no such reason). ``chunk(n)`` along an unknown
        dimension: n pieces of a large size, fewer of a small one (qir.ir.unknown_dims)."""
        return None

    def verify_values(self, operand_types: Sequence[Type], values: Sequence[torch.Tensor | None]) -> None:
        """Check the operand *values* known before the graph runs (override): ``values[i]`` is
        operand i's bound constant tensor, None for a value computed at run time. Called by
        :func:`~qir.ir.verify` after the type checks passed, for ops whose state is data the
        kernel trusts (a requantization shift, a table's entries, a scale)."""


def _all_refs(op: Op) -> Iterator[Ref]:
    for v in op.attributes().values():
        yield from iter_refs(v)


def meta_type(out: Any) -> Type:
    """The IR type of a ``compute`` result on meta tensors."""
    if isinstance(out, torch.Tensor):
        return TensorType(tuple(out.shape), DType.from_torch(out.dtype))
    if isinstance(out, (tuple, list)):
        return SequenceType(tuple(meta_type(o) for o in out), "list" if isinstance(out, list) else "tuple")
    return type_of(out)


class ModuleOp(Op):
    """An op a torch module computes. Its tensor state (weight, bias, running stats)
    arrives as trailing ``constant`` operands, named by :meth:`param_roles`, so passes
    can rewrite weights like any other value; emitters rebuild the module with
    :meth:`to_module` at the node's scope, keeping state-dict keys.
    """

    #: torch module classes this op is created from (front end) and emitted as.
    module_types: ClassVar[tuple[type, ...]] = ()
    #: state roles sized by the input's channel dimension (dim 1): batch norm's statistics
    channel_state: ClassVar[tuple[str, ...]] = ()

    def num_inputs(self) -> int:
        """Leading data operands (the rest are parameters)."""
        return 1

    def param_roles(self) -> tuple[str, ...]:
        """State tensors this instance carries, in operand order after the inputs."""
        return ()

    def module_inputs(self, operands: Sequence[Any]) -> list[Any]:
        """The operands the module's ``forward`` takes (default: the leading inputs)."""
        return list(operands[: self.num_inputs()])

    def module_params(self, operands: Sequence[Any]) -> list[Any]:
        """The operands that are the module's state, in :meth:`param_roles` order."""
        k = self.num_inputs()
        return list(operands[k : k + len(self.param_roles())])

    def param_index(self, role: str) -> int | None:
        roles = self.param_roles()
        return self.num_inputs() + roles.index(role) if role in roles else None

    @classmethod
    def from_module(cls, module: Any) -> ModuleOp:
        raise NotImplementedError(f"op {cls.name!r} cannot be built from {type(module).__name__}")

    def to_module(self, tensors: dict[str, torch.Tensor]) -> Any:
        raise NotImplementedError(f"op {self.name!r} cannot be emitted as a module")

    def module_form_only(self) -> bool:
        """Whether emitting and lowering must keep the module form even where the op has a torch
        call: the call is not the module's forward in every mode (batch norm's is its eval form)."""
        return False


def torch_call_of(op: Op) -> Any:
    """The torch call emit and lowering run for ``op``: its ``torch_call``, or None where it has none
    or is a module op that keeps its module form (:meth:`ModuleOp.module_form_only`)."""
    if isinstance(op, ModuleOp) and op.module_form_only():
        return None
    return getattr(op, "torch_call", None)


# --------------------------------------------------------------------------- registry

OP_REGISTRY: dict[str, type[Op]] = {}
_VERSION = [0]


def registry_version() -> int:
    """Changes whenever an op is registered or an op gains a spelling (module class): caches
    of spelling -> op maps compare it to know when to rebuild."""
    return _VERSION[0]


def bump_registry_version() -> None:
    _VERSION[0] += 1


OpT = TypeVar("OpT", bound=type[Op])


def register_op(cls: OpT) -> OpT:
    """Class decorator: make an op kind known by its ``name`` (for the parser, tools, docs)."""
    if not cls.name:
        raise ValueError(f"op class {cls.__qualname__} has no name")
    if cls.name in OP_REGISTRY and OP_REGISTRY[cls.name] is not cls:
        raise ValueError(f"op name {cls.name!r} is taken by {OP_REGISTRY[cls.name].__qualname__}")
    OP_REGISTRY[cls.name] = cls
    bump_registry_version()
    return cls


# The built-in ops build on this module, so it imports none of them: qir/ir/__init__.py
# (which runs before any qir.ir module) imports qir.ir.ops, and that registers them.


def get_op_class(name: str) -> type[Op]:
    try:
        return OP_REGISTRY[name]
    except KeyError:
        raise IRError(f"unknown op {name!r}; registered ops: {', '.join(sorted(OP_REGISTRY))}") from None


def op_classes_with(trait: type[Trait]) -> list[type[Op]]:
    return [c for c in OP_REGISTRY.values() if c.has_trait(trait)]


Compute = Callable[..., Any]
