"""IR graph -> ``torch.fx.GraphModule``: ``emit(graph)``.

Module-backed nodes with a scope become ``call_module`` of a module rebuilt by
``op.to_module`` at that qualified path (sharing the constant tensors), or of the module a
pass built for the node already (:mod:`qir.ir.prebuilt`, taken once); opaque module
calls and FloatFunctional calls re-install the original object from ``Graph.objects``;
every other op is emitted as its torch call. Constants are installed at their state-dict
keys as parameters, buffers or non-persistent buffers, in the source model's order.
"""

from __future__ import annotations

import builtins
import inspect
import operator
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from qir.frontend.convert import MODULE_ORDER_KEY
from qir.frontend.lookup import functional_method_classes
from qir.frontend.sequences import SEQUENCE_LENGTHS_KEY, install_length_guard
from qir.ir.graph import Graph, Node, Value, map_values
from qir.ir.op import IRError, ModuleOp, Ref, resolve, torch_call_of
from qir.ir.ops.core import Call, Constant, GetAttr, GetItem, Identity, resolve_target
from qir.ir.ops.elementwise import BinaryOp
from qir.ir.prebuilt import PREBUILT_MODULE_KEY, PrebuiltModule
from qir.utils.fx_helper import wrapped_original


class EmitError(IRError):
    """A node could not be expressed in torch; the message names it."""


def emit(graph: Graph, *, class_name: str | None = None) -> torch.fx.GraphModule:
    """A GraphModule computing ``graph``; neither the graph nor objects it holds are changed
    (opaque modules and constant tensors are shared, not copied), except that a node's
    prebuilt module (:mod:`qir.ir.prebuilt`) goes to this model and no later one. A graph
    holding stand-in constants (``parse_graph(allow_unbound=True)``) is refused: the module
    would run on zeros."""
    graph.refuse_stand_ins("emit")
    return _Emitter(graph).run(class_name or graph.name or "GraphModule")


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


