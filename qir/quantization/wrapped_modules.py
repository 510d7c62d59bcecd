"""Modules called inside an ``fx_helper.wrap``-ed method are prepared and converted too.

The seeds' RetinaNet keeps anchors and post-processing in a wrapped method; FX does not look
into it, "but the modules called within the method can still be set with qconfig, and can be
replaced by prepare_qat_fx and convert_fx". The traced graph does not call them, so prepare's
module swapping never sees them. Here every submodule of a wrapped method's module that the
graph does not call (as torch's eager swapping: by path, whatever calls it) and whose qconfig
is not None (``""``, ``module_type``, ``module_name``, ``.qconfig`` as for graph modules):

* **prepare_qat_fx** gives it its QAT class, registered in the prepared GraphModule at the
  module's own path, so the optimizer trains it and its state-dict keys are the ones a graph
  module of that class has (``post_conv.weight``, ``post_conv.activation_post_process.scale``).
  The wrapped method receives float values (docs/hybrid.md, "Wrapped functions"), so the
  module's input has no scale: a generated QAT ``QuantStub``,
  ``_generated_wrapped_quant_<path with _>``, fake-quantizes it and records the input scale in
  calibration and QAT (the plugin's ``QTensor`` carries one; a float tensor does not). The
  module's output goes back to the wrapped code as float through a generated QAT ``DeQuantStub``,
  ``_generated_wrapped_dequant_<path with _>`` (the identity).
  In training the module runs on the integer grid of that stub's fake quant
  (qir.quantization.integer_grid binds it through :func:`wrapped_input_stubs`).
* **convert_fx** makes the same three integer: quantize with the recorded input scale, the
  integer module, dequantize with its output scale. The wrapped method still receives and
  returns float values; QAT validation (the integer twin) computes exactly the same.

Modules with no scale of their own (ReLU, max pool, Identity: ``is_scale_preserving``) compute
the same on float values and stay float, as do stubs and FloatFunctional. A module the graph
calls is prepared for its graph call sites; a wrapped call of it would run a float copy, so it
is refused by name (:class:`GraphCalledModule`).

The wrapped method runs bound to the traced copy of the user's module, which is not part of
the GraphModule; the prepared and converted models each rebind their wrapped calls to a
shallow copy of it whose prepared submodules are :class:`WrappedModuleCall`\\s holding the
GraphModule's own modules (and again on every deep copy), so the traced copy is never changed.
"""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from qir.utils.fx_helper import wrapped_original

__all__ = [
    "WRAPPED_MODULES_KEY",
    "WrappedModule",
    "GraphCalledModule",
    "WrappedModuleCall",
    "bind_wrapped_modules",
    "convert_wrapped_modules",
    "hidden_in_wrapped_calls",
    "modules_called_by",
    "prepare_wrapped_modules",
    "quant_stub_path",
    "wrapped_input_stubs",
    "wrapped_qconfigs",
]

#: ``GraphModule.meta`` key: the prepared modules of wrapped methods (a tuple of WrappedModule)
WRAPPED_MODULES_KEY = "qir.wrapped_modules"

#: attribute of a wrapped method's module: its path in the user's model ("" for the root)
_OWNER_ATTR = "_qir_wrapped_owner_path"

#: prefix of the generated input QuantStubs
QUANT_PREFIX = "_generated_wrapped_quant_"
#: prefix of the generated output DeQuantStubs
DEQUANT_PREFIX = "_generated_wrapped_dequant_"


@dataclass(frozen=True)
class WrappedModule:
    """A module prepared for a wrapped method: its owner (the module the method is bound to) and
    its path under the owner, both as in the user's model."""

    owner: str
    sub: str
    #: a module the traced graph calls (prepared for its graph call sites): a wrapped call of it is refused
    graph_called: bool = False

    @property
    def path(self) -> str:
        return f"{self.owner}.{self.sub}" if self.owner else self.sub

    @property
    def quant(self) -> str:
        return quant_stub_path(self.path)

    @property
    def dequant(self) -> str:
        return DEQUANT_PREFIX + self.path.replace(".", "_")


