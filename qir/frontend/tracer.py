"""The fx tracer qir uses: which modules stay whole, FloatFunctional calls as single nodes,
and error messages that point at the user's code."""

from __future__ import annotations

import builtins
import contextlib
import copy
import functools
import inspect
import linecache
import operator
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx
from torch import nn

from qir.frontend.lookup import (
    float_functional_classes,
    functional_method_classes,
    fused_module_classes,
    is_opaque_leaf,
    is_qir_library_module,
    stub_classes,
    tables,
)
from qir.frontend.sequences import unpack
from qir.utils.fx_helper import _find_proxy


class TraceError(RuntimeError):
    """The model could not be traced; the message names the module and source line."""


class QirTracer(torch.fx.Tracer):
    """fx tracer keeping as leaves: QuantStub / DeQuantStub, FloatFunctional, every module
    class some registered op is built from, qir's module library and torch.nn built-ins,
    and the module paths in ``leaves`` (hybrid CPU modules: one call, their forward runs as written)."""

    def __init__(self, leaves: frozenset[str] = frozenset(), sequences: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.leaves = leaves
        #: forward parameter name -> the list / tuple shape of its example input (see input_sequences)
        self.sequences: Mapping[str, Any] = sequences or {}
        #: chunk node name -> how many pieces torch returned on the example inputs (see pieces_of)
        self.piece_counts: dict[str, int] = {}
        #: names of the chunk nodes whose piece count was taken from the call (``chunk(n)``: n)
        self.assumed_pieces: set[str] = set()
        self._qir_stack: list[tuple[str, type]] = []
        #: the module stack when a call first failed (the stack unwinds before the error is reported)
        self.failed_in: list[tuple[str, type]] | None = None
        self._ff_paths: dict[int, str] = {}
        self._derived: _DerivedTensors | None = None  # while tracing: tensors computed from buffers

    def pieces_of(self, node: torch.fx.Node) -> int | None:
        """How many pieces a ``chunk`` / ``split`` node is unpacked into: the count measured on the
        example inputs when known (``chunk(4)`` of 5 channels gives 3), else what the call says."""
        if node.name in self.piece_counts:
            return self.piece_counts[node.name]
        n = static_piece_count(node)
        if n is not None and _is_chunk(node):
            self.assumed_pieces.add(node.name)
        return n

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaves:
            return True
        if isinstance(m, float_functional_classes() + stub_classes() + fused_module_classes()):
            return True
        if tables().for_module(m) is not None or is_qir_library_module(m) or is_opaque_leaf(m):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        # remember where we are, so a failure deep inside can name the module
        path = self.path_of_module(m) if m is not self.root else ""
        self._qir_stack.append((path, type(m)))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = list(self._qir_stack)
            raise
        finally:
            self._qir_stack.pop()

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _PiecesProxy(node, self)

    def create_proxy(self, kind: str, target: Any, args: Any, kwargs: Any, *rest: Any, **kw: Any) -> Any:
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **kw)
        shape = self.sequences.get(target) if kind == "placeholder" else None
        # an FPN head's `feats` list: the forward gets a real list of getitem proxies, so
        # `assert len(feats) == n`, `for f in feats` and `zip(feats, ...)` trace (one placeholder
        # still takes the whole list, as the user's forward does)
        return proxy if shape is None else unpack(proxy, shape)

    def iter(self, obj: torch.fx.Proxy) -> Iterator[Any]:
        # `list(x.chunk(2, 1))`, `for y in x.split((a, b), 1)` (YOLOv8's C2f): the piece count is
        # in the call itself, so the pieces are getitem nodes; fx only unpacks `a, b = ...`
        n = self.pieces_of(obj.node)
        if n is None:
            return super().iter(obj)  # type: ignore[no-any-return]
        return iter([obj[i] for i in range(n)])  # type: ignore[index]

    def trace(
        self, root: nn.Module | Callable[..., Any], concrete_args: dict[str, Any] | None = None
    ) -> torch.fx.Graph:
        self._derived = _DerivedTensors(self)
        try:
            with self._derived:
                return super().trace(root, concrete_args)
        finally:
            self._derived = None

    def create_arg(self, a: Any) -> Any:
        # a tensor computed from the model's own buffers (``self.boxes * 4``) is computed from them
        # at run time, not folded into a new ``_tensor_constant`` attribute
        derived = self._derived
        if derived is not None and isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter):
            node = derived.node_of(a)
            if node is not None:
                return node
        return super().create_arg(a)

    def ff_path(self, m: nn.Module) -> str:
        key = id(m)
        if key not in self._ff_paths:
            self._ff_paths[key] = self.path_of_module(m)
        return self._ff_paths[key]


