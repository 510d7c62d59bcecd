"""Helpers of the integer modules composed of other integer modules (LSTMCell, MultiheadAttention)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from backends.common import numerics
from qir.ir.types import DType
from qir.nn.qat import conv as qat_conv
from qir.nn.quantized.conv import QUANTIZED_CONV_CLASSES, QuantizedConvBase
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.qconfig import QConfig

__all__ = ["fq_scale", "integer_linear", "product_params"]


def fq_scale(fq: FakeQuantize) -> float:
    """A per-tensor fake quant's scale as a float (its float32 value)."""
    return float(fq.scale.detach().reshape(-1)[0].to(torch.float32))


def integer_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_fq: FakeQuantize,
    out_fq: FakeQuantize,
    qconfig: QConfig,
    s_in: float,
    march: str,
) -> QuantizedConvBase:
    """The integer ``Linear`` of ``weight`` / ``bias`` with these fake quants (copied), for input scale ``s_in``:
    the conv / linear rule itself, so composed modules share its exactness and its lowering."""
    lin: Any = qat_conv.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, qconfig=qconfig)
    with torch.no_grad():
        lin.weight.copy_(weight.detach())
        if bias is not None:
            lin.bias.copy_(bias.detach())
    lin.weight_fake_quant = copy.deepcopy(weight_fq)
    lin.activation_post_process = copy.deepcopy(out_fq)
    out = QUANTIZED_CONV_CLASSES[type(lin)].from_qat(lin, [s_in], march)
    assert isinstance(out, QuantizedConvBase)
    return out


def product_params(s_a: float, s_b: float, s_out: float, march: str, dtype: DType) -> tuple[int, int]:
    """``(multiplier, shift)`` requantizing an exact product at ``s_a * s_b`` to ``s_out``."""
    m, s = numerics.conv_requant_params(s_a, s_b, s_out, march, dtype)
    return int(m.reshape(-1)[0]), int(s.reshape(-1)[0])
