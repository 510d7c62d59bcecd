"""Typing a traced graph by shape formulas instead of a forward run on the example inputs.

:func:`qir.quantization.fx_trace.build_ir` types every fx node with the value it takes on the
example inputs. Only the values' shapes and dtypes reach the IR (``qir.ir.types.type_of``), so
for a graph made only of layers whose output shape is a formula of their input's (conv, linear,
batch norm, activations, pools, ``+``, ``flatten``: a torchvision ResNet, a conv-bn-relu chain)
:func:`shape_values` computes the same values as empty meta tensors: no arithmetic on the
weights, no batch-norm statistics to protect. Any other node, a module of a class not listed
here (a subclass too: its forward may differ), or a case a formula does not cover (non-zero
padding modes, broadcasting, mixed dtypes, shapes torch would refuse) makes it return None, and
the caller runs the real forward, which computes the value or raises torch's own error.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from qir.ir.meta_shapes import adaptive_pool_shape, binary_shape, conv_shape, linear_shape, pool_shape
from qir.quantization.stubs import FLOAT_DEQUANT_STUBS, FLOAT_QUANT_STUBS

__all__ = ["shape_values"]

Shape = tuple[int, ...]


def _meta(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _as_meta(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _meta(t.shape, t.dtype)


#: modules whose output is their input's shape and dtype, with the input ranks they accept
_SAME_SHAPE: dict[type, tuple[int, ...] | None] = {
    nn.ReLU: None,
    nn.ReLU6: None,
    nn.Identity: None,
    nn.Dropout: None,
    **dict.fromkeys((*FLOAT_QUANT_STUBS, *FLOAT_DEQUANT_STUBS)),
    nn.BatchNorm1d: (2, 3),
    nn.BatchNorm2d: (4,),
    nn.BatchNorm3d: (5,),
}


def _pool(m: nn.MaxPool2d | nn.AvgPool2d, x: torch.Tensor) -> torch.Tensor | None:
    if isinstance(m, nn.MaxPool2d) and m.return_indices:
        return None
    dilation = m.dilation if isinstance(m, nn.MaxPool2d) else 1
    shape = pool_shape(tuple(x.shape), 2, m.kernel_size, m.stride, m.padding, dilation, m.ceil_mode)
    return None if shape is None else _meta(shape, x.dtype)


def _adaptive_avg_pool(m: nn.AdaptiveAvgPool2d, x: torch.Tensor) -> torch.Tensor | None:
    shape = adaptive_pool_shape(tuple(x.shape), 2, m.output_size)
    return None if shape is None else _meta(shape, x.dtype)


def _module(m: nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The module call's value as a meta tensor, or None (not covered)."""
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    cls = type(m)
    if cls in _SAME_SHAPE:
        ranks = _SAME_SHAPE[cls]
        if ranks is not None:  # a batch norm
            if x.dim() not in ranks or x.shape[1] != getattr(m, "num_features", -1):
                return None
            if m.training and x.numel() <= x.shape[1]:
                return None  # one value per channel: torch refuses batch statistics, let it say so
        return _meta(x.shape, x.dtype)
    if cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        conv: Any = m
        if conv.padding_mode != "zeros":
            return None
        w, b = _as_meta(conv.weight), _as_meta(conv.bias)
        shape = conv_shape(x, w, b, None, conv.stride, conv.padding, conv.dilation, conv.groups)
        return None if shape is None else _meta(shape, x.dtype)
    if cls is nn.Linear:
        lin: Any = m
        shape = linear_shape(x, _as_meta(lin.weight), _as_meta(lin.bias), None)
        return None if shape is None else _meta(shape, x.dtype)
    if cls in (nn.MaxPool2d, nn.AvgPool2d):
        return _pool(m, x)  # type: ignore[arg-type]
    if cls is nn.AdaptiveAvgPool2d:
        return _adaptive_avg_pool(m, x)  # type: ignore[arg-type]
    return None


def _flatten(x: Any, start_dim: Any = 0, end_dim: Any = -1) -> torch.Tensor | None:
    if not isinstance(x, torch.Tensor) or not isinstance(start_dim, int) or not isinstance(end_dim, int):
        return None
    rank = x.dim()
    if not (-rank <= start_dim < rank and -rank <= end_dim < rank):
        return None
    start, end = start_dim % rank, end_dim % rank
    if start > end:
        return None
    shape = (*x.shape[:start], math.prod(x.shape[start : end + 1]), *x.shape[end + 1 :])
    return _meta(shape, x.dtype)


def _add(a: Any, b: Any) -> torch.Tensor | None:
    shape = binary_shape(a, b)
    return None if shape is None else _meta(shape, a.dtype)


_FUNCTIONS: dict[Any, Callable[..., torch.Tensor | None]] = {
    operator.add: _add,
    operator.iadd: _add,
    torch.add: _add,
    torch.flatten: _flatten,
    torch.relu: lambda x: _meta(x.shape, x.dtype) if isinstance(x, torch.Tensor) else None,
    torch.nn.functional.relu: lambda x: _meta(x.shape, x.dtype) if isinstance(x, torch.Tensor) else None,
}


def _function(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    rule = _FUNCTIONS.get(target)
    if rule is None:
        return None
    try:
        return rule(*args, **kwargs)
    except TypeError:  # arguments the formula does not take (torch.add's alpha=): not covered
        return None


def shape_values(root: nn.Module, fx_graph: torch.fx.Graph, example_inputs: Sequence[Any]) -> dict[str, Any] | None:
    """fx node name -> a meta tensor of the shape and dtype its value takes on ``example_inputs``
    (what ``propagate`` records, for typing), or None when some node has no formula here."""
    values: dict[str, Any] = {}
    inputs = iter(example_inputs)
    for n in fx_graph.nodes:
        args: Any
        if n.op == "placeholder":
            if n.args:
                return None  # a default argument: the real run decides what it is
            x = next(inputs, None)
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                return None
            values[n.name] = _meta(x.shape, x.dtype)
            continue
        args = torch.fx.node.map_arg(n.args, lambda a: values[a.name])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: values[a.name])
        out: Any
        if n.op == "call_module":
            out = _module(root.get_submodule(str(n.target)), args, dict(kwargs))
        elif n.op == "call_function":
            out = _function(n.target, args, dict(kwargs))
        elif n.op == "output":
            out = args[0]
        else:
            return None
        if out is None:
            return None
        values[n.name] = out
    if next(inputs, None) is not None:
        return None  # more inputs than placeholders: the real run reports it
    return values
