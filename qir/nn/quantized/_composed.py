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

__all__ = ["fq_scale", "integer_linear", "linear_from_spec", "product_params"]


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


def linear_from_spec(
    march: str, in_scale: float, out: Any, tensors: dict[str, torch.Tensor], prefix: str
) -> QuantizedConvBase:
    """The integer ``Linear`` a composed IR op holds (``qlstm_cell``'s ``ih``, attention's ``q_proj``):
    the ``qconv`` builder on a linear op with these scales and the ``<prefix>.<role>`` tensors."""
    from qir.ir.ops.integer import QConv
    from qir.nn.quantized.conv import _from_qconv

    op = QConv(kind="linear", out=out, in_scales=(in_scale,), march=march)
    own = {r: tensors[f"{prefix}.{r}"] for r in op.param_roles()}
    return _from_qconv(op, own)
