"""Elementwise math functions and activations (stateless, plus PReLU with its weight).

The plain math functions are generated from a table (each is a real registered class
with its own name); activations with options are written out, their fields mirroring
the torch module's constructor and functional keyword arguments.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from qir.ir.meta_modules import load_tensors
from qir.ir.op import Elementwise, IRError, Pure, ShapePreserving, Trait, register_op
from qir.ir.ops.torchop import TorchModuleOp, check_dim, unary_op
from qir.ir.types import TensorType, Type

_ACT = frozenset({Pure, Elementwise, ShapePreserving})

# ----------------------------------------------------------------------------- math table
Abs = unary_op(__name__, "Abs", "abs", (torch.abs, operator.abs), ("abs",))
Acos = unary_op(__name__, "Acos", "acos", (torch.acos, torch.arccos), ("acos", "arccos"))
Acosh = unary_op(__name__, "Acosh", "acosh", (torch.acosh, torch.arccosh), ("acosh", "arccosh"))
Asin = unary_op(__name__, "Asin", "asin", (torch.asin, torch.arcsin), ("asin", "arcsin"))
Asinh = unary_op(__name__, "Asinh", "asinh", (torch.asinh, torch.arcsinh), ("asinh", "arcsinh"))
Atan = unary_op(__name__, "Atan", "atan", (torch.atan, torch.arctan), ("atan", "arctan"))
Atanh = unary_op(__name__, "Atanh", "atanh", (torch.atanh, torch.arctanh), ("atanh", "arctanh"))
Ceil = unary_op(__name__, "Ceil", "ceil", (torch.ceil,), ("ceil",))
Cos = unary_op(__name__, "Cos", "cos", (torch.cos,), ("cos",))
Cosh = unary_op(__name__, "Cosh", "cosh", (torch.cosh,), ("cosh",))
Erf = unary_op(__name__, "Erf", "erf", (torch.erf, torch.special.erf), ("erf",))
Exp = unary_op(__name__, "Exp", "exp", (torch.exp,), ("exp",))
Floor = unary_op(__name__, "Floor", "floor", (torch.floor,), ("floor",))
Log = unary_op(__name__, "Log", "log", (torch.log,), ("log",))
Log2 = unary_op(__name__, "Log2", "log2", (torch.log2,), ("log2",))
Log1p = unary_op(__name__, "Log1p", "log1p", (torch.log1p,), ("log1p",))
Neg = unary_op(__name__, "Neg", "neg", (torch.neg, operator.neg, torch.negative), ("neg", "negative"))
Reciprocal = unary_op(__name__, "Reciprocal", "reciprocal", (torch.reciprocal,), ("reciprocal",))
Round = unary_op(__name__, "Round", "round", (torch.round,), ("round",))
Rsqrt = unary_op(__name__, "Rsqrt", "rsqrt", (torch.rsqrt,), ("rsqrt",))
Sign = unary_op(__name__, "Sign", "sign", (torch.sign,), ("sign",))
Sin = unary_op(__name__, "Sin", "sin", (torch.sin,), ("sin",))
Sinh = unary_op(__name__, "Sinh", "sinh", (torch.sinh,), ("sinh",))
Sqrt = unary_op(__name__, "Sqrt", "sqrt", (torch.sqrt,), ("sqrt",))
Square = unary_op(__name__, "Square", "square", (torch.square,), ("square",))
Tan = unary_op(__name__, "Tan", "tan", (torch.tan,), ("tan",))
Trunc = unary_op(__name__, "Trunc", "trunc", (torch.trunc,), ("trunc",))
LogicalNot = unary_op(__name__, "LogicalNot", "logical_not", (torch.logical_not,), ("logical_not",))
Sigmoid = unary_op(__name__, "Sigmoid", "sigmoid", (torch.sigmoid, F.sigmoid), ("sigmoid",), nn.Sigmoid)
Tanh = unary_op(__name__, "Tanh", "tanh", (torch.tanh, F.tanh), ("tanh",), nn.Tanh)
Softsign = unary_op(__name__, "Softsign", "softsign", (F.softsign,), (), nn.Softsign)
Tanhshrink = unary_op(__name__, "Tanhshrink", "tanhshrink", (F.tanhshrink,), (), nn.Tanhshrink)


# ----------------------------------------------------------------------------- activations
def _act(
    cls_name: str,
    op_name: str,
    module: type,
    functions: tuple[Callable[..., Any], ...],
    fields: dict[str, Any],
    methods: tuple[str, ...] = (),
    traits: frozenset[type[Trait]] = _ACT,
) -> type:
    """One activation class whose fields are ``fields`` (name -> default), in signature order."""
    ns: dict[str, Any] = {
        "__doc__": f"``nn.{module.__name__}`` / ``{functions[0].__module__}.{functions[0].__name__}``.",
        "__qualname__": cls_name,
        "__module__": __name__,
        "__annotations__": {k: Any for k in fields},
        "name": op_name,
        "traits": traits,
        "arity": (1, 1),
        "functions": functions,
        "methods": methods,
        "module_types": (module,),
        "signature": ("input", *fields),
        "inputs": ("input",),
        "module_fields": tuple(fields),
    }
    ns.update({k: attrs.field(default=v) for k, v in fields.items()})
    return register_op(attrs.frozen(type(cls_name, (TorchModuleOp,), ns)))


Hardswish = _act("Hardswish", "hardswish", nn.Hardswish, (F.hardswish,), {"inplace": False})
Hardsigmoid = _act("Hardsigmoid", "hardsigmoid", nn.Hardsigmoid, (F.hardsigmoid,), {"inplace": False})
Silu = _act("Silu", "silu", nn.SiLU, (F.silu,), {"inplace": False})
Mish = _act("Mish", "mish", nn.Mish, (F.mish,), {"inplace": False})
Selu = _act("Selu", "selu", nn.SELU, (F.selu, torch.selu), {"inplace": False})
Gelu = _act("Gelu", "gelu", nn.GELU, (F.gelu,), {"approximate": "none"})
Elu = _act("Elu", "elu", nn.ELU, (F.elu,), {"alpha": 1.0, "inplace": False})
Celu = _act("Celu", "celu", nn.CELU, (F.celu, torch.celu), {"alpha": 1.0, "inplace": False})
LeakyRelu = _act("LeakyRelu", "leaky_relu", nn.LeakyReLU, (F.leaky_relu,), {"negative_slope": 0.01, "inplace": False})
Softplus = _act("Softplus", "softplus", nn.Softplus, (F.softplus,), {"beta": 1.0, "threshold": 20.0})
Hardtanh = _act("Hardtanh", "hardtanh", nn.Hardtanh, (F.hardtanh,), {"min_val": -1.0, "max_val": 1.0, "inplace": False})
Hardshrink = _act("Hardshrink", "hardshrink", nn.Hardshrink, (F.hardshrink,), {"lambd": 0.5})


@attrs.frozen
class _DimActivation(TorchModuleOp):
    """Activations over one dimension (softmax family)."""

    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, ShapePreserving})
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    signature: ClassVar[tuple[str, ...]] = ("input", "dim")
    module_fields: ClassVar[tuple[str, ...]] = ("dim",)

    dim: int | None = None

    def verify_(self, operand_types: Sequence[Type]) -> None:
        t = operand_types[0]
        if isinstance(t, TensorType):
            check_dim(self, self.dim, t.rank)


@register_op
@attrs.frozen
class Softmax(_DimActivation):
    """``nn.Softmax``, ``F.softmax``, ``torch.softmax``, ``Tensor.softmax``."""

    name: ClassVar[str] = "softmax"
    module_types: ClassVar[tuple[type, ...]] = (nn.Softmax,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.softmax, torch.softmax)
    methods: ClassVar[tuple[str, ...]] = ("softmax",)


@register_op
@attrs.frozen
class LogSoftmax(_DimActivation):
    """``nn.LogSoftmax``, ``F.log_softmax``, ``torch.log_softmax``, ``Tensor.log_softmax``."""

    name: ClassVar[str] = "log_softmax"
    module_types: ClassVar[tuple[type, ...]] = (nn.LogSoftmax,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.log_softmax, torch.log_softmax)
    methods: ClassVar[tuple[str, ...]] = ("log_softmax",)


@register_op
@attrs.frozen
class Glu(TorchModuleOp):
    """``nn.GLU`` / ``F.glu``: halves along ``dim``, ``a * sigmoid(b)``."""

    name: ClassVar[str] = "glu"
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    module_types: ClassVar[tuple[type, ...]] = (nn.GLU,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.glu,)
    signature: ClassVar[tuple[str, ...]] = ("input", "dim")
    module_fields: ClassVar[tuple[str, ...]] = ("dim",)

    dim: int = -1


@register_op
@attrs.frozen
class Prelu(TorchModuleOp):
    """``nn.PReLU`` / ``F.prelu``: operands ``(input, weight)``; the weight is a constant
    when it comes from the module."""

    name: ClassVar[str] = "prelu"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, ShapePreserving})
    arity: ClassVar[tuple[int, int | None]] = (2, 2)
    operand_names: ClassVar[tuple[str, ...]] = ("input", "weight")
    module_types: ClassVar[tuple[type, ...]] = (nn.PReLU,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.prelu, torch.prelu)
    signature: ClassVar[tuple[str, ...]] = ("input", "weight")
    inputs: ClassVar[tuple[str, ...]] = ("input", "weight")

    def param_roles(self) -> tuple[str, ...]:
        return ("weight",)

    @classmethod
    def from_module(cls, m: Any) -> Prelu:
        return cls()

    def to_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        w = tensors["weight"]
        m = nn.PReLU(num_parameters=w.numel(), device="meta")
        load_tensors(m, tensors)
        return m

    def verify_(self, operand_types: Sequence[Type]) -> None:
        x, w = operand_types
        channels = x.shape[1] if isinstance(x, TensorType) and x.rank > 1 else 1
        if isinstance(x, TensorType) and isinstance(w, TensorType) and w.numel not in (1, channels):
            raise IRError(f"op 'prelu': weight has {w.numel} entries, input has {x.shape[1:2]} channels")
