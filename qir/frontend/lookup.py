"""Which registered op a torch spelling stands for, and which modules the tracer keeps whole.

Built from the op registry's ``functions`` / ``methods`` / ``module_types`` (and
``function_names`` for spellings outside torch), so registering an op is all it takes
for the front end to recognise it. The tables are rebuilt when the registry grows.
"""

from __future__ import annotations

import builtins
import importlib
import operator
from collections.abc import Callable
from typing import Any

from torch import nn

from qir.ir.op import OP_REGISTRY, ModuleOp, Op, registry_version
from qir.ir.ops.core import GetAttr, GetItem


class OpTables:
    """Spelling -> op class maps over the current registry."""

    def __init__(self) -> None:
        import qir.ir.ops  # noqa: F401  (registers the built-in ops)

        self.size = registry_version()
        self.by_function: dict[int, type[Op]] = {}
        self.by_function_name: dict[str, type[Op]] = {}
        self.by_method: dict[str, type[Op]] = {}
        self.by_module: dict[type, type[ModuleOp]] = {}
        for cls in OP_REGISTRY.values():
            for fn in getattr(cls, "functions", ()):
                self.by_function.setdefault(id(fn), cls)
            for name in getattr(cls, "function_names", ()):
                self.by_function_name.setdefault(name, cls)
            for m in getattr(cls, "methods", ()):
                self.by_method.setdefault(m, cls)
            if issubclass(cls, ModuleOp):
                for t in cls.module_types:
                    self.by_module.setdefault(t, cls)
        self.by_function[id(operator.getitem)] = GetItem
        self.by_function[id(builtins.getattr)] = GetAttr

    def for_function(self, fn: Callable[..., Any]) -> type[Op] | None:
        cls = self.by_function.get(id(fn))
        if cls is None:
            cls = self.by_function_name.get(qualified_name(fn))
        return cls

    def for_module(self, m: nn.Module) -> type[ModuleOp] | None:
        return self.by_module.get(type(m))


_TABLES: OpTables | None = None


def tables() -> OpTables:
    global _TABLES
    if _TABLES is None or _TABLES.size != registry_version():
        _TABLES = OpTables()
    return _TABLES


def qualified_name(fn: Any) -> str:
    """``module.qualname`` of a callable, importable where possible (``torch.cat``)."""
    try:
        from torch.fx.node import _get_qualified_name

        return _get_qualified_name(fn)
    except Exception:  # fx cannot name it (callable objects, partials): fall back to the type
        mod = getattr(fn, "__module__", None) or type(fn).__module__
        name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__qualname__
        return f"{mod}.{name}"


# ----------------------------------------------------------------------------- leaf classes


#: classes :func:`_lazy_attr` found (a class found stays; a missing one is looked for again)
_FOUND: dict[tuple[str, str], type] = {}


def _lazy_attr(module: str, attr: str) -> type | None:
    """A class from a module that may not exist (yet): ``None`` when missing."""
    found = _FOUND.get((module, attr))
    if found is not None:  # emit asks once per node: import_module of a loaded module costs ~10 us
        return found
    try:
        value = getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return None
    if isinstance(value, type):
        _FOUND[(module, attr)] = value
    return value


def float_functional_classes() -> tuple[type, ...]:
    """torch's and qir's FloatFunctional classes (whichever are importable)."""
    found = [
        _lazy_attr("torch.ao.nn.quantized", "FloatFunctional"),
        _lazy_attr("qir.nn.quantized", "FloatFunctional"),
    ]
    return tuple(dict.fromkeys(c for c in found if isinstance(c, type)))


def functional_method_classes() -> tuple[type, ...]:
    """The float FloatFunctional classes and qir's QAT and integer ones: their method calls
    (``ff.add(x, y)``) are traced as one ``call_method`` node each."""
    found = [
        *float_functional_classes(),
        _lazy_attr("qir.nn.qat", "FloatFunctional"),
        _lazy_attr("qir.nn.quantized", "QFunctional"),
    ]
    return tuple(dict.fromkeys(c for c in found if isinstance(c, type)))


def stub_classes() -> tuple[type, ...]:
    """QuantStub / DeQuantStub classes from torch and qir (whichever are importable)."""
    found = [
        _lazy_attr("torch.ao.quantization", "QuantStub"),
        _lazy_attr("torch.ao.quantization", "DeQuantStub"),
        _lazy_attr("qir.quantization", "QuantStub"),
        _lazy_attr("qir.quantization", "DeQuantStub"),
    ]
    return tuple(dict.fromkeys(c for c in found if isinstance(c, type)))


def fused_module_classes() -> tuple[type, ...]:
    """Base classes of fused modules (``ConvReLU2d`` ...): Sequential subclasses fx would
    otherwise trace through."""
    found = [_lazy_attr("torch.ao.nn.intrinsic", "_FusedModule"), _lazy_attr("qir.nn.intrinsic", "_FusedModule")]
    return tuple(dict.fromkeys(c for c in found if isinstance(c, type)))


def is_float_functional(m: Any) -> bool:
    return isinstance(m, float_functional_classes())


#: FloatFunctional methods whose name is not the op's method spelling.
FF_METHODS: dict[str, str] = {"add_scalar": "add", "mul_scalar": "mul", "concat": "cat", "concatenate": "cat"}


def ff_op_class(method: str) -> type[Op] | None:
    """The op a FloatFunctional method computes (``add`` -> add, ``cat`` -> cat)."""
    t = tables()
    name = FF_METHODS.get(method, method)
    if name in OP_REGISTRY:
        return OP_REGISTRY[name]
    return t.by_method.get(name)


#: Modules outside torch.nn whose forward fx cannot trace (Python loops over image lists,
#: dict inputs); they stay whole as opaque module calls.
OPAQUE_LEAF_CLASSES = frozenset(
    {
        "torchvision.ops.roi_align.RoIAlign",
        "torchvision.ops.roi_pool.RoIPool",
        "torchvision.ops.poolers.MultiScaleRoIAlign",
        "torchvision.models.detection.anchor_utils.AnchorGenerator",
    }
)


def is_opaque_leaf(m: nn.Module) -> bool:
    return f"{type(m).__module__}.{type(m).__qualname__}" in OPAQUE_LEAF_CLASSES


def is_qir_library_module(m: nn.Module) -> bool:
    """qir's own module library (qat / quantized / intrinsic modules) is traced as leaves.

    A library module built from other modules and tensor ops (``qir.nn.LayerNorm(..., dim=1)``)
    sets ``trace_through = True`` and is traced into, so its parts prepare and convert.
    """
    if getattr(type(m), "trace_through", False):
        return False
    mod = type(m).__module__
    return mod.startswith("qir.nn") or mod.startswith("qir.quantization")
