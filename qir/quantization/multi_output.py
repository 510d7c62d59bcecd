"""Scales of modules with several quantized outputs (``LSTMCell`` returns ``(h', c')``).

Such a QAT module has ``output_fake_quants()``: one fake quant per output, in order.
Convert's scale walk gives each ``r[i]`` of the call's result output ``i``'s scale and dtype.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch import nn

from qir.ir.types import DType

__all__ = ["multi_output_item", "multi_output_scales"]

ScaleDType = tuple[torch.Tensor | None, DType | None]


def multi_output_scales(m: nn.Module) -> list[ScaleDType] | None:
    """``[(scale, dtype)]`` per output of ``m``, or None when ``m`` has one output."""
    get = getattr(m, "output_fake_quants", None)
    if not callable(get):
        return None
    return [(fq.scale.detach().clone(), DType(fq.dtype)) for fq in get()]


def multi_output_item(n: torch.fx.Node, calls: dict[str, list[ScaleDType]]) -> ScaleDType | None:
    """The scale and dtype ``n`` reads when it is ``r[i]`` of a multi-output call ``r``, else None."""
    if n.op != "call_function" or n.target is not operator.getitem or len(n.args) != 2:
        return None
    src, key = n.args
    if not isinstance(src, torch.fx.Node) or src.name not in calls or not isinstance(key, int):
        return None
    outs = calls[src.name]
    if not -len(outs) <= key < len(outs):
        raise IndexError(f"node '{n.name}' reads output {key} of '{src.name}', which has {len(outs)} outputs")
    return outs[key]