class _Emitter:
    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self.fx = torch.fx.Graph()
        self.env: dict[Value, Any] = {}
        self.modules: dict[str, nn.Module] = {}
        self.owned: set[str] = set()  # paths of modules built here (their mode follows the graph)
        self.signatures: dict[str, tuple[Any, ...]] = {}
        self.tensors: dict[str, tuple[torch.Tensor, str]] = {}

    # -- driver ----------------------------------------------------------------
    def run(self, class_name: str) -> torch.fx.GraphModule:
        for a in self.g.inputs:
            default = a.default if a.has_default else inspect.Signature.empty
            self.env[a] = self.fx.placeholder(a.name, default_value=default)
        for n in self.g.nodes:
            if isinstance(n.op, Constant):
                self.tensors[n.op.key] = (self.g.constants[n.op.key], n.op.kind)
                continue
            try:
                self.env[n] = self.node(n)
            except EmitError:
                raise
            except (IRError, NotImplementedError) as e:
                where = f" (module {n.scope})" if n.scope else ""
                raise EmitError(f"cannot emit %{n.name} = {n.op.name}{where}: {e}") from e
        self.fx.output(map_values(self.g.output, self.value))
        gm = torch.fx.GraphModule(nn.Module(), torch.fx.Graph(), class_name=class_name)
        self.install(gm)
        gm.graph = self.fx
        gm.training = mode = self.g.training
        # owned containers nest: walk the outermost ones, and set the flag only where it differs
        for path in self.owned:
            if any(p in self.owned for p in _prefixes(path)[:-1]):
                continue
            for m in gm.get_submodule(path).modules():
                if m.training != mode:
                    m.training = mode
        install_length_guard(gm, self.g.objects.get(SEQUENCE_LENGTHS_KEY, {}))
        return gm

    def value(self, v: Value) -> Any:
        if v not in self.env and isinstance(v, Node) and isinstance(v.op, Constant):
            self.env[v] = self.fx.get_attr(v.op.key)
        return self.env[v]

    def operands(self, n: Node) -> list[Any]:
        return [self.value(v) for v in n.operands]

    # -- nodes -----------------------------------------------------------------
    def node(self, n: Node) -> Any:
        op = n.op
        ff = self.g.objects.get(f"module:{n.scope}") if n.scope else None
        if isinstance(ff, nn.Module) and isinstance(ff, functional_method_classes()):  # float or QAT, kept whole
            return self.float_functional(n, ff)
        if isinstance(op, Call):
            return self.call(n, op)
        if isinstance(op, Identity):
            if n.scope:
                path = self.place(n.scope, nn.Identity(), ("identity",))
                return self.fx.call_module(path, (self.value(n.operands[0]),))
            return self.value(n.operands[0])
        if isinstance(op, GetItem):
            ops = self.operands(n)
            return self.fx.call_function(operator.getitem, (ops[0], resolve(op.index, ops)))
        if isinstance(op, GetAttr):
            return self.fx.call_function(builtins.getattr, (self.value(n.operands[0]), op.attr))
        if isinstance(op, ModuleOp) and n.scope:
            built = self.module_call(n, op, n.scope)
            if built is not None:
                return built
        torch_call = torch_call_of(op)
        if torch_call is not None:
            try:
                fn, args, kwargs = torch_call(self.operands(n))
                fname = getattr(fn, "__name__", "")
                if getattr(torch.Tensor, fname, None) is fn:
                    # Tensor methods read better (and print like the source) as method calls
                    return self.fx.call_method(fname, tuple(args), dict(kwargs))
                return self.fx.call_function(fn, tuple(args), dict(kwargs))
            except IRError:
                if not isinstance(op, ModuleOp):
                    raise
        if isinstance(op, ModuleOp):
            built = self.module_call(n, op, f"_qir_{n.name}")
            if built is not None:
                return built
        raise EmitError(f"cannot emit %{n.name} = {op.name}: the op has neither a torch call nor a module form")

    def module_call(self, n: Node, op: ModuleOp, scope: str) -> Any:
        """``call_module`` of ``op.to_module(...)`` at ``scope``; None when the op's state is
        not all constant (then the functional form is used)."""
        params = op.module_params(n.operands)
        roles = op.param_roles()
        if len(params) != len(roles) or not all(isinstance(p, Node) and isinstance(p.op, Constant) for p in params):
            return None
        tensors = {r: self.g.constants[p.op.key] for r, p in zip(roles, params, strict=False)}  # type: ignore[union-attr]
        signature = getattr(op, "module_signature", None)
        sig = (signature() if signature is not None else op, tuple(id(t) for t in tensors.values()))
        path = scope if self.signatures.get(scope) == sig else None
        if path is None:
            prebuilt = n.meta.get(PREBUILT_MODULE_KEY)
            module = prebuilt.take(op, tensors) if isinstance(prebuilt, PrebuiltModule) else None
            path = self.place(scope, module if module is not None else op.to_module(tensors), sig)
        inputs = [self.value(v) for v in op.module_inputs(n.operands)]
        method_call = getattr(op, "method_call", None)
        call = method_call(inputs) if method_call is not None else None
        if call is not None:  # a method of the module (QFunctional.add): self.<path>.<method>(...)
            method, margs, mkwargs = call
            return self.fx.call_method(method, (self.fx.get_attr(path), *margs), dict(mkwargs))
        module_call = getattr(op, "module_call", None)
        args, kwargs = module_call(inputs) if module_call is not None else (tuple(inputs), {})
        return self.fx.call_module(path, tuple(args), dict(kwargs))

    def place(self, scope: str, module: nn.Module, sig: tuple[Any, ...], owned: bool = True) -> str:
        """Install ``module`` at ``scope`` (or a fresh sibling path if another module is there)."""
        path, i = scope, 1
        while path in self.modules and self.signatures.get(path) != sig:
            path, i = f"{scope}_{i}", i + 1
        if path not in self.modules:
            self.modules[path] = module
            self.signatures[path] = sig
            if owned:
                self.owned.add(path)
        return path

    def call(self, n: Node, op: Call) -> Any:
        ops = self.operands(n)
        args, kwargs = resolve(op.args, ops), resolve(op.kwargs, ops)
        if op.kind == "module":
            key = f"module:{op.target}"
            if key not in self.g.objects:
                raise EmitError(f"cannot emit %{n.name}: no module object for {op.target!r} in graph.objects")
            m = self.g.objects[key]
            path = self.place(op.target, m, ("object", id(m)), owned=False)
            return self.fx.call_module(path, tuple(args), dict(kwargs))
        if op.kind == "method":
            return self.fx.call_method(op.target, tuple(args), dict(kwargs))
        fn = resolve_target(op.target, self.g.objects)
        node = self.fx.call_function(fn, tuple(args), dict(kwargs))
        # the generated code then re-registers it with torch.fx.wrap, so tracing the emitted module
        # again (a second prepare_qat_fx starts from the first one's float GraphModule) keeps it one call
        recorded = n.meta.get("is_wrapped")  # what torch.fx recorded when it traced the call
        if recorded is True or (recorded is None and _torch_fx_wrapped(fn)):
            node.meta["is_wrapped"] = True
        return node

    def float_functional(self, n: Node, ff: nn.Module) -> Any:
        """``self.<scope>.<method>(...)`` on the re-installed FloatFunctional."""
        assert n.scope is not None
        path = self.place(n.scope, ff, ("object", id(ff)), owned=False)
        op = n.op
        ops = self.operands(n)
        method = n.meta.get("float_functional") or _ff_method(n)
        if isinstance(op, Call):
            args, kwargs = resolve(op.args, ops), resolve(op.kwargs, ops)
        elif isinstance(op, BinaryOp):
            # ``ff.sub(2.0, y)`` binds as sub(y, other=2.0, reverse=True): the user's order back;
            # a scalar method takes (tensor, number) whichever side the number was written on
            scalar = op.other is not None and method.endswith("_scalar")
            args, kwargs = ((ops[0], resolve(op.other, ops)) if scalar else op.pair(ops)), {}
        else:
            torch_call = getattr(op, "torch_call", None)
            if torch_call is None:
                raise EmitError(f"cannot emit %{n.name} = {op.name} as FloatFunctional.{method}")
            _, args, kwargs = torch_call(ops)
        obj = self.fx.get_attr(path)
        return self.fx.call_method(method, (obj, *args), dict(kwargs))

    # -- module tree -----------------------------------------------------------
    def install(self, gm: torch.fx.GraphModule) -> None:
        """Create containers, modules and tensors in the source model's order."""
        order: Sequence[str] = self.g.objects.get(MODULE_ORDER_KEY, ())
        needed: set[str] = set()
        for p in self.modules:
            needed.update(_prefixes(p))
        for key in self.tensors:
            owner = key.rpartition(".")[0]
            if owner:
                needed.update(_prefixes(owner))
        rank = {p: i for i, p in enumerate(order)}
        tree = _Tree(gm)
        for path in sorted(needed, key=lambda p: (rank.get(p, len(rank)), p.count("."), p)):
            parent_path, _, name = path.rpartition(".")
            parent = tree.get(parent_path)
            if path in self.modules:
                parent._modules[name] = self.modules[path]  # replaces a container in place, keeping order
                tree.found[path] = self.modules[path]
            elif name not in parent._modules:
                parent._modules[name] = nn.Module()
                self.owned.add(path)
        # A tensor a rebuilt module already holds (e.g. inside a fused ConvReLU2d's ``conv``)
        # is not installed again under its constant key: one state-dict entry per tensor.
        # Compared by storage: to_module may wrap a constant in a new Parameter sharing it.
        held: set[tuple[Any, ...]] | None = None  # built on first need: a QAT model's layers hold their keys
        for key, (t, kind) in self.tensors.items():
            owner_path, _, leaf = key.rpartition(".")
            if not _holds_at(tree.find(owner_path), leaf):
                if held is None:
                    held = {_storage_key(x) for m in self.modules.values() for x in (*m.parameters(), *m.buffers())}
                if _storage_key(t) in held:
                    continue
            _install_tensor(tree.get(owner_path), leaf, t, kind)


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    ptr = t.data_ptr()
    if ptr == 0:  # meta or empty tensors have no storage to compare
        return ("id", id(t))
    return (t.device.type, ptr, tuple(t.shape), tuple(t.stride()), t.dtype)


