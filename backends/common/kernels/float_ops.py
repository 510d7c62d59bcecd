"""The CPU float part of a program: ``float_fn`` runs one allow-listed torch function on float32
(and int64 index / bool mask) tensors, as the converted model runs it after a DeQuantStub (box
decoding, ``sigmoid`` scores, ``topk`` in float) or before a QuantStub (input normalization).

Horizon's deployment puts such ops on the CPU beside the BPU segments (seed 003); a qir program
does the same: integer kernels for the quantized part, ``float_fn`` instructions for the float
part, including the float convs, linears and batch norms a hybrid model places on the CPU
(``F.conv2d(x, weight, bias, ...)`` with the weights stored as program constants). Each
instruction names its function by the spelling the model used (``torch.sigmoid``,
``Tensor.topk``, ``operator.mul``, ``F.softmax``) and calls exactly that function, so the float
part computes what torch computes in the converted model, bit for bit. The names form an
allowlist: a file can never call anything else, and a name outside it is refused at load.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from backends.common.kernels.base import register_kernel
from backends.common.kernels.infer import ShapeError, meta_call
from backends.common.kernels.schema import KernelSchema
from backends.common.kernels.shape import _refs_are_inputs, call_named, named_call, named_call_attrs
from backends.common.program import Instruction

__all__ = ["FLOAT_FUNCTIONS", "FLOAT_MAC_LAYERS", "FLOAT_VALUE_DTYPES", "float_function_name"]

#: torch functions (``torch.<name>``) and tensor methods (``Tensor.<name>``) the float part may call:
#: elementwise math, comparisons, reductions and selections whose output size the operands bound
#: (no data-dependent sizes: ``nonzero`` / ``masked_select`` are left out, so shapes are known at load).
_TORCH_AND_METHODS = (
    "sigmoid exp exp2 expm1 log log2 log10 log1p tanh sqrt rsqrt abs neg relu floor ceil round trunc sign "
    "reciprocal sin cos erf square add sub mul div true_divide floor_divide remainder pow maximum minimum atan2 "
    "eq ne lt le gt ge logical_and logical_or logical_not where clamp clip clamp_min clamp_max masked_fill "
    "sum mean amax amin max min argmax argmin prod cumsum cumprod logsumexp softmax log_softmax any all "
    "topk sort argsort gather index_select take_along_dim"
).split()
#: methods only (dtype casts between the float part's dtypes; ``x.float()`` of a float is itself)
_METHODS_ONLY = ("float", "long", "bool", "type_as")
#: the float layers with weights a hybrid model leaves on the CPU (hybrid_dict) that multiply-accumulate:
#: their weights are program constants, and perf counts their MACs
FLOAT_MAC_LAYERS = tuple(f"F.{n}" for n in "conv1d conv2d conv3d conv_transpose1d conv_transpose2d linear".split())
_FUNCTIONAL = [
    *(
        "sigmoid softmax log_softmax relu relu6 silu softplus hardsigmoid normalize selu elu celu gelu leaky_relu "
        "hardswish hardtanh mish tanh"
    ).split(),
    *(n.removeprefix("F.") for n in FLOAT_MAC_LAYERS),
    # the other layers a hybrid model leaves on the CPU in float, their weights program constants too
    "batch_norm",
    "layer_norm",
]
_OPERATORS = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "eq", "ne", "lt", "le", "gt", "ge")


def _build() -> dict[str, Callable[..., Any]]:
    table: dict[str, Callable[..., Any]] = {}
    for name in _TORCH_AND_METHODS:
        if hasattr(torch, name):
            table[f"torch.{name}"] = getattr(torch, name)
        if hasattr(torch.Tensor, name):
            table[f"Tensor.{name}"] = getattr(torch.Tensor, name)
    for name in _METHODS_ONLY:
        table[f"Tensor.{name}"] = getattr(torch.Tensor, name)
    for name in _FUNCTIONAL:
        table[f"F.{name}"] = getattr(F, name)
    for name in _OPERATORS:
        table[f"operator.{name}"] = getattr(operator, name)
    return table


#: name in the Program -> the function it calls (a tensor method takes its receiver first).
FLOAT_FUNCTIONS: dict[str, Callable[..., Any]] = _build()
_NAME_OF: dict[int, str] = {}
for _name, _fn in FLOAT_FUNCTIONS.items():
    _NAME_OF.setdefault(id(_fn), _name)

#: dtypes of the values the float part computes on: float32 values, int64 indices, bool masks.
#: Integer codes (int8 / int16 / int32) never are: an op on codes is BPU work with its own rules.
FLOAT_VALUE_DTYPES = frozenset({torch.float32, torch.int64, torch.bool})


def float_function_name(fn: Any = None, method: str | None = None) -> str | None:
    """The allowlist name of a torch callable (or of tensor method ``method``), None when it has none."""
    if method is not None:
        name = f"Tensor.{method}"
        return name if name in FLOAT_FUNCTIONS else None
    return _NAME_OF.get(id(fn)) if fn is not None else None


def _plain(out: Any) -> Any:
    """torch's named tuples (``max(x, dim)``, ``topk``, ``sort``) as plain tuples, as a program holds them."""
    return tuple(out) if isinstance(out, tuple) else out


def _float_fn_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    name, pos, kw = named_call(inst, args)
    for v in [*pos, *kw.values()]:
        if isinstance(v, torch.Tensor) and v.dtype not in FLOAT_VALUE_DTYPES:
            raise ShapeError(f"{name}: a {v.dtype} operand; the float part takes float32, int64 and bool tensors")
    with torch.device("meta"):
        out = meta_call(name, FLOAT_FUNCTIONS[name], *pos, **kw)
    return [_plain(out)]


@register_kernel(
    "float_fn",
    schema=KernelSchema(
        extra=_refs_are_inputs,
        inputs=(1, 64),
        attrs=named_call_attrs(FLOAT_FUNCTIONS),
        shape=_float_fn_shape,
    ),
)
def float_fn(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """``fn(*args, **kwargs)`` for ``fn`` in :data:`FLOAT_FUNCTIONS`, on the CPU in float."""
    return [_plain(call_named(inst, args, FLOAT_FUNCTIONS, "float function"))]
