"""QAT training on the integer grid for LayerNorm and Softmax: the converted module's integer rule on the codes.

Both integer forms are functions of the input codes and the current scales alone
(``backends.common.math_rules``; docs/semantics.md, "Softmax" and "LayerNorm"), so a bound QAT
``LayerNorm`` / ``Softmax`` reproduces them exactly in its QAT forward:

* LayerNorm: ``layer_norm_params`` from the input and output scales, ``eps`` and the current float
  weight and bias, then ``layer_norm_int`` (exact int64 mean and variance, integer square root, the
  affine in the requantization);
* Softmax (qint8 input): ``softmax_exp_table`` of the input scale, ``softmax_params`` of the output
  scale, then ``softmax_int`` (row maximum on codes, int16 exp table, exact sum and division).

The output fake quant observes what the float QAT forward computes before it (the same torch
calls), the result is ``codes * s_out``, and the gradient is the float forward's: that of
``fq(f(x))``, through the float LayerNorm (its weight and bias get theirs) or softmax. So the
step's output equals ``convert_fx`` of the state after the step's observer updates.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from backends.common.math_rules import (
    SOFTMAX_MAX_LENGTH,
    layer_norm_int,
    layer_norm_params,
    softmax_exp_table,
    softmax_int,
    softmax_params,
)
from qir.ir.types import DType
from qir.quantization.fake_quantize import float_fake_quant_active
from qir.quantization.integer_grid import _ATTR, GridBinding, _observe, _on, _plain_fq, grid_step
from qir.quantization.integer_grid_functional import _codes, _GridOut, _scale

__all__ = ["layer_norm_forward", "softmax_forward"]


@grid_step
def layer_norm_forward(m: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The integer-grid QAT forward of a bound QAT ``LayerNorm``, or None when it does not apply (not
    bound, a fake quant off or in validation, not float32 input, or the integer rule refuses the
    scales or sizes: the float forward runs and convert names the problem)."""
    binding: GridBinding | None = m.__dict__.get(_ATTR)
    if binding is None or float_fake_quant_active() or x.dtype != torch.float32:
        return None
    ofq = _plain_fq(m.activation_post_process)
    in_fq = binding.inputs[0]
    if ofq is None or not _on([in_fq, ofq]):
        return None
    k = len(m.normalized_shape)
    if tuple(x.shape[x.dim() - k :]) != tuple(m.normalized_shape):
        return None
    y = F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
    _observe(ofq, y)
    dt = DType(ofq.dtype)
    with torch.no_grad():
        try:
            p = layer_norm_params(
                _scale(in_fq), _scale(ofq), m.normalized_shape, m.eps, m.weight, m.bias, binding.march, dt
            )
            codes = layer_norm_int(_codes(x, in_fq).to(DType(in_fq.dtype).to_torch()), k, p, dt)
        except (ValueError, NotImplementedError):
            return None
    out: torch.Tensor = _GridOut.apply(y, codes, ofq.scale.detach().reshape(()), ofq.qmin, ofq.qmax)
    return out


@grid_step
def softmax_forward(m: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The integer-grid QAT forward of a bound QAT ``Softmax``, or None when it does not apply (not
    bound, a fake quant off, not qint8 codes, a row longer than the int32 sum takes)."""
    binding: GridBinding | None = m.__dict__.get(_ATTR)
    if binding is None or float_fake_quant_active() or x.dtype != torch.float32:
        return None
    ofq = _plain_fq(m.activation_post_process)
    in_fq = binding.inputs[0]
    efq = m.exp_post_process
    if ofq is None or not _on([in_fq, efq, ofq]) or DType(in_fq.dtype) is not DType.qint8:
        return None
    if x.dim() == 0 or x.shape[m.dim] > SOFTMAX_MAX_LENGTH:
        return None
    # the float QAT forward before its output fake quant (qir.nn.qat.Softmax)
    e = efq(torch.exp(x - x.amax(dim=m.dim, keepdim=True).detach()))
    y = e / e.sum(dim=m.dim, keepdim=True)
    _observe(ofq, y)
    dt = DType(ofq.dtype)
    with torch.no_grad():
        try:
            mult, shift = softmax_params(_scale(ofq), dt, binding.march)
        except ValueError:
            return None
        codes = softmax_int(_codes(x, in_fq), softmax_exp_table(_scale(in_fq)), mult, shift, m.dim, dt)
    out: torch.Tensor = _GridOut.apply(y, codes, ofq.scale.detach().reshape(()), ofq.qmin, ofq.qmax)
    return out
