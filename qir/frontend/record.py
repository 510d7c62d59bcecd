"""Trace by running: the fx graph of the path a forward takes on concrete example inputs.

``torch.fx`` traces symbolically, so a forward with Python control flow on sizes
(``while x.size(-1) > 8``, ``if x.shape[-1] > 32``) cannot be traced, and eager mode exists for
such models. :func:`record` runs the model once on the example inputs and writes down what it
executed, as the graph ``QirTracer`` would have produced for that path: the same leaf modules
(``call_module``), ``FloatFunctional`` method calls (``get_attr`` + ``call_method``), tensor
methods (``call_method``), torch functions and Python operators (``call_function``) outside them.
Whatever the forward decided in Python is frozen into the graph: the branches taken, the
iteration counts of loops, and every size read from a tensor that depends on the inputs
(:class:`Specialization` lists them, with their source lines).

What cannot be frozen is refused with :class:`SpecializationError` naming the module and the
source line: a Python decision on tensor *values* (``if x.sum() > 0``, ``x.item()``,
``int(x.max())``) would replay the example's answer for every input. Tensors that come from
nowhere the graph can name (not an input, parameter or buffer, nor made by a torch call in the
forward) are refused too.
"""

from __future__ import annotations

import builtins
import inspect
import operator
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch
import torch.fx
from torch import nn
from torch.overrides import TorchFunctionMode

from qir.frontend.lookup import functional_method_classes
from qir.frontend.tracer import QirTracer, TraceError, _ff_method_names
from qir.ir.graph import Graph

__all__ = ["Specialization", "SpecializationError", "record", "same_outputs", "trace_or_record"]


class SpecializationError(TraceError):
    """The forward's executed path cannot stand for other inputs (a decision on tensor values)."""


@attrs.frozen
class Specialization:
    """What a graph recorded by :func:`record` fixes to the example inputs.

    ``input_shapes``: the example's shapes. ``size_reads``: ``"file:line `code`: what = value"``
    for every size the forward read from a tensor computed from the inputs (its Python control
    flow and shape arithmetic ran with these values). ``repeated``: leaf modules the path
    called more than once (loop trip counts, list lengths), with their counts. ``why``: why fx
    could not trace the model.
    """

    input_shapes: tuple[tuple[int, ...] | None, ...]
    size_reads: tuple[str, ...]
    repeated: tuple[tuple[str, int], ...]
    calls: int
    why: str = ""

    @property
    def exact_shapes(self) -> bool:
        """Whether the graph holds only for inputs of exactly the example's shapes (batch
        included): true as soon as the forward read a size of a value computed from the inputs."""
        return bool(self.size_reads)

    def lines(self) -> list[str]:
        """The statement of what the recorded graph specializes, one fact per line."""
        shapes = ", ".join(str(list(s)) if s is not None else "-" for s in self.input_shapes)
        out = [
            f"recorded by running the forward on example inputs of shape {shapes} ({self.calls} module calls): "
            "Python branches and loop counts are those of this run"
        ]
        if self.why:
            out.append(f"fx could not trace it: {self.why}")
        if self.exact_shapes:
            out.append("inputs must have exactly these shapes (batch included): the forward read sizes")
            out += [f"size read: {r}" for r in self.size_reads]
        else:
            out.append("the forward read no size of a value computed from the inputs: only the batch may differ")
        out += [f"called {n} times: {p}" for p, n in self.repeated]
        return out


# Tensor methods / properties that read sizes: the result is frozen into the graph
_SIZE_READS = {"size", "numel", "__len__", "shape", "nelement"}
# rank reads: the runtime fixes the rank anyway, so they specialize nothing
_RANK_READS = {"dim", "ndim", "ndimension"}
# calls whose number of outputs follows a size: Python loops over them run that many times
_SPLITS = {"unbind", "split", "chunk", "tensor_split", "split_with_sizes", "hsplit", "vsplit", "dsplit"}
# reads of tensor values into Python: a decision on them cannot be frozen
_VALUE_READS = {
    "__bool__",
    "item",
    "tolist",
    "__int__",
    "__float__",
    "__index__",
    "__complex__",
    "numpy",
    "__array__",
}
# calls that read nothing the graph needs (printing, metadata)
_NEUTRAL = {"__repr__", "__format__", "__str__", "dtype", "device", "is_floating_point", "requires_grad", "is_cuda"}