#: Tensor magic methods as the operator fx records for them on proxies (``b * 4``: operator.mul)
_OPERATORS: dict[Any, Callable[..., Any]] = {
    **{getattr(torch.Tensor, f"__{n}__"): getattr(operator, n) for n in ("add", "sub", "mul", "truediv", "floordiv")},
    **{getattr(torch.Tensor, f"__{n}__"): getattr(operator, n) for n in ("mod", "pow", "matmul", "neg", "getitem")},
    **{getattr(torch.Tensor, f"__{n}__"): getattr(operator, n) for n in ("lt", "le", "gt", "ge", "eq", "ne")},
    **{getattr(torch.Tensor, f"__{n}__"): getattr(operator, f"{n}_") for n in ("and", "or")},
}
#: reflected magic methods: the operator with its operands swapped (``4 * b``)
_REFLECTED: dict[Any, Callable[..., Any]] = {
    getattr(torch.Tensor, f"__r{n}__"): getattr(operator, n)
    for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul")
    if hasattr(torch.Tensor, f"__r{n}__")
}


def _mutates(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether a torch call writes into a tensor it is given (in-place methods, ``out=``, item assignment)."""
    name = getattr(func, "__name__", "")
    if "out" in kwargs or name in ("__setitem__", "set_", "copy_"):
        return True
    if name.startswith("__i") and name.endswith("__"):  # __iadd__, __imul__, ...
        return True
    return name.endswith("_") and not name.endswith("__")


class _DerivedTensors(torch.overrides.TorchFunctionMode):
    """While fx traces, how each tensor computed from the model's buffers (or plain tensor
    attributes) only was made: fx keeps buffers as real tensors, so ``self.boxes * 4`` runs at
    trace time and would be folded into a new ``_tensor_constant`` attribute. :meth:`node_of`
    replays the recorded calls on proxies of those buffers instead, so the traced graph computes
    the expression from the module's own buffer when it runs (the state dict keeps ``boxes`` and
    gains no constant). A write into a recorded or source tensor forgets every record (the fold
    of the values as they are at trace time is then the faithful form)."""

    def __init__(self, tracer: torch.fx.Tracer) -> None:
        super().__init__()
        self.tracer = tracer
        self._sources: dict[int, tuple[torch.Tensor, str]] | None = None
        #: id(result) -> (result, func, args, kwargs); the result is kept so its id stays unique
        self.made: dict[int, tuple[torch.Tensor, Any, tuple[Any, ...], dict[str, Any]]] = {}
        self.nodes: dict[int, torch.fx.Node] = {}

    def sources(self) -> dict[int, tuple[torch.Tensor, str]]:
        if self._sources is None:  # built on first use: fx collects the tensor attributes when tracing starts
            root = self.tracer.root
            found = {id(t): (t, name) for name, t in root.named_buffers()}
            for t, name in getattr(self.tracer, "tensor_attrs", {}).items():
                if isinstance(t, torch.Tensor):
                    found.setdefault(id(t), (t, name))
            self._sources = found
        return self._sources

    def _known(self, v: Any) -> bool:
        return isinstance(v, torch.Tensor) and (id(v) in self.made or id(v) in self.sources())

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        if not any(self._known(v) for v in leaves):
            return out
        if _mutates(func, args, kwargs):
            self.made.clear()
            self.nodes.clear()
            self._sources = {}  # the buffers were written at trace time: keep folding from here on
            return out
        if (
            isinstance(out, torch.Tensor)
            and not isinstance(out, (torch.fx.Proxy, nn.Parameter))
            and not any(isinstance(v, torch.fx.Proxy) for v in leaves)
            and not any(v is out for v in leaves)
        ):
            self.made[id(out)] = (out, func, tuple(args), dict(kwargs))
        return out

    def node_of(self, a: torch.Tensor) -> torch.fx.Node | None:
        """The graph node computing ``a`` from buffers at run time, or None (not derived from them)."""
        key = id(a)
        entry = self.made.get(key)
        if entry is None or entry[0] is not a:
            return None
        if key not in self.nodes:
            self.nodes[key] = self._replay(entry[1], entry[2], entry[3]).node
        return self.nodes[key]

    def _proxy(self, v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if id(v) in self.made and self.made[id(v)][0] is v:
            return torch.fx.Proxy(self.node_of(v), self.tracer)  # type: ignore[arg-type]
        src = self.sources().get(id(v))
        if src is not None and src[0] is v:
            return self.tracer.create_proxy("get_attr", src[1], (), {})
        return v  # another constant: fx folds it as before

    def _replay(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.fx.Proxy:
        pargs, pkwargs = torch.utils._pytree.tree_map(self._proxy, (args, kwargs))
        if func in _REFLECTED:
            return _REFLECTED[func](pargs[1], pargs[0])  # type: ignore[no-any-return]
        if func in _OPERATORS:
            return _OPERATORS[func](*pargs, **pkwargs)  # type: ignore[no-any-return]
        if torch.overrides.is_tensor_method_or_property(func):  # b.float(), b.T: a method / attribute of the proxy
            name = getattr(func, "__name__", "")
            if name == "__get__":
                return getattr(pargs[0], func.__self__.__name__)  # type: ignore[no-any-return]
            return getattr(pargs[0], name)(*pargs[1:], **pkwargs)  # type: ignore[no-any-return]
        return func(*pargs, **pkwargs)  # type: ignore[no-any-return]


def placeholders_first(graph: torch.fx.Graph) -> None:
    """Move every placeholder before the first other node (the getitems of a list input are
    created between the placeholders), keeping their order."""
    first: torch.fx.Node | None = None
    for n in list(graph.nodes):
        if n.op != "placeholder":
            first = first or n
        elif first is not None:
            first.prepend(n)


class _PiecesProxy(torch.fx.Proxy):
    """fx's Proxy whose ``len`` is known for a ``chunk`` / ``split`` with a literal piece count
    (``list(...)`` asks for the length before iterating)."""

    def __len__(self) -> int:
        tracer = self.tracer
        n = tracer.pieces_of(self.node) if isinstance(tracer, QirTracer) else static_piece_count(self.node)
        return super().__len__() if n is None else n

    # ``y += v`` records the in-place operator (fx's Proxy has none, so Python fell back to
    # ``y = y + v``, and a ``z = y`` taken before kept reading the old value):
    # functionalize_inplace then makes every later read of y's old node read the sum; the node is
    # named as fx names the add it traced before (``add``, ``add_1``)
    def __iadd__(self, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", operator.iadd, (self, other), {}, name="add")

    def __isub__(self, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", operator.isub, (self, other), {}, name="sub")

    def __imul__(self, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", operator.imul, (self, other), {}, name="mul")

    def __itruediv__(self, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", operator.itruediv, (self, other), {}, name="truediv")

    def __ifloordiv__(self, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", operator.ifloordiv, (self, other), {}, name="floordiv")


def measure_pieces(
    root: nn.Module, graph: torch.fx.Graph, example_args: tuple[Any, ...], names: set[str]
) -> dict[str, int]:
    """How many pieces each ``chunk`` node in ``names`` returns when ``graph`` runs on the example
    inputs. The run stops at the first failure (indexing a piece torch did not return) with the
    counts seen so far; buffers it updates (batch-norm statistics, observers) are restored."""
    gm = torch.fx.GraphModule(root, copy.deepcopy(graph))
    counts: dict[str, int] = {}

    class _Counter(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            if n.name in names and isinstance(out, (tuple, list)):
                counts[n.name] = len(out)
            return out

    saved = [(t, t.detach().clone()) for m in root.modules() for t in m._buffers.values() if t is not None]
    try:
        with torch.no_grad():
            _Counter(gm).run(*example_args)
    except Exception:  # the counts measured before the failure are what the retrace needs
        pass
    finally:
        with torch.no_grad():
            for t, data in saved:
                t.copy_(data)
    return counts


def _is_chunk(node: torch.fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "chunk") or (
        node.op == "call_function" and node.target is torch.chunk
    )


def static_piece_count(node: torch.fx.Node) -> int | None:
    """How many tensors ``chunk(n)`` / ``split([sizes])`` at ``node`` returns, when the call says
    it (a literal int chunk count, a literal list of split sizes); None otherwise. A chunk count
    is an upper bound: torch returns fewer pieces when the size is small for it (``chunk(4)`` of
    5 gives 3); with example inputs the tracer measures the real count (QirTracer.pieces_of).
    Without, indexing a missing piece fails when the traced model runs (IndexError), never silently."""
    is_method = node.op == "call_method"
    is_function = node.op == "call_function"
    if (is_method and node.target == "chunk") or (is_function and node.target is torch.chunk):
        n = node.args[1] if len(node.args) > 1 else node.kwargs.get("chunks")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None
    if (is_method and node.target == "split") or (is_function and node.target is torch.split):
        sizes = (
            node.args[1]
            if len(node.args) > 1
            else node.kwargs.get("split_size_or_sections", node.kwargs.get("split_size"))
        )
        if isinstance(sizes, (list, tuple)) and all(isinstance(v, int) for v in sizes):
            return len(sizes)
    return None


def whole_chunk_calls(graph: torch.fx.Graph) -> list[str]:
    """The ``chunk(n)`` calls of ``graph`` whose pieces it reads up to the n-th (``a, b, c, d = x.chunk(4)``,
    a loop over them), described for an error message. Traced without example inputs, each assumes
    torch returns n pieces, which it does only when the size along the dim allows (``chunk(4)`` of 5
    channels gives 3): a run on a smaller size indexes a piece that is not there."""
    found = []
    for n in graph.nodes:
        k = static_piece_count(n) if _is_chunk(n) else None
        if k is None:
            continue
        read = [u.args[1] for u in n.users if u.target is operator.getitem and isinstance(u.args[1], int)]
        if read and max(read) == k - 1:
            dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
            found.append(f"'{n.name}' (chunk({k}, dim={dim}))")
    return found


#: Tensor methods whose in-place form (``x.sigmoid_()``, CenterNet's ``_sigmoid``) is traced as the
#: out-of-place call, so it gets the same IR op (a table lookup, a FloatFunctional, ...)
_INPLACE_METHODS = frozenset(
    {"sigmoid", "tanh", "relu", "clamp", "clamp_min", "clamp_max", "exp", "abs", "neg", "add", "sub", "mul", "div"}
)
#: producers whose result may share memory with another value: mutating it in place would show
#: through the other value too, which the out-of-place call cannot, so those calls stay as written
_VIEW_METHODS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "permute",
        "transpose",
        "narrow",
        "select",
        "expand",
        "expand_as",
        "squeeze",
        "unsqueeze",
        "flatten",
        "unflatten",
        "contiguous",
        "t",
        "as_strided",
        "detach",
        "chunk",
        "split",
        "unbind",
        "__getitem__",
    }
)


def functionalize_inplace(graph: torch.fx.Graph, root: nn.Module | None = None) -> None:
    """Make every in-place call a data dependency: each later use of the tensor it writes reads
    the call's result instead (the same values), so a call whose result is discarded
    (``s.act(y); return y`` with ``nn.ReLU(inplace=True)``, ``F.relu(y, inplace=True)``,
    ``y += 1`` after ``z = y``) is not dead code. In-place calls are the ``x.name_()`` methods,
    ``torch.name_`` / ``F.name_`` functions, ``+=`` and the other augmented assignments, functions
    called with ``inplace=True`` and modules whose ``inplace`` attribute is true. Where the
    out-of-place spelling is the same op (:data:`_INPLACE_METHODS`, ``+=``), the call becomes it,
    so it gets the IR op that spelling has. A write into a placeholder, parameter or buffer keeps
    its in-place call; a write into what may be a view of another value (``y[:, :2].relu_()``)
    is left as written (a function spelled with ``_`` so the IR keeps it) and its later readers read
    the other value; ``v += 1`` there stays ``v = v + 1``, as fx traces it (an FPN's ``feats[0] += ...``
    on a list input is an add).
    ``root`` is the traced module (for the modules' ``inplace`` attribute)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in list(graph.nodes):
        receiver = _inplace_receiver(n, root)
        if receiver is None:
            continue
        if _may_alias(receiver):
            if n.target in _AUGMENTED:  # as fx traces it (``v = v + 1``): an FPN's `feats[0] += ...` stays an add
                n.target = _AUGMENTED[n.target]
            else:
                _keep_write_through_view(n, root)
            continue
        if receiver.op not in ("get_attr", "placeholder") or n.target in _AUGMENTED:
            _out_of_place(n)
        for u in list(receiver.users):
            if u is not n and order[u] > order[n]:
                u.replace_input_with(receiver, n)


#: ``y += v`` and the other augmented assignments, as traced, and their out-of-place operators
_AUGMENTED: dict[Any, Callable[..., Any]] = {
    getattr(operator, f"i{n}"): getattr(operator, n) for n in ("add", "sub", "mul", "truediv", "floordiv")
}


def _is_inplace_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__") and not name.startswith("_")


def _inplace_receiver(n: torch.fx.Node, root: nn.Module | None) -> torch.fx.Node | None:
    """The node whose tensor ``n`` writes into, when ``n`` is an in-place call of a node."""
    first = n.args[0] if n.args else None
    if n.op == "call_method":
        inplace = isinstance(n.target, str) and _is_inplace_name(n.target)
    elif n.op == "call_function":
        inplace = (
            n.target in _AUGMENTED
            or (_is_inplace_name(getattr(n.target, "__name__", "")) and _torch_function(n.target))
            or _inplace_argument(n)
        )
    elif n.op == "call_module" and isinstance(n.target, str):
        owner = root if root is not None else n.graph.owning_module
        try:
            m = owner.get_submodule(n.target) if owner is not None else None
        except AttributeError:
            m = None
        inplace = getattr(m, "inplace", False) is True
    else:
        return None
    return first if inplace and isinstance(first, torch.fx.Node) else None


def _torch_function(f: Any) -> bool:
    return any(getattr(ns, getattr(f, "__name__", ""), None) is f for ns in (torch, torch.nn.functional))


def _inplace_argument(n: torch.fx.Node) -> bool:
    """Whether a function call passes ``inplace=True`` (by name or by position)."""
    if n.kwargs.get("inplace") is True:
        return True
    if not callable(n.target) or not any(a is True for a in n.args):
        return False
    try:
        params = list(inspect.signature(n.target).parameters)
    except (TypeError, ValueError):
        return False
    return "inplace" in params and params.index("inplace") < len(n.args) and n.args[params.index("inplace")] is True


def _out_of_place(n: torch.fx.Node) -> None:
    """Respell an in-place call as its out-of-place form when that is the same op."""
    if n.op == "call_method" and n.target[:-1] in _INPLACE_METHODS:  # type: ignore[index]
        n.target = n.target[:-1]  # type: ignore[index]
    elif n.op == "call_function" and n.target in _AUGMENTED:
        n.target = _AUGMENTED[n.target]
    elif n.op == "call_function" and getattr(n.target, "__name__", "")[:-1] in _INPLACE_METHODS:
        name = n.target.__name__[:-1]  # type: ignore[union-attr]
        ns = torch if getattr(torch, n.target.__name__, None) is n.target else torch.nn.functional  # type: ignore[union-attr]
        if callable(getattr(ns, name, None)):
            n.target = getattr(ns, name)


def _keep_write_through_view(n: torch.fx.Node, root: nn.Module | None) -> None:
    """Spell ``F.relu(v, inplace=True)`` on a possible view ``v`` as ``F.relu_(v)``: the IR keeps a
    call whose name ends in ``_`` even when its result is unused (the write is its effect), but
    drops an unused ``relu``. A module call there has no such spelling: refused when its result is unused."""
    if n.op == "call_function" and n.target not in _AUGMENTED and _inplace_argument(n):
        name = f"{getattr(n.target, '__name__', '')}_"
        for ns in (torch.nn.functional, torch):
            if callable(getattr(ns, name, None)) and "inplace" in n.kwargs:
                n.target = getattr(ns, name)
                n.kwargs = {k: v for k, v in n.kwargs.items() if k != "inplace"}
                return
    if n.op == "call_module" and not n.users:
        raise TraceError(
            f"module '{n.target}' ({type(root.get_submodule(str(n.target))).__name__ if root else 'module'}) at node "
            f"'{n.name}' runs in place on '{n.args[0]}', which may be a view of another tensor, and its result is "
            "unused: a traced graph holds values, not memory, so the write would be lost. Assign the result and "
            "put it back (`y = torch.cat([act(y[:, :2]), y[:, 2:]], 1)`) or call it on the whole tensor."
        )


def _may_alias(x: torch.fx.Node) -> bool:
    if x.op == "call_method":
        return str(x.target) in _VIEW_METHODS
    if x.op == "call_function":
        name = getattr(x.target, "__name__", "")
        return x.target is operator.getitem or name in _VIEW_METHODS or name in ("flatten", "reshape", "squeeze")
    return False


def _ff_method_names(cls: type) -> list[str]:
    """Public methods a FloatFunctional class adds over nn.Module (add, cat, mul_scalar, ...)."""
    names = []
    for name in dir(cls):
        if name.startswith("_") or name == "forward" or hasattr(nn.Module, name):
            continue
        if callable(getattr(cls, name, None)) and not isinstance(getattr(cls, name), type):
            names.append(name)
    return names


@contextlib.contextmanager
def patch_float_functional(tracer: QirTracer) -> Iterator[None]:
    """While tracing, ``ff.add(x, y)`` with traced arguments records ``get_attr(ff)`` and
    ``call_method("add", ff, x, y)``: one node, not a trace through the method body. The QAT
    and integer FloatFunctional classes too, so an eager QAT or converted model traces to the
    graph a ``convert_fx`` model has."""
    saved: list[tuple[type, str, Any]] = []

    def patched(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if _find_proxy(args, kwargs) is None:
                return orig(self, *args, **kwargs)
            ff = tracer.create_proxy("get_attr", tracer.ff_path(self), (), {})
            return tracer.create_proxy("call_method", name, (ff, *args), kwargs)

        return method

    try:
        for cls in functional_method_classes():
            for name in _ff_method_names(cls):
                orig = cls.__dict__.get(name)
                if orig is None:
                    orig_attr = getattr(cls, name)
                    saved.append((cls, name, None))
                else:
                    orig_attr = orig
                    saved.append((cls, name, orig))
                setattr(cls, name, patched(name, orig_attr))
        yield
    finally:
        for cls, name, orig in reversed(saved):
            if orig is None:
                delattr(cls, name)
            else:
                setattr(cls, name, orig)


def _traced_len(obj: Any) -> Any:
    """``len(x)`` while tracing: one ``call_function(len, x)`` node for a traced value (fx's
    Proxy refuses ``len``), the builtin otherwise."""
    if isinstance(obj, torch.fx.Proxy):
        return obj.tracer.create_proxy("call_function", len, (obj,), {})
    return len(obj)


@contextlib.contextmanager
def patch_len(root: nn.Module) -> Iterator[None]:
    """While tracing, ``len`` in the modules' forward code records a node (``b = len(x)`` is a
    batch size users compute like ``x.shape[0]``). Module globals that bind ``len`` to something
    other than the builtin keep it; the previous binding is restored afterwards."""
    patched: list[tuple[dict[str, Any], bool]] = []
    try:
        for m in root.modules():
            fwd = getattr(type(m).forward, "__globals__", None)
            if not isinstance(fwd, dict) or any(fwd is g for g, _ in patched):
                continue
            if fwd.get("len", builtins.len) is builtins.len:  # fx's generated code binds len itself
                patched.append((fwd, "len" in fwd))
                fwd["len"] = _traced_len
        yield
    finally:
        for g, had in patched:
            if g.get("len") is _traced_len:
                if had:
                    g["len"] = builtins.len
                else:
                    del g["len"]


def _user_frame(tb: Any) -> tuple[str, int, str] | None:
    """The innermost traceback frame outside torch and qir's front end: the user's line."""
    best = None
    for frame in traceback.extract_tb(tb):
        f = frame.filename
        if "/torch/" in f or "/qir/frontend/" in f or "/qir/utils/fx_helper" in f or f.startswith("<"):
            continue
        best = (f, frame.lineno or 0, (frame.line or linecache.getline(f, frame.lineno or 0)).strip())
    return best


def trace_error(tracer: QirTracer, root: nn.Module, exc: BaseException) -> TraceError:
    """A :class:`TraceError` naming the module being traced and the failing source line."""
    stack = tracer.failed_in or tracer._qir_stack
    path, cls = stack[-1] if stack else ("", type(root))
    where = f"module '{path}' ({cls.__name__})" if path else f"the root module ({cls.__name__})"
    if not path and tracer.is_leaf_module(root, ""):
        where += " (a leaf module as the root is traced through its forward; put it inside a container module)"
    loc = _user_frame(exc.__traceback__ or sys.exc_info()[2])
    line = f" at {loc[0]}:{loc[1]}: `{loc[2]}`" if loc else ""
    return TraceError(
        f"cannot trace {where}{line}: {type(exc).__name__}: {exc}\n"
        "Move the untraceable code (data-dependent control flow, non-torch calls) into a function or "
        "method decorated with qir.utils.fx_helper.wrap so it stays one opaque node, or pass the "
        "deciding values as concrete_args."
    )
