"""Functional ops with their own output scale -> generated modules (part of ``prepare_qat_fx``).

A functional call that computes new values (``F.interpolate(..., mode="bilinear")``,
``torch.sigmoid``, ``x.exp()``, ``torch.tanh`` ...) needs an output fake quant in QAT and a
quantized form at conversion, so prepare replaces it by a generated module of the
``qir.nn`` / ``torch.nn`` class that ``qir.nn.qat.QAT_MODULE_MAP`` knows
(``layer1.0._generated_exp_0`` = ``qir.nn.Exp()``); the swap to the QAT class then happens
as for any module. One table, :data:`FUNCTIONAL_MODULES`, says which IR op becomes which
module.

The rewrite runs on the fused IR graph just before emission (``build_fused``'s
``prepare_objects`` hook). Only calls on quantized tensors are swapped: those after a
``QuantStub`` and not past a ``DeQuantStub`` (``torch.sigmoid(self.dequant(x))`` stays a
float op). Names follow :mod:`qir.quantization.names`: per owning module and per kind,
the kind being the op's name (``_generated_interpolate_0``, ``_generated_sigmoid_0``).

A bilinear interpolate with a run-time size (``size=y.shape[-2:]``) becomes a module called
with that size (``_generated_interpolate_0(x, size=...)``). Left as they are: nearest
interpolate (scale-preserving; ``convert_fx`` runs it exactly on codes), a run-time scale
factor, modes other than nearest / bilinear, and in-place spellings (``x.exp_()``). Values
that are not tensors (sizes, ``h ** 2``) are never swapped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
from torch import nn

from qir.frontend.convert import MODULE_ORDER_KEY
from qir.ir.graph import Graph, Node
from qir.ir.op import Op, Ref, iter_refs
from qir.ir.ops.core import Call
from qir.quantization.fuse import carries_tensors, computes_tensor
from qir.quantization.fx_trace import OWNER_KEY
from qir.quantization.names import NameAllocator

__all__ = ["FUNCTIONAL_MODULES", "ModuleFactory", "quantized_values", "swap_functionals"]

#: builds the float module for one call (None: this call stays functional)
ModuleFactory = Callable[[Op], nn.Module | None]


def _qir_unary(name: str) -> ModuleFactory:
    """``qir.nn.<name>()`` (a unary LUT module of ``qir.nn.UNARY_MODULES``)."""

    def build(op: Op) -> nn.Module | None:
        from qir.nn.modules.unary import UNARY_MODULES

        cls = UNARY_MODULES.get(name)
        return cls() if cls is not None else None

    build.__name__ = f"qir_nn_{name}"
    return build


def _torch_module(op: Op) -> nn.Module | None:
    """The op's own torch module (``nn.Sigmoid()``, ``nn.GELU(approximate=...)``), never in place."""
    if getattr(op, "inplace", False):
        op = attrs.evolve(op, inplace=False)  # type: ignore[call-arg]
    module: nn.Module = op.to_module({})  # type: ignore[attr-defined]
    return module


def _pow(op: Op) -> nn.Module | None:
    """``x ** c`` / ``torch.pow(x, c)`` with a constant number ``c`` -> ``qir.nn.Pow(c)``."""
    from qir.nn.modules.unary import Pow

    e = getattr(op, "other", None)
    if getattr(op, "reverse", False) or isinstance(e, bool) or not isinstance(e, (int, float)):
        return None
    return Pow(exponent=float(e))


def _square(op: Op) -> nn.Module | None:
    from qir.nn.modules.unary import Pow

    return Pow(exponent=2.0)


def _interpolate(op: Op) -> nn.Module | None:
    """Bilinear ``F.interpolate`` / ``F.upsample*`` -> ``qir.nn.Interpolate`` with the call's arguments."""
    from qir.nn.modules.interpolate import Interpolate

    a: Any = op
    if a.mode != "bilinear" or a.antialias or _has_refs(a.scale_factor):
        return None
    return Interpolate(  # a run-time size (size=y.shape[2:]) is passed at the call (_call_kwargs)
        size=None if _has_refs(a.size) else a.size,
        scale_factor=a.scale_factor,
        mode=a.mode,
        align_corners=a.align_corners,
        recompute_scale_factor=a.recompute_scale_factor,
    )


def _has_refs(v: Any) -> bool:
    return any(True for _ in iter_refs(v))


def _call_kwargs(op: Op) -> dict[str, Any]:
    """Run-time arguments the generated module takes at the call: ``size`` of an interpolate
    computed from sizes (``F.interpolate(x, size=lateral.shape[2:])``), as Refs to operands."""
    size = getattr(op, "size", None) if op.name == "interpolate" else None
    return {"size": size} if _has_refs(size) else {}


def _grid_sample(op: Op) -> nn.Module | None:
    """``F.grid_sample`` -> ``qir.nn.GridSample``; modes / paddings the BPU lacks stay functional."""
    from qir.nn.modules.grid_sample import GridSample

    a: Any = op
    if a.mode not in ("bilinear", "nearest") or a.padding_mode not in ("zeros", "border"):
        return None
    return GridSample(a.mode, a.padding_mode, a.align_corners)


#: ops whose generated module takes more than the one tensor operand
_TENSOR_OPERANDS: dict[str, int] = {"grid_sample": 2}