class _Tree:
    """Submodules of ``root`` by path, each looked up once: install asks for the same owners once
    per tensor (``get_submodule`` walks and checks the whole path on every call). Install only
    adds modules, and records the one it puts at a path that might be known already."""

    def __init__(self, root: nn.Module) -> None:
        self.found: dict[str, nn.Module] = {"": root}

    def find(self, path: str) -> nn.Module | None:
        """The module at ``path``, or None when there is none."""
        m = self.found.get(path)
        if m is None:
            parent_path, _, name = path.rpartition(".")
            parent = self.find(parent_path)
            m = None if parent is None else parent._modules.get(name)
            if m is not None:
                self.found[path] = m
        return m

    def get(self, path: str) -> nn.Module:
        m = self.find(path)
        if m is None:
            raise AttributeError(f"emit: no module at {path!r} to install into")
        return m


def _holds_at(owner: nn.Module | None, leaf: str) -> bool:
    """Whether ``owner`` already has a parameter/buffer slot ``leaf`` (then installing there
    replaces it in place and adds no state-dict entry)."""
    return owner is not None and (leaf in owner._parameters or leaf in owner._buffers)


def _install_tensor(owner: nn.Module, leaf: str, t: torch.Tensor, kind: str) -> None:
    if kind == "parameter":
        if owner._parameters.get(leaf) is t:
            return
        p = t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=t.is_floating_point())
        owner._buffers.pop(leaf, None)
        owner._parameters[leaf] = p
    elif kind in ("buffer", "buffer_np"):
        if owner._buffers.get(leaf) is t:
            return
        owner._parameters.pop(leaf, None)
        owner.register_buffer(leaf, t, persistent=kind == "buffer")
    else:
        owner.__dict__[leaf] = t  # a plain tensor attribute, not part of the state dict


def _ff_method(n: Node) -> str:
    """The FloatFunctional method for an op (``add_scalar`` when the second argument is a scalar)."""
    op = n.op
    if isinstance(op, Call):
        return op.target.rpartition(".")[2]
    if isinstance(op, BinaryOp) and op.other is not None and not isinstance(op.other, Ref):
        return f"{op.name}_scalar"
    return op.name


#: modules whose functions fx records by itself (torch's __torch_function__, operators, builtins)
_FX_NATIVE_MODULES = frozenset({"torch", "operator", "_operator", "builtins", "math"})


def _torch_fx_wrapped(fn: Any) -> bool:
    """A plain Python function an opaque call names: fx recorded it only because ``torch.fx.wrap`` kept it
    whole (qir's own ``fx_helper.wrap`` leaves a wrapper that records itself, so it needs nothing).
    The guess for a call without torch.fx's ``is_wrapped`` record (an IR read from text, a hand-built
    fx graph); a function of a package fx records natively is not guessed wrapped."""
    if not isinstance(fn, types.FunctionType) or wrapped_original(fn) is not None:
        return False
    return str(getattr(fn, "__module__", "") or "").split(".")[0] not in _FX_NATIVE_MODULES