def quant_stub_path(path: str) -> str:
    """The prepared model's path of the input QuantStub of wrapped module ``path``."""
    return QUANT_PREFIX + path.replace(".", "_")


class WrappedModuleCall(nn.Module):
    """What a wrapped method calls in place of a prepared module: ``dequant(module(quant(x)))``.

    In the QAT model: the input fake quant, the QAT module, the identity. In the converted model:
    quantize, the integer module, dequantize. One float tensor in (then the inputs the module takes as
    float, its ``float_inputs``: RoIAlign's boxes, passed as they are), float out."""

    def __init__(self, path: str, quant: nn.Module, module: nn.Module, dequant: nn.Module) -> None:
        super().__init__()
        self.path = path
        self.quant = quant
        self.module = module
        self.dequant = dequant

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        if not isinstance(first, torch.Tensor) or not first.is_floating_point() or not self._float_rest(args, kwargs):
            got = ", ".join([type(a).__name__ for a in args] + [f"{k}=" for k in kwargs])
            floats = self._float_names()
            takes = f"one float tensor, then {', '.join(floats)} as it takes them" if floats else "one float tensor"
            raise TypeError(
                f"module '{self.path}' ({type(self.module).__name__}) is called inside a wrapped method, so "
                f"prepare_qat_fx quantizes its first input with the generated input QuantStub '{self.stub_path}' "
                f"(fake-quantized in QAT, quantized once converted); it takes {takes}, and this call passes ({got}). "
                "Pass its other quantized inputs through the traced forward instead (call the module there), or "
                "keep it float: qconfig_dict={'module_name': [('" + self.path + "', None)]}"
            )
        return self.dequant(self.module(self.quant(first), *args[1:], **kwargs))

    @property
    def stub_path(self) -> str:
        return quant_stub_path(self.path)

    def _params(self) -> list[str]:
        try:
            return list(inspect.signature(self.module.forward).parameters)
        except (TypeError, ValueError):
            return []

    def _float_rest(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Every argument after the first is one the module takes as float (``float_inputs``: RoIAlign's boxes)."""
        if len(args) == 1 and not kwargs:
            return True
        floats = set(getattr(self.module, "float_inputs", ()))
        params = self._params() if kwargs else []
        return all(i in floats for i in range(1, len(args))) and all(
            k in params and params.index(k) in floats for k in kwargs
        )

    def _float_names(self) -> list[str]:
        params = self._params()
        return [
            repr(params[i]) if i < len(params) else f"argument {i}" for i in getattr(self.module, "float_inputs", ())
        ]


class GraphCalledModule(nn.Module):
    """What a wrapped method sees in place of a module the traced graph calls: the graph's call
    sites made it a QAT (then integer) module, and a call from the Python would run its float copy,
    so a call is refused by name. Its other attributes (``out_channels``, ``num_classes``) read
    the float module's."""

    def __init__(self, path: str, float_module: nn.Module) -> None:
        super().__init__()
        self.path = path
        self.__dict__["_float"] = float_module  # not a submodule: the prepared model holds the trained one

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"module '{self.path}' ({type(self.__dict__['_float']).__name__}) is called by the traced graph, which "
            "prepares it for its graph call sites, and inside a wrapped method, where it would run as a float "
            "copy that neither trains nor converts: give the wrapped method its own module (copy.deepcopy), or "
            "call it in the traced forward"
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_float"], name)


def _wrapped_calls(gm: torch.fx.GraphModule | torch.fx.Graph) -> list[torch.fx.Node]:
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    return [
        n
        for n in graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, types.MethodType)
        and wrapped_original(n.target) is not None
        and isinstance(n.target.__self__, nn.Module)
    ]


def _excluded(path: str, called: Collection[str]) -> bool:
    """``path`` or one of its ancestors is a module the graph calls."""
    parts = path.split(".")
    return any(".".join(parts[:i]) in called for i in range(1, len(parts) + 1))


@dataclass(frozen=True)
class QATParts:
    """The QAT classes prepare lends (qir.nn sits above qir.quantization)."""

    #: the base class of QAT modules
    module_base: type
    #: a generated input QuantStub for a qconfig
    quant_stub: Callable[[Any], nn.Module]
    #: a generated output DeQuantStub
    dequant_stub: Callable[[], nn.Module]
    #: QAT classes of modules that stay as they are: stubs (they start or end quantization) and
    #: FloatFunctional (its methods, not its forward, are called)
    kept_float: tuple[type, ...]


def prepare_wrapped_modules(
    gm: torch.fx.GraphModule,
    root: nn.Module,
    called: Iterable[str],
    resolve: Callable[[str, type], Any],
    on_swap: Callable[[str, nn.Module, nn.Module], None],
    parts: QATParts,
) -> tuple[WrappedModule, ...]:
    """Give the modules wrapped methods of ``gm`` may call their QAT classes in ``gm`` (in place).

    ``root``: the traced copy of the user's model; ``called``: module paths the graph calls
    (fused-away ones included); ``resolve(path, type)``: the qconfig of a module; ``on_swap(path,
    float module, QAT module)`` is told of each swap. Returns what was prepared (also in
    ``gm.meta``); ``gm``'s wrapped calls are rebound when there is any."""
    from qir.quantization.fuse import set_submodule_creating
    from qir.quantization.qat_classes import qat_class_for

    calls = _wrapped_calls(gm)
    if not calls:  # nearly every model: no walk of its module tree
        return ()
    called = set(called)
    in_root = {id(m): p for p, m in root.named_modules()}
    done: dict[str, WrappedModule] = {}
    quant_owner: dict[str, str] = {}
    for n in calls:
        owner_mod = n.target.__self__  # type: ignore[union-attr]
        owner = owner_mod.__dict__.get(_OWNER_ATTR, in_root.get(id(owner_mod)))
        if owner is None:
            continue  # a method of a module outside the model: nothing of the model to prepare
        owner_mod.__dict__[_OWNER_ATTR] = owner  # a re-prepare traces the recorded float model, outside ``root``
        for sub, m in owner_mod.named_modules():
            path = f"{owner}.{sub}" if owner and sub else owner or sub
            if sub and path in called and path not in done and isinstance(_get(gm, path), parts.module_base):
                done[path] = WrappedModule(owner, sub, graph_called=True)
            if not sub or _excluded(path, called) or _excluded(path, done):
                continue
            cls = qat_class_for(m)
            if cls is None or cls in parts.kept_float:
                continue
            qc = resolve(path, type(m))
            if qc is None or (qc.activation is None and qc.weight is None):
                continue
            try:
                qat = cls.from_float(m, qc)  # type: ignore[attr-defined]
                if qat.is_scale_preserving:
                    continue  # ReLU, max pool, Identity: no scale of their own, the same values on float as on codes
                stub = parts.quant_stub(qc)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"prepare_qat_fx: module '{path}' ({type(m).__name__}), called inside wrapped method {_name(n)}: "
                    f"{e}; give it the qconfig None to keep it float"
                ) from e
            entry = WrappedModule(owner, sub)
            held = _get(gm, path)
            # emit leaves an Identity where an uncalled module was
            if held is not None and type(held) is not nn.Identity:
                raise ValueError(
                    f"prepare_qat_fx: module '{path}' is called inside wrapped method {_name(n)}, but the prepared "
                    f"model already holds a {type(held).__name__} at that path; rename the module"
                )
            if entry.quant in quant_owner or _get(gm, entry.quant) is not None or _get(gm, entry.dequant) is not None:
                other = quant_owner.get(entry.quant, entry.quant)
                raise ValueError(
                    f"prepare_qat_fx: module '{path}' is called inside wrapped method {_name(n)} and needs the "
                    f"generated input QuantStub '{entry.quant}', which '{other}' already takes; rename one of them"
                )
            if getattr(qat, "qconfig", None) is None:  # a QAT class keeping none (RoIAlign): the kinds check reads it
                qat.qconfig = qc
            on_swap(path, m, qat)
            set_submodule_creating(gm, path, qat)
            gm.add_submodule(entry.quant, stub)
            gm.add_submodule(entry.dequant, parts.dequant_stub())
            done[path] = entry
            quant_owner[entry.quant] = path
    found = tuple(done.values())
    if found:
        gm.meta[WRAPPED_MODULES_KEY] = found
        bind_wrapped_modules(gm)
    return found