#: IR op name (the functional, method and ``F.`` spellings all map to one op) -> the module
#: that replaces a call of it. Every module built here must map through QAT_MODULE_MAP
#: (tests/flows/test_functional_swap.py checks the table against the library).
FUNCTIONAL_MODULES: dict[str, ModuleFactory] = {
    "interpolate": _interpolate,  # also F.upsample, F.upsample_bilinear (traced into interpolate)
    # qir.nn's unary LUT modules; domain-restricted ones clamp into the domain (docs/modules.md)
    **{
        op: _qir_unary(cls)
        for op, cls in {
            "exp": "Exp",
            "log": "HardLog",
            "sqrt": "Sqrt",
            "reciprocal": "Reciprocal",
            "erf": "Erf",
            "sin": "Sin",
            "cos": "Cos",
            "tan": "Tan",
            "asin": "Asin",
            "acos": "Acos",
            "atan": "Atan",
            "sinh": "Sinh",
            "cosh": "Cosh",
            "asinh": "Asinh",
            "acosh": "Acosh",
            "atanh": "Atanh",
            "ceil": "Ceil",
            "floor": "Floor",
        }.items()
    },
    "pow": _pow,
    "square": _square,
    "grid_sample": _grid_sample,  # two tensor operands: input and grid (see _TENSOR_OPERANDS)
    # nn.Softmax(dim) / nn.GLU(dim) (qat.Softmax refuses the legacy implicit-dim softmax, saying so)
    "softmax": _torch_module,
    "glu": _torch_module,
    # torch activations that are LUT ops in qir.nn.qat (LUT_FLOAT_CLASSES): their own nn module
    **dict.fromkeys(
        (
            "sigmoid",
            "tanh",
            "gelu",
            "silu",
            "hardsigmoid",
            "hardswish",
            "elu",
            "leaky_relu",
            "softplus",
            "mish",
            "selu",
            "celu",
        ),
        _torch_module,
    ),
}


def _stub_kind(obj: Any) -> str | None:
    """ "quant" / "dequant" for a QuantStub / DeQuantStub object (qir's, torch's, QAT), else None."""
    if not isinstance(obj, nn.Module):
        return None
    from qir.nn import qat
    from qir.quantization.qat_classes import qat_class_for

    cls = type(obj) if isinstance(obj, (qat.QuantStub, qat.DeQuantStub)) else qat_class_for(obj)
    if cls is not None and issubclass(cls, qat.QuantStub):
        return "quant"
    if cls is not None and issubclass(cls, qat.DeQuantStub):
        return "dequant"
    return None


def quantized_values(g: Graph, inputs_quantized: bool = False) -> set[str]:
    """Names of the nodes computed on quantized tensors: after a QuantStub, not past a DeQuantStub.

    ``inputs_quantized`` (hybrid preparation): model inputs count as quantized too, since a
    generated QuantStub will quantize whatever float value feeds a BPU op."""
    quantized: set[str] = {a.name for a in g.inputs} if inputs_quantized else set()
    for n in g.nodes:
        op = n.op
        obj = g.objects.get(f"module:{op.target}") if isinstance(op, Call) and op.kind == "module" else None
        kind = _stub_kind(obj)
        if not carries_tensors(n.type):
            continue  # sizes read from a quantized tensor (x.shape, x.size(0)) are exact ints
        if kind == "quant" or (kind is None and any(v.name in quantized for v in n.operands)):
            quantized.add(n.name)
    return quantized


def _prefixes(path: str) -> Iterator[str]:
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])


def _taken(g: Graph) -> set[str]:
    """Every module path the emitted model will have (or could): generated names avoid them."""
    taken: set[str] = set(g.objects.get(MODULE_ORDER_KEY, ()))
    for key in g.objects:
        if isinstance(key, str) and key.startswith("module:"):
            taken.update(_prefixes(key.removeprefix("module:")))
    for n in g.nodes:
        if n.scope:
            taken.update(_prefixes(n.scope))
    for key in g.constants:
        taken.update(_prefixes(key))
    return taken


def _torch_target(op: Op) -> Any:
    """The torch callable the call was (``module_type`` qconfig keys may name it)."""
    funcs = getattr(type(op), "functions", ())
    return funcs[0] if funcs else op.name


def _module_for(n: Node) -> nn.Module | None:
    factory = FUNCTIONAL_MODULES.get(n.op.name)
    tensors = _TENSOR_OPERANDS.get(n.op.name, 1)
    if factory is None or isinstance(n.op, Call) or len(n.operands) < tensors:
        return None
    if len(n.operands) > tensors and not _call_kwargs(n.op):
        return None  # a run-time argument the module cannot take at the call
    if not computes_tensor(n):
        return None  # Python arithmetic on sizes (``h ** 2``) stays an exact int
    from qir.quantization.qat_classes import qat_class_for

    module = factory(n.op)
    return module if module is not None and qat_class_for(module) is not None else None


def swap_functionals(g: Graph, inputs_quantized: bool = False) -> dict[str, Any]:
    """Replace the table's functional calls on quantized tensors by generated module calls, in place.

    Returns generated path -> the torch callable it replaced (for ``FuseRecord.generated``).
    ``inputs_quantized``: see :func:`quantized_values` (hybrid preparation).
    """
    quantized = quantized_values(g, inputs_quantized)
    alloc = NameAllocator(_taken(g))
    generated: dict[str, Any] = {}
    for n in g.nodes:
        if n.scope is not None or not n.operands or n.operands[0].name not in quantized:
            continue
        module = _module_for(n)
        if module is None:
            continue
        path = alloc.new(n.meta.get(OWNER_KEY, ""), n.op.name)
        generated[path] = _torch_target(n.op)
        tensors = _TENSOR_OPERANDS.get(n.op.name, 1)
        n.op = Call(kind="module", target=path, args=tuple(Ref(i) for i in range(tensors)), kwargs=_call_kwargs(n.op))
        n.scope = path
        g.objects[f"module:{path}"] = module
    return generated