def _user_line() -> str:
    """``file:line `code``` of the innermost frame outside torch and qir's front end."""
    best = ""
    for frame in traceback.extract_stack():
        f = frame.filename
        if "/torch/" in f or "/qir/frontend/" in f or "/qir/quantization/eager" in f or f.startswith("<"):
            continue
        best = f"{f}:{frame.lineno} `{(frame.line or '').strip()}`"
    return best or "<unknown line>"


@attrs.define
class _Entry:
    tensor: torch.Tensor  # kept alive: ids are the keys
    node: torch.fx.Node
    dep: bool  # computed from the inputs


class _Recorder(TorchFunctionMode):
    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.root = root
        self.graph = torch.fx.Graph()
        self.env: dict[int, _Entry] = {}
        self.depth = 0  # > 0 inside a leaf module or a FloatFunctional method
        self.stack: list[str] = []  # module paths being run (for messages)
        self.size_reads: dict[str, list[str]] = {}  # source line -> values read there, in order
        self.calls: Counter[str] = Counter()
        self.paths: dict[int, str] = {}
        for p, m in root.named_modules():
            self.paths.setdefault(id(m), p)
        self.state: dict[int, str] = {}
        for prefix, m in root.named_modules():
            for name, t in list(m._parameters.items()) + list(m._buffers.items()):
                if t is not None:
                    self.state.setdefault(id(t), f"{prefix}.{name}" if prefix else name)
        self.attrs: dict[str, torch.fx.Node] = {}

    # -- values ---------------------------------------------------------------
    def where(self) -> str:
        mod = f"module '{self.stack[-1]}'" if self.stack and self.stack[-1] else f"{type(self.root).__name__}.forward"
        return f"{mod} at {_user_line()}"

    def get_attr(self, target: str) -> torch.fx.Node:
        if target not in self.attrs:
            self.attrs[target] = self.graph.get_attr(target)
        return self.attrs[target]

    def lift(self, a: Any) -> tuple[Any, bool]:
        """``a`` with tensors replaced by their nodes; whether any depends on the inputs."""
        dep = False

        def one(x: Any) -> Any:
            nonlocal dep
            if isinstance(x, torch.Tensor):
                e = self.env.get(id(x))
                if e is not None and e.tensor is x:
                    dep = dep or e.dep
                    return e.node
                key = self.state.get(id(x))
                if key is not None:
                    return self.get_attr(key)
                raise TraceError(
                    f"{self.where()}: a tensor of shape {list(x.shape)} enters the forward from outside (not an input, "
                    "a parameter or buffer, nor made by a torch call in the forward); register it as a buffer of "
                    "the module so the recorded graph can name it"
                )
            if isinstance(x, torch.Size):
                return tuple(int(d) for d in x)
            if isinstance(x, nn.Module):
                path = self.paths.get(id(x))
                if path is None:
                    raise TraceError(
                        f"{self.where()}: a module that is not a submodule of the model is passed to a call"
                    )
                return self.get_attr(path)
            return x

        return torch.fx.node.map_aggregate(a, one), dep

    def bind(self, out: Any, node: torch.fx.Node, dep: bool) -> None:
        """Map ``out`` (a tensor, or tensors in tuples / lists) to ``node`` (and getitem nodes)."""
        if isinstance(out, torch.Tensor):
            self.env[id(out)] = _Entry(out, node, dep)
            node.meta["qir_dep"] = dep
        elif isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                if isinstance(o, (torch.Tensor, tuple, list)):
                    self.bind(o, self.graph.call_function(operator.getitem, (node, i)), dep)

    def tracked(self, args: Any) -> tuple[bool, bool]:
        """Whether ``args`` hold a recorded tensor, and whether one depends on the inputs."""
        found = dep = False

        def one(x: Any) -> Any:
            nonlocal found, dep
            if isinstance(x, torch.Tensor):
                e = self.env.get(id(x))
                if e is not None and e.tensor is x:
                    found = True
                    dep = dep or e.dep
            return x

        torch.fx.node.map_aggregate(args, one)
        return found, dep

    # -- torch calls outside leaves -------------------------------------------
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.depth:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a tensor property: .shape, .T, .dtype, ...
            attr = getattr(getattr(func, "__self__", None), "__name__", "")
            return self.prop(func, attr, args, kwargs)
        found, dep = self.tracked((args, kwargs))
        if name == "__iter__" and found:  # `for row in x`: the rows are unbind's outputs
            rows = list(func(*args, **kwargs))
            (target,), dep = self.lift(tuple(args[:1]))
            if dep:
                self.read("unbind gives a number of tensors set by a size", len(rows))
            self.bind(rows, self.graph.call_method("unbind", (target, 0)), dep)
            return iter(rows)
        if name in _VALUE_READS or name in _SIZE_READS or name in _RANK_READS or name in _NEUTRAL:
            out = func(*args, **kwargs)
            if name in _VALUE_READS and dep:
                raise SpecializationError(
                    f"{self.where()}: Tensor.{name} reads tensor values into Python, so the recorded path would "
                    "replay this input's decision for every input. Compute it with tensor ops (torch.where, a mask), "
                    "or move the code after the DeQuantStub into post-processing outside the compiled model"
                )
            if name in _SIZE_READS and dep:
                self.read(name, out)
            return out
        out = func(*args, **kwargs)
        self.record_call(func, name, args, kwargs, out, found)
        return out

    def read(self, what: str, value: Any) -> None:
        seen = self.size_reads.setdefault(f"{_user_line()}: {what}", [])
        shown = _show(value)
        if shown not in seen:
            seen.append(shown)

    def prop(self, func: Any, attr: str, args: Any, kwargs: Any) -> Any:
        out = func(*args, **kwargs)
        found, dep = self.tracked(args)
        if attr in _SIZE_READS and dep:
            self.read(attr, out)
        elif isinstance(out, torch.Tensor) and found:
            (target,), _ = self.lift(tuple(args[:1]))
            self.bind(out, self.graph.call_function(builtins.getattr, (target, attr)), dep)
        return out

    def record_call(self, func: Any, name: str, args: Any, kwargs: Any, out: Any, found: bool) -> None:
        if name == "__setitem__":
            raise TraceError(
                f"{self.where()}: `x[...] = value` writes into a tensor in place, which the recorded graph cannot "
                "express; build the tensor with torch.cat, torch.where or masked_fill instead"
            )
        if not _has_tensor(out):
            return  # no tensor comes out: nothing later can read it from the graph
        (largs, lkwargs), dep = self.lift((tuple(args), dict(kwargs)))
        if dep and name in _SPLITS and isinstance(out, (tuple, list)):
            self.read(f"{name} gives a number of tensors set by a size", len(out))  # `for r in x` unbinds
        if name.startswith("__") and name.endswith("__"):
            base = name[2:-2]
            target: Callable[..., Any] | None = getattr(operator, base, None)
            if target is not None:
                node = self.graph.call_function(target, largs, lkwargs)
            elif base.startswith("r") and getattr(operator, base[1:], None) is not None:
                node = self.graph.call_function(getattr(operator, base[1:]), (largs[1], largs[0]), lkwargs)
            else:
                raise TraceError(f"{self.where()}: Tensor.{name} has no graph form; write it as a torch call")
        elif getattr(torch.Tensor, name, None) is func:
            node = self.graph.call_method(name, largs, lkwargs)
        else:
            node = self.graph.call_function(func, largs, lkwargs)
        self.bind(out, node, dep)

    # -- module calls ---------------------------------------------------------
    def pre(self, m: nn.Module, args: Any, kwargs: Any) -> None:
        path = self.paths.get(id(m), "")
        self.stack.append(path)
        if self.depth == 0 and m.__dict__.get(_LEAF, False):
            (largs, lkwargs), dep = self.lift((tuple(args), dict(kwargs)))
            node = self.graph.call_module(path, largs, lkwargs)
            m.__dict__.setdefault(_NODES, []).append((node, dep))
            self.calls[path] += 1
            self.depth += 1
        elif m.__dict__.get(_LEAF, False):
            self.depth += 1

    def post(self, m: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        self.stack.pop()
        if not m.__dict__.get(_LEAF, False):
            return
        self.depth -= 1
        if self.depth == 0:
            node, dep = m.__dict__[_NODES].pop()
            self.bind(out, node, dep)

    def method(self, ff: nn.Module, name: str, orig: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        found, _ = self.tracked((args, kwargs))
        path = self.paths.get(id(ff))
        if self.depth or not found or path is None:
            return orig(ff, *args, **kwargs)
        (largs, lkwargs), dep = self.lift((tuple(args), dict(kwargs)))
        node = self.graph.call_method(name, (self.get_attr(path), *largs), lkwargs)
        self.calls[path] += 1
        self.stack.append(path)
        self.depth += 1
        try:
            out = orig(ff, *args, **kwargs)
        finally:
            self.depth -= 1
            self.stack.pop()
        self.bind(out, node, dep)
        return out


_LEAF = "_qir_record_leaf"
_NODES = "_qir_record_nodes"


def _has_tensor(out: Any) -> bool:
    if isinstance(out, torch.Tensor):
        return True
    if isinstance(out, (tuple, list)):
        return any(_has_tensor(o) for o in out)
    return False


def _show(v: Any) -> str:
    if isinstance(v, torch.Size):
        return str(list(v))
    return str(v)


def _leaves(root: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]:
    """Every module fx would reach, and whether it is a leaf (``QirTracer``'s rule)."""
    tracer = QirTracer()

    def visit(m: nn.Module, path: str) -> Iterator[tuple[str, nn.Module, bool]]:
        # containers are never called; fx's rule would call a ModuleList (a torch.nn class) a leaf
        container = isinstance(m, (nn.ModuleList, nn.ModuleDict))
        leaf = bool(path) and not container and tracer.is_leaf_module(m, path)
        yield path, m, leaf
        if not leaf:
            for name, child in m.named_children():
                yield from visit(child, f"{path}.{name}" if path else name)

    yield from visit(root, "")


def record(
    module: nn.Module, example_inputs: tuple[Any, ...], why: str = ""
) -> tuple[torch.fx.Graph, Specialization, Any]:
    """Run ``module`` on ``example_inputs`` and return the fx graph of the path it took, what
    that graph specializes, and the forward's output (for the caller's agreement check).

    The module is run under ``no_grad``; buffers it updates are restored. ``why``: the reason
    fx could not trace it (stated in the :class:`Specialization`)."""
    rec = _Recorder(module)
    names = _input_names(module, len(example_inputs))
    for name, x in zip(names, example_inputs, strict=True):
        if not isinstance(x, torch.Tensor):
            raise TraceError(
                f"recording {type(module).__name__}'s forward needs tensor example inputs; input '{name}' is a "
                f"{type(x).__name__}"
            )
        rec.bind(x, rec.graph.placeholder(name), True)
    hooks: list[Any] = []
    marked: list[nn.Module] = []
    saved_ff: list[tuple[type, str, Any]] = []
    saved_state = [(t, t.detach().clone()) for t in module.buffers()]
    try:
        for _, m, leaf in _leaves(module):
            if m is module:
                continue
            m.__dict__[_LEAF] = leaf
            marked.append(m)
            hooks.append(m.register_forward_pre_hook(lambda m, a, k: rec.pre(m, a, k), with_kwargs=True))
            hooks.append(
                m.register_forward_hook(lambda m, a, k, o: rec.post(m, a, k, o), with_kwargs=True, always_call=True)
            )
        for cls in functional_method_classes():
            for name in _ff_method_names(cls):
                saved_ff.append((cls, name, cls.__dict__.get(name)))
                setattr(cls, name, _patched(rec, name, getattr(cls, name)))
        with torch.no_grad(), rec:
            out = module(*example_inputs)
        (lout,), _ = rec.lift((out,))
        rec.graph.output(lout)
    finally:
        for cls, name, orig in reversed(saved_ff):
            if orig is None:
                delattr(cls, name)
            else:
                setattr(cls, name, orig)
        for h in hooks:
            h.remove()
        for m in marked:
            m.__dict__.pop(_LEAF, None)
            m.__dict__.pop(_NODES, None)
        with torch.no_grad():
            for t, data in saved_state:
                t.copy_(data)
    spec = Specialization(
        input_shapes=tuple(tuple(x.shape) for x in example_inputs),
        size_reads=tuple(f"{line} = {', '.join(values)}" for line, values in rec.size_reads.items()),
        repeated=tuple((p, n) for p, n in rec.calls.items() if n > 1),
        calls=sum(rec.calls.values()),
        why=why,
    )
    _drop_unused_reads(rec.graph)
    return rec.graph, spec, out


def _drop_unused_reads(graph: torch.fx.Graph) -> None:
    """Remove the getitem / get_attr nodes nothing reads (made for every output of a tuple)."""
    for n in reversed(list(graph.nodes)):
        if not n.users and (n.op == "get_attr" or (n.op == "call_function" and n.target is operator.getitem)):
            graph.erase_node(n)


def _patched(rec: _Recorder, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return rec.method(self, name, orig, args, kwargs)

    method.__name__ = name
    return method


def _input_names(module: nn.Module, n: int) -> list[str]:
    """The forward's parameter names for ``n`` positional inputs (``input_<i>`` past them)."""
    try:
        params = [
            p.name
            for p in inspect.signature(module.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"input_{i}" for i in range(n)]


def positional_inputs(example_inputs: Any, where: str = "example_inputs") -> tuple[Any, ...]:
    """The forward's positional arguments from ``example_inputs``: a tensor or a dict is the one
    argument (``forward(self, data)`` reading ``data["img"]``, seed 001's RetinaNet), a list or
    tuple holds one argument per item (an FPN head's ``feats`` list is then an item: ``([f1, f2],)``)."""
    if isinstance(example_inputs, (torch.Tensor, Mapping)):
        return (example_inputs,)
    if isinstance(example_inputs, (list, tuple)):
        return tuple(example_inputs)
    raise TypeError(
        f"{where} must be a tensor, a dict (one argument) or a list / tuple of the forward's positional "
        f"arguments, got {type(example_inputs).__name__}"
    )


def trace_or_record(module: nn.Module, example_inputs: Any) -> tuple[Graph, Specialization | None]:
    """``qir.frontend.trace(module, example_inputs)``, or, when fx cannot trace ``module``, the IR
    of the path its forward takes on ``example_inputs`` (:func:`record`) with the
    :class:`Specialization` it implies (None for a symbolic trace).

    The recorded graph is replayed on the example inputs and must give the forward's outputs bit
    for bit; otherwise (a forward that is not a function of its inputs, parameters and buffers,
    e.g. random or stateful) :class:`TraceError` says so."""
    from qir.frontend.convert import _Converter, gc_paused, propagate, trace

    inputs = positional_inputs(example_inputs)
    try:
        return trace(module, inputs), None
    except TraceError as e:
        if isinstance(module, torch.fx.GraphModule):
            raise
        symbolic = e
    why = str(symbolic).splitlines()[0]
    try:
        fx_graph, spec, out = record(module, inputs, why)
    except SpecializationError:
        raise
    except TraceError as e:
        raise TraceError(f"{symbolic}\nRecording the forward on the example inputs failed too: {e}") from e
    with gc_paused():
        values = propagate(module, fx_graph, inputs)
        output = next(n for n in fx_graph.nodes if n.op == "output")
        replay = torch.fx.node.map_arg(output.args[0], lambda a: values[a.name])
        if not same_outputs(replay, out):
            raise TraceError(
                f"the graph recorded from {type(module).__name__}'s forward does not reproduce its output on the "
                "example inputs: the forward is not a function of its inputs, parameters and buffers alone "
                "(randomness, state kept between calls); make it one in eval mode"
            )
        return _Converter(module, values).run(fx_graph), spec


def same_outputs(a: Any, b: Any) -> bool:
    """Bit-equal nested outputs."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_outputs(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_outputs(a[k], b[k]) for k in a)
    return bool(a == b)