def _name(n: torch.fx.Node) -> str:
    t = n.target
    return f"{type(t.__self__).__name__}.{t.__name__}" if isinstance(t, types.MethodType) else str(t)


def _get(gm: nn.Module, path: str) -> nn.Module | None:
    try:
        return gm.get_submodule(path)
    except AttributeError:
        return None


def _with_module(base: nn.Module, sub: str, module: nn.Module) -> nn.Module:
    """A shallow copy of ``base`` whose submodule ``sub`` is ``module`` (copies along the path only;
    ``base`` and its other submodules are shared, not changed)."""
    new = copy.copy(base)
    new.__dict__["_modules"] = dict(base._modules)
    head, _, rest = sub.partition(".")
    new._modules[head] = _with_module(base._modules[head], rest, module) if rest else module  # type: ignore[arg-type]
    return new


def bind_wrapped_modules(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Point ``gm``'s wrapped calls at copies of their modules that call ``gm``'s prepared (or
    converted) modules; again on every deep copy of ``gm``."""
    found: tuple[WrappedModule, ...] = gm.meta.get(WRAPPED_MODULES_KEY, ())
    if not found:
        return gm
    by_owner: dict[str, list[WrappedModule]] = {}
    for w in found:
        by_owner.setdefault(w.owner, []).append(w)
    rebound: dict[int, nn.Module] = {}
    for n in _wrapped_calls(gm):
        target = n.target
        assert isinstance(target, types.MethodType) and isinstance(target.__self__, nn.Module)
        owner_mod: nn.Module = target.__self__
        owner = owner_mod.__dict__.get(_OWNER_ATTR)
        if owner not in by_owner:
            continue
        if id(owner_mod) not in rebound:
            new = owner_mod
            for w in by_owner[owner]:
                if w.graph_called:
                    new = _with_module(new, w.sub, GraphCalledModule(w.path, _float_at(owner_mod, w.sub)))
                    continue
                quant, module, dequant = (gm.get_submodule(p) for p in (w.quant, w.path, w.dequant))
                new = _with_module(new, w.sub, WrappedModuleCall(w.path, quant, module, dequant))
            rebound[id(owner_mod)] = new
        n.target = types.MethodType(target.__func__, rebound[id(owner_mod)])
    gm.recompile()
    register = getattr(gm, "_register_deepcopy_hook", None)
    if register is not None and _rebind_copy not in gm.__dict__.get("_deepcopy_hooks", []):
        register(_rebind_copy)
    return gm


def _float_at(owner: nn.Module, sub: str) -> nn.Module:
    m = owner.get_submodule(sub)
    return m.__dict__["_float"] if isinstance(m, GraphCalledModule) else m


def _rebind_copy(copied: torch.fx.GraphModule) -> None:
    bind_wrapped_modules(copied)  # a deep copy's graph still calls the original's bound copy


def convert_wrapped_modules(
    qat_model: nn.Module, converted: torch.fx.GraphModule, build: Callable[[str, nn.Module, list[Any]], nn.Module]
) -> torch.fx.GraphModule:
    """Install the integer forms of ``qat_model``'s prepared wrapped modules in ``converted``
    (in place) and rebind its wrapped calls to them. ``build(path, QAT module, input scales)``
    makes an integer module (convert's own builder, so errors read as for graph modules)."""
    from qir.quantization.fuse import set_submodule_creating

    found: tuple[WrappedModule, ...] = getattr(qat_model, "meta", {}).get(WRAPPED_MODULES_KEY, ())
    if not found:
        return converted
    for w in found:
        if w.graph_called:
            continue
        quant = build(w.quant, qat_model.get_submodule(w.quant), [])
        in_scale = quant.scale
        assert isinstance(in_scale, torch.Tensor)
        module = build(w.path, qat_model.get_submodule(w.path), [in_scale.detach().clone()])
        out_scale = getattr(module, "scale", None)
        if not isinstance(out_scale, torch.Tensor):
            raise NotImplementedError(
                f"module '{w.path}' ({type(module).__name__}), called inside a wrapped method, has no output scale "
                "to dequantize its result with; give it the qconfig None to keep it float"
            )
        dequant = build(w.dequant, qat_model.get_submodule(w.dequant), [out_scale.detach().clone()])
        set_submodule_creating(converted, w.path, module)
        for path, m in ((w.quant, quant), (w.dequant, dequant)):
            m.train(False)
            converted._modules.pop(path, None)  # last, whichever path converted the graph (state-dict order)
            converted.add_submodule(path, m)
        module.train(False)
    converted.meta[WRAPPED_MODULES_KEY] = found
    return bind_wrapped_modules(converted)


def hidden_in_wrapped_calls(
    graph: torch.fx.Graph, root: nn.Module, select: Callable[[nn.Module], bool]
) -> dict[str, list[str]]:
    """Per wrapped method ``graph`` (traced from ``root``) calls, as ``Class.method``: the paths of the
    submodules of its module that ``select`` picks and that ``graph`` does not call (eager ``convert``
    cannot learn their input scales from the trace)."""
    calls = _wrapped_calls(graph)
    if not calls:  # nearly every model: no walk of the module tree
        return {}
    called = {str(n.target) for n in graph.nodes if n.op in ("call_module", "get_attr")}
    paths = {id(m): p for p, m in root.named_modules()}
    found: dict[str, list[str]] = {}
    for n in calls:
        owner_mod = n.target.__self__  # type: ignore[union-attr]
        owner = paths.get(id(owner_mod))
        if owner is None:
            continue
        for sub, m in owner_mod.named_modules():
            path = f"{owner}.{sub}" if owner and sub else owner or sub
            if sub and select(m) and not _excluded(path, called):
                found.setdefault(_name(n), [])
                if path not in found[_name(n)]:
                    found[_name(n)].append(path)
    return found


def modules_called_by(fn: Any) -> list[str]:
    """Paths of the prepared or converted modules wrapped method ``fn`` (a bound method) calls."""
    owner = getattr(fn, "__self__", None)
    if not isinstance(owner, nn.Module):
        return []
    return [m.path for m in owner.modules() if isinstance(m, WrappedModuleCall)]


def wrapped_qconfigs(gm: nn.Module) -> dict[str, Any]:
    """Per module of a wrapped method that ``gm`` prepared: its qconfig (prepare checks that
    calibration and QAT qconfigs do not mix, on these as on graph modules)."""
    found: tuple[WrappedModule, ...] = getattr(gm, "meta", {}).get(WRAPPED_MODULES_KEY, ())
    return {w.path: gm.get_submodule(w.path).qconfig for w in found if not w.graph_called}


def wrapped_input_stubs(gm: nn.Module) -> dict[str, nn.Module]:
    """Per module of a wrapped method that ``gm`` prepared: its generated input QuantStub (the
    integer grid binds the module to that stub's fake quant in training)."""
    found: tuple[WrappedModule, ...] = getattr(gm, "meta", {}).get(WRAPPED_MODULES_KEY, ())
    return {w.path: gm.get_submodule(w.quant) for w in found if not w.graph_called}
