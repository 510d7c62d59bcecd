"""fx graph -> qir IR: ``trace(module, example_inputs)``.

Every fx node becomes one IR node (or none: ``get_attr`` of a FloatFunctional module),
typed by one run of the graph on the example inputs. Weights and buffers become
``constant`` nodes keyed by their state-dict names; known calls become registered ops;
anything else becomes an explicit opaque ``call``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from qir.frontend.bind import Unbindable, bind
from qir.frontend.lookup import ff_op_class, is_float_functional, qualified_name, tables
from qir.frontend.sequences import (
    SEQUENCE_LENGTH_META,
    SEQUENCE_LENGTHS_KEY,
    bind_example_inputs,
    carry_lengths,
    input_sequences,
)
from qir.frontend.tracer import (
    QirTracer,
    TraceError,
    functionalize_inplace,
    patch_float_functional,
    patch_len,
    placeholders_first,
    trace_error,
)
from qir.ir.graph import Graph, Node, Value, split_operands
from qir.ir.op import IRError, ModuleOp, MovesCodes, Op, Transparent
from qir.ir.ops.core import Call, Identity
from qir.ir.ops.integer import IntegerModuleOp, integer_method_op
from qir.ir.ops.qat_functional import qat_method_reader
from qir.ir.ops.shape import Transpose
from qir.ir.spec_flow import adopt_specs, carry_spec
from qir.ir.types import TensorType, Type, type_of
from qir.utils.fx_helper import wrapped_original

#: ``Graph.objects`` key of the source model's module names in definition order (emitters
#: recreate submodules in this order, so state-dict keys come out in the same order).
MODULE_ORDER_KEY = "qir.module_order"


def trace(
    module: nn.Module,
    example_inputs: Any = (),
    *,
    concrete_args: dict[str, Any] | None = None,
    infer_types: bool = False,
) -> Graph:
    """Trace ``module`` (or take an existing ``torch.fx.GraphModule``) into a typed IR graph.

    ``example_inputs`` (a tensor or a tuple) runs the traced graph once to give every
    value its type. With ``infer_types``, the graph inputs take the example inputs' types
    and every other value the type its op infers from its operands' (shape formulas,
    :mod:`qir.ir.meta_shapes`), without running the model; when some node's op cannot
    infer its type (an opaque call, sizes known only at run time), the graph is typed by
    the run after all. Raises :class:`TraceError` naming the module and source line when
    fx cannot trace the model.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    # Tracing allocates many small, acyclic objects; Python's cyclic GC would rescan the
    # growing heap again and again (about a quarter of the time on large models).
    with gc_paused():
        return _trace(module, example_inputs, concrete_args, infer_types)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a block (restored even on error)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _trace(
    module: nn.Module, example_inputs: tuple[Any, ...], concrete_args: dict[str, Any] | None, infer_types: bool
) -> Graph:
    if isinstance(module, torch.fx.GraphModule) and concrete_args is None:
        root: nn.Module = module
        fx_graph = module.graph
        carry_lengths(module, fx_graph)
    else:
        root = module
        tracer = QirTracer(sequences=input_sequences(bind_example_inputs(module, example_inputs)))
        try:
            with patch_float_functional(tracer), patch_len(module):
                fx_graph = tracer.trace(module, concrete_args)
            placeholders_first(fx_graph)
            carry_lengths(module, fx_graph)
            functionalize_inplace(fx_graph, module)
        except TraceError:
            raise
        except Exception as e:
            raise trace_error(tracer, module, e) from e
    if infer_types:
        inputs = _input_values(fx_graph, example_inputs)
        if inputs is not None:
            try:
                return _Converter(root, inputs, infer=True).run(fx_graph)
            except _NeedsRun:
                pass  # some op cannot infer its type: the run types the graph
    values = propagate(root, fx_graph, example_inputs)
    return _Converter(root, values).run(fx_graph)


class _NeedsRun(Exception):
    """Raised while typing by inference: a node's type needs a run of the model."""


def _input_values(fx_graph: torch.fx.Graph, example_inputs: Sequence[Any]) -> dict[str, Any] | None:
    """Placeholder name -> the value a run would bind it to (an example input or the default),
    as :meth:`torch.fx.Interpreter.run` binds them; None for graphs it binds otherwise (``*args``)
    or too few inputs (the run then reports it)."""
    values: dict[str, Any] = {}
    rest = list(example_inputs)
    for n in fx_graph.nodes:
        if n.op != "placeholder":
            continue
        if str(n.target).startswith("*"):
            return None
        if rest:
            values[n.name] = rest.pop(0)
        elif n.args:
            values[n.name] = n.args[0]
        else:
            return None
    return None if rest else values


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            out = super().run_node(n)
        except Exception as e:
            raise TraceError(
                f"running traced node {n.name} ({n.op} {n.target}) on the example inputs failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        self.values[n.name] = out
        return out


#: attribute of a model whose forward runs inside a context: a callable ``root -> context manager``
#: (a converted eager model whose codes carry their scales to a shared DeQuantStub,
#: qir.nn.quantized.scale_tags); running its traced graph enters the same context
FORWARD_CONTEXT = "_qir_forward_context"


def propagate(root: nn.Module, fx_graph: torch.fx.Graph, example_inputs: Sequence[Any]) -> dict[str, Any]:
    """Run the traced graph once on the example inputs; node name -> value.

    A run may update buffers (batch-norm statistics, observers): it updates clones that
    stand in for them, and the originals are put back untouched afterwards (not even their
    version counters move, which integer-exact validation reads to know its twin is current).
    """
    placeholders = [n for n in fx_graph.nodes if n.op == "placeholder"]
    required = [n for n in placeholders if not n.args]
    if len(example_inputs) < len(required):
        names = ", ".join(str(n.target) for n in required)
        raise TraceError(
            f"trace needs example_inputs for the model inputs ({names}) to type the graph; got {len(example_inputs)}"
        )
    gm = torch.fx.GraphModule(root, copy.deepcopy(fx_graph))
    rec = _Recorder(gm)
    context = root.__dict__.get(FORWARD_CONTEXT)
    with torch.no_grad(), scratch_buffers(root), context(root) if context is not None else contextlib.nullcontext():
        rec.run(*example_inputs)
    return rec.values


@contextlib.contextmanager
def scratch_buffers(module: nn.Module) -> Iterator[None]:
    """Inside the block, the buffers of ``module`` and its submodules are clones; the originals
    are put back after it untouched (values and version counters), whatever the block wrote.

    How a forward run or an observation reads a model without changing it, at the cost of one
    clone per buffer instead of a deep copy of the model."""
    saved = [(m, name, t) for m in module.modules() for name, t in m._buffers.items() if t is not None]
    clones: dict[int, torch.Tensor] = {}  # a buffer two modules share stays shared
    for m, name, t in saved:
        if id(t) not in clones:
            clones[id(t)] = t.detach().clone()
        m._buffers[name] = clones[id(t)]
    try:
        yield
    finally:
        for m, name, t in saved:
            m._buffers[name] = t


def _fetch(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        if part:
            obj = getattr(obj, part)
    return obj


def _owner(root: nn.Module, key: str) -> tuple[Any, str]:
    path, _, leaf = key.rpartition(".")
    return (_fetch(root, path) if path else root), leaf


def _kind_at(owner: Any, leaf: str) -> str:
    """parameter / buffer / buffer_np / tensor: what attribute ``leaf`` of ``owner`` is."""
    if isinstance(owner, nn.Module):
        if leaf in owner._parameters:
            return "parameter"
        if leaf in owner._buffers:
            return "buffer_np" if leaf in owner._non_persistent_buffers_set else "buffer"
    return "tensor"


class _Converter:
    """fx graph -> IR. ``keep_whole``: module paths that stay opaque calls even when an op is
    registered for their class (hybrid CPU modules: never fused, their forward runs as written)."""

    def __init__(
        self, root: nn.Module, values: dict[str, Any], keep_whole: frozenset[str] = frozenset(), infer: bool = False
    ) -> None:
        self.root = root
        self.values = values
        #: type nodes by their op's inference (``values`` holds the graph inputs only)
        self.infer = infer
        self.keep_whole = keep_whole
        self.g = Graph(type(root).__name__)
        self.g.training = root.training
        self.env: dict[str, Any] = {}
        self.opaque_paths: set[str] = set()
        self.tables = tables()
        self._paths: dict[int, str] | None = None

    # -- driver ----------------------------------------------------------------
    def run(self, fx_graph: torch.fx.Graph) -> Graph:
        for n in fx_graph.nodes:
            try:
                getattr(self, f"_{n.op}")(n)
            except (TraceError, IRError, _NeedsRun):
                raise
            except Exception as e:
                raise TraceError(f"cannot convert fx node {n.name} ({n.op} {n.target}): {type(e).__name__}: {e}") from e
        modules = list(self.root.named_modules())  # one walk for the three readers below
        self._add_remaining_state(modules)
        self._order_constants(modules)
        self.g.objects[MODULE_ORDER_KEY] = tuple(name for name, _ in modules)
        return self.g

    def path_of(self, m: nn.Module) -> str | None:
        """Qualified name of a submodule (one map for the whole conversion: linear time)."""
        if self._paths is None:
            self._paths = {}
            for p, mod in self.root.named_modules():
                self._paths.setdefault(id(mod), p)
        return self._paths.get(id(m))

    def type_of(self, n: torch.fx.Node) -> Type:
        if n.name not in self.values:
            raise TraceError(f"fx node {n.name} produced no value on the example inputs")
        return type_of(self.values[n.name])

    def args(self, n: torch.fx.Node) -> tuple[Any, Any]:
        get = lambda a: self.env[a.name]
        return torch.fx.node.map_arg(n.args, get), torch.fx.node.map_arg(n.kwargs, get)

    def constant(self, key: str, module: nn.Module | None = None, role: str = "") -> Node:
        """The constant node of the tensor at ``key``; with ``module`` (the module at ``key`` minus
        ``role``), found from it: a layer's state is looked up from the layer, not from the root."""
        node = self.env.get(f"const:{key}")
        if node is None:
            owner, leaf = _owner(self.root, key) if module is None else _owner(module, role)
            tensor = getattr(owner, leaf)
            if not isinstance(tensor, torch.Tensor):
                raise TraceError(f"attribute {key!r} is a {type(tensor).__name__}, not a tensor")
            node = self.g.add_constant(key, tensor, _kind_at(owner, leaf), name=key)
            self.env[f"const:{key}"] = node
        return node

    def inferred_type(self, n: torch.fx.Node, op: Op, operands: list[Value]) -> Type:
        """``n``'s type as ``op`` infers it from its operands' types; :class:`_NeedsRun` when it cannot."""
        try:
            t = op.infer_type([v.type for v in operands])
        except Exception as e:  # CannotInfer, a Ref to a run-time size, torch refusing meta tensors
            raise _NeedsRun(f"{n.name}: {e}") from None
        if isinstance(t, TensorType) and t.quant is not None:
            raise _NeedsRun(f"{n.name}: a QuantSpec the example run does not give")  # codes: types as the run does
        return t

    def add(self, n: torch.fx.Node, op: Op, operands: list[Value], scope: str | None = None) -> Node:
        t = self.inferred_type(n, op, operands) if self.infer else self.type_of(n)
        if isinstance(op, IntegerModuleOp):
            t = op.typed_result(t)  # codes typed with the layer's output QuantSpec
        elif op.has_trait(Transparent) or op.has_trait(MovesCodes):
            t = _moved_codes_type(op, operands, t)
        node = self.g.add_node(op, operands, t, name=n.name, scope=scope)
        self.env[n.name] = node
        return node

    def opaque(
        self, n: torch.fx.Node, kind: str, target: str, args: Any, kwargs: Any, why: str = "", scope: str | None = None
    ) -> Node:
        operands, (targs, tkwargs) = split_operands((tuple(args), dict(kwargs)))
        node = self.add(n, Call(kind=kind, target=target, args=targs, kwargs=tkwargs), operands, scope)
        if why:
            node.meta["frontend_note"] = why
        return node

    def try_bind(
        self, n: torch.fx.Node, cls: type[Op], fn: Any, args: Any, kwargs: Any, form: str, scope: str | None = None
    ) -> Node | str:
        """The bound node, or the reason the op could not take the call."""
        try:
            op, operands = bind(cls, fn, args, kwargs, form)
            op.verify([v.type for v in operands])
        except (Unbindable, IRError) as e:
            return str(e)
        return self.add(n, op, operands, scope)

    # -- fx opcodes ------------------------------------------------------------
    def _placeholder(self, n: torch.fx.Node) -> None:
        has_default = bool(n.args)
        name = str(n.target).lstrip("*")
        arg = self.g.add_input(name, self.type_of(n), n.args[0] if has_default else None, has_default)
        self.env[n.name] = arg
        length = n.meta.get(SEQUENCE_LENGTH_META)
        if length is not None:  # the traced code read this list input's length: emitted modules check it
            self.g.objects[SEQUENCE_LENGTHS_KEY] = {**self.g.objects.get(SEQUENCE_LENGTHS_KEY, {}), name: length}

    def _get_attr(self, n: torch.fx.Node) -> None:
        obj = _fetch(self.root, str(n.target))
        if isinstance(obj, torch.Tensor):
            self.env[n.name] = self.constant(str(n.target))
        else:
            self.env[n.name] = obj  # modules (FloatFunctional) and plain attributes fold into uses

    def _call_module(self, n: torch.fx.Node) -> None:
        path = str(n.target)
        m = self.root.get_submodule(path)
        args, kwargs = self.args(n)
        if is_float_functional(m):
            raise TraceError(f"FloatFunctional '{path}' is called directly; call its methods (add, cat, ...)")
        if path in self.keep_whole:
            self.opaque_paths.add(path)
            self.g.objects[f"module:{path}"] = m
            self.opaque(n, "module", path, args, kwargs, "kept whole (hybrid: placed on the CPU)", scope=path)
            return
        if type(m) is nn.Identity and len(args) == 1 and not kwargs and isinstance(args[0], Value):
            self.add(n, Identity(), [args[0]], scope=path)
            return
        cls = self.tables.for_module(m)
        why = f"{type(m).__module__}.{type(m).__qualname__} has no registered op"
        if cls is not None:
            try:
                self._module_op(n, cls, m, path, args, kwargs)
                return
            except (NotImplementedError, Unbindable, IRError) as e:
                why = str(e)
        self.opaque_paths.add(path)
        self.g.objects[f"module:{path}"] = m
        self.opaque(n, "module", path, args, kwargs, why, scope=path)

    def _module_op(
        self, n: torch.fx.Node, cls: type[ModuleOp], m: nn.Module, path: str, args: Any, kwargs: Any
    ) -> None:
        # an op built per call (a DeQuantStub shared by outputs of different scales takes its operand's)
        from_call = getattr(cls, "from_call", None)
        op = from_call(m, args, kwargs) if from_call is not None else cls.from_module(m)
        bind_call = getattr(op, "bind_call", None)
        if bind_call is not None:
            op, inputs = bind_call(args, kwargs)
        else:
            if kwargs or not all(isinstance(a, Value) for a in args):
                raise Unbindable(f"{type(m).__name__} '{path}' called with non-value or keyword arguments")
            inputs = list(args)
        params = [self.constant(f"{path}.{role}" if path else role, m, role) for role in op.param_roles()]
        operands = list(inputs) + params
        op.verify([v.type for v in operands])
        self.add(n, op, operands, scope=path)

    def _call_function(self, n: torch.fx.Node) -> None:
        fn = n.target
        args, kwargs = self.args(n)
        if wrapped_original(fn) is not None:
            key = self._wrapped_key(fn)
            self.g.objects[key] = fn
            self.opaque(n, "function", key, args, kwargs, "wrapped with qir.utils.fx_helper.wrap")
            return
        cls = self.tables.for_function(fn)  # type: ignore[arg-type]
        why = f"{qualified_name(fn)} has no registered op"
        if cls is not None:
            res = self.try_bind(n, cls, fn, args, kwargs, "function")
            if isinstance(res, Node):
                return
            why = res
        key = qualified_name(fn)
        self.g.objects[key] = fn
        node = self.opaque(n, "function", key, args, kwargs, why)
        if n.meta.get("is_wrapped"):  # torch.fx.wrap recorded the call whole: emit keeps it so
            node.meta["is_wrapped"] = True

    def _wrapped_key(self, fn: Any) -> str:
        name = getattr(fn, "__name__", "fn")
        if isinstance(fn, types.MethodType) and isinstance(fn.__self__, nn.Module):
            path = self.path_of(fn.__self__)
            return f"self.{path}.{name}" if path else f"self.{name}"
        return qualified_name(fn)

    def _call_method(self, n: torch.fx.Node) -> None:
        name = str(n.target)
        args, kwargs = self.args(n)
        if args and isinstance(args[0], nn.Module) and is_float_functional(args[0]):
            self._float_functional(n, args[0], name, args[1:], kwargs)
            return
        if args and isinstance(args[0], nn.Module) and self._integer_method(n, args[0], name, args[1:], kwargs):
            return
        if args and isinstance(args[0], nn.Module) and self._qat_method(n, args[0], name, args[1:], kwargs):
            return
        cls = self.tables.by_method.get(name)
        why = f"Tensor.{name} has no registered op"
        if cls is not None:
            res = self.try_bind(n, cls, name, args, kwargs, "method")
            if isinstance(res, Node):
                return
            why = res
        self.opaque(n, "method", name, args, kwargs, why)

    def _integer_method(self, n: torch.fx.Node, m: nn.Module, method: str, args: Any, kwargs: Any) -> bool:
        """A method call of an integer module (``QFunctional.add``) as its integer op; False when
        no op is registered for it or the call does not bind (it stays an opaque call)."""
        cls = integer_method_op(m, method)
        path = self.path_of(m)
        if cls is None or path is None:
            return False
        try:
            bound = inspect.signature(getattr(m, method)).bind(*args, **kwargs)
            bound.apply_defaults()
            op, inputs = cls.from_call(m, method, dict(bound.arguments))  # type: ignore[attr-defined]
            if not all(isinstance(v, Value) for v in inputs):
                return False
            op.verify([v.type for v in inputs])
        except (TypeError, ValueError, KeyError, IRError):
            return False
        self.add(n, op, list(inputs), scope=path)
        return True

    def _qat_method(self, n: torch.fx.Node, m: nn.Module, method: str, args: Any, kwargs: Any) -> bool:
        """A method call of a QAT FloatFunctional as its ``qat_functional`` op (state: the output fake
        quant's buffers, as constants); when it does not bind, an opaque call of the method, with
        the reason. False when ``m`` has no registered method reader."""
        reader = qat_method_reader(m)
        path = self.path_of(m)
        if reader is None or path is None:
            return False
        try:
            bound = inspect.signature(getattr(m, method)).bind(*args, **kwargs)
            bound.apply_defaults()
            op, inputs = reader(m, method, dict(bound.arguments))
            if not all(isinstance(v, Value) for v in inputs):
                raise Unbindable(f"FloatFunctional '{path}'.{method} takes graph values as tensor arguments")
            params = [self.constant(f"{path}.{role}", m, role) for role in op.param_roles()]
            op.verify([v.type for v in [*inputs, *params]])
        except (TypeError, ValueError, KeyError, AttributeError, NotImplementedError, Unbindable, IRError) as e:
            self.opaque_paths.add(path)
            self.g.objects[f"module:{path}"] = m
            key = f"{path}.{method}"
            self.g.objects[key] = getattr(m, method)
            self.opaque(n, "function", key, args, kwargs, str(e), scope=path).meta["float_functional"] = method
            return True
        self.add(n, op, [*inputs, *params], scope=path)
        return True

    def _float_functional(self, n: torch.fx.Node, ff: nn.Module, method: str, args: Any, kwargs: Any) -> None:
        path = self.path_of(ff)
        if path is None:
            raise TraceError(f"FloatFunctional {ff!r} is not a submodule of the traced model")
        self.opaque_paths.add(path)
        self.g.objects[f"module:{path}"] = ff
        kept = path in self.keep_whole
        if method == "matmul" and not kept:
            args, kwargs = self._ff_matmul_operands(n, path, args, kwargs)
        cls = None if kept else ff_op_class(method)
        why = "kept whole (hybrid: placed on the CPU)" if kept else f"FloatFunctional.{method} has no registered op"
        if cls is not None:
            res = self.try_bind(n, cls, method, args, kwargs, "function", scope=path)
            if isinstance(res, Node):
                res.meta["float_functional"] = method
                return
            why = res
        key = f"{path}.{method}"
        self.g.objects[key] = getattr(ff, method)
        node = self.opaque(n, "function", key, args, kwargs, why, scope=path)
        node.meta["float_functional"] = method

    def _ff_matmul_operands(self, n: torch.fx.Node, path: str, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """``matmul(x, y, x_trans, y_trans)`` (the plugin's form) as ``matmul(x', y')`` with explicit
        ``transpose`` nodes for the flagged operands, so the IR holds only registered ops."""
        names = ("x", "y", "x_trans", "y_trans")
        if len(args) > len(names) or set(kwargs) - set(names):
            return args, kwargs  # not the known signature: the binding below says why
        bound = {**dict(zip(names, args, strict=False)), **kwargs}
        if "x" not in bound or "y" not in bound:
            return args, kwargs
        operands = []
        for side in ("x", "y"):
            v = bound.get(side)
            if bound.get(f"{side}_trans") and isinstance(v, Value):
                v = self.g.add_node(Transpose(dim0=-2, dim1=-1), [v], name=f"{n.name}_{side}_t")
            operands.append(v)
        return tuple(operands), {}

    def _output(self, n: torch.fx.Node) -> None:
        out = torch.fx.node.map_arg(n.args[0], lambda a: self.env[a.name])
        self.g.set_output(out)

    # -- state -----------------------------------------------------------------
    def _in_opaque(self, path: str) -> bool:
        parts = path.split(".")
        return any(".".join(parts[: i + 1]) in self.opaque_paths for i in range(len(parts))) if path else False

    def _add_remaining_state(self, modules: list[tuple[str, nn.Module]]) -> None:
        """Unused weights and buffers still become constants, so state-dict keys survive."""
        for path, m in modules:
            if self._in_opaque(path):
                continue
            for name, t in list(m._parameters.items()) + list(m._buffers.items()):
                if t is not None:
                    self.constant(f"{path}.{name}" if path else name, m, name)

    def _order_constants(self, modules: list[tuple[str, nn.Module]]) -> None:
        order: list[str] = []
        for path, m in modules:
            prefix = f"{path}." if path else ""
            order += [prefix + k for k in m._parameters] + [prefix + k for k in m._buffers]
        rank = {k: i for i, k in enumerate(order)}
        keys = sorted(self.g.constants, key=lambda k: rank.get(k, len(rank)))
        self.g.constants = {k: self.g.constants[k] for k in keys}


def _moved_codes_type(op: Op, operands: list[Value], t: Type) -> Type:
    """The example's type ``t`` with the QuantSpec the op's inference keeps on codes it only
    moves (a flatten / reshape / slice of qint8 codes at a scale)."""
    try:
        inferred = op.infer_type([v.type for v in operands])
    except Exception:
        # sizes known only at run time (x.view(x.shape[0], -1)): moving elements keeps a per-tensor scale
        # whatever the layout, so the result takes its codes operand's one per-tensor spec
        inferred = carry_spec([v.type for v in operands], t)
    return adopt_specs(t, inferred)
