"""QAT MultiheadAttention on the integer grid: the forward's values are the converted module's.

The QAT ``MultiheadAttention`` is a composition of projections, per-head products, qir's Softmax
and a mean over heads, each with its own fake quant (qir.nn.qat.attention). Its integer form
(:class:`qir.nn.quantized.MultiheadAttention`) derives every integer parameter from those fake
quants' scales and the current weights. So on the grid, a bound QAT attention runs its float
forward first (every observer updates as in float fake quantization, and autograd records the
float forward's graph), then builds the integer module from the state that forward left
(``MultiheadAttention.from_qat``, as convert does) and runs it on the input codes. The outputs
carry the integer values with the float forward's gradients (straight through). So each step's
outputs equal ``convert_fx`` of the state after the step's observer updates, by construction.

Not on the grid (the float forward runs): dropout in training (the converted module has none),
inputs whose scale the binding could not follow, fake quants off or in validation.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from qir.ir.ops.qat_sequence import MHA_FAKE_QUANTS
from qir.ir.types import DType
from qir.nn.qat.attention import MultiheadAttention as QATMultiheadAttention
from qir.nn.quantized.attention import MultiheadAttention
from qir.quantization.fake_quantize import float_fake_quant_active
from qir.quantization.integer_grid import _ATTR, _PLAIN_FQ, FellBack, GridBinding, _on, _plain_fq, grid_step
from qir.quantization.integer_grid_functional import _codes

__all__ = ["applies", "attention_grid_forward"]

#: the attention's own fake quants (its softmax's are read from m.softmax)
_FQS = tuple(n for n in MHA_FAKE_QUANTS if not n.startswith("softmax."))


class _Straight(torch.autograd.Function):
    """Forward: the integer result ``codes * s`` (exactly); backward: the gradient of the float value."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None


def applies(m: QATMultiheadAttention, inputs: tuple[torch.Tensor, ...]) -> bool:
    """Whether the bound attention ``m`` computes on the grid for this call (checked before its float forward)."""
    binding: GridBinding | None = m.__dict__.get(_ATTR)
    if binding is None or float_fake_quant_active() or (m.training and m.dropout > 0):
        return False
    if any(not isinstance(t, torch.Tensor) or t.dtype != torch.float32 for t in inputs):
        return False
    w_fqs = [getattr(m, n) for n in _FQS[:4]]
    a_fqs = [getattr(m, n) for n in _FQS[4:]] + [m.softmax.exp_post_process, m.softmax.activation_post_process]
    if any(type(f) not in _PLAIN_FQ for f in w_fqs) or any(_plain_fq(f) is None for f in a_fqs):
        return False  # a learnable-scale fake quant keeps its own forward
    return _on([*binding.inputs, *w_fqs, *a_fqs])


@grid_step
def attention_grid_forward(
    m: QATMultiheadAttention,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    floats: tuple[torch.Tensor, torch.Tensor | None],
    options: dict[str, Any],
    on_grid: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The outputs of ``m``'s call on ``inputs`` whose float forward gave ``floats`` (``options``: the
    masks and flags of the call): on the grid when ``on_grid`` (:func:`applies`) and convert takes the
    module, else ``floats`` (counted as a fallback in ``integer_grid_report``)."""
    if not on_grid:
        raise FellBack(floats)
    binding: GridBinding = m.__dict__[_ATTR]
    with torch.no_grad():
        try:
            q = MultiheadAttention.from_qat(m, [fq.scale.detach() for fq in binding.inputs], binding.march)
        except (ValueError, NotImplementedError) as err:
            # convert refuses this attention in its current state (a dtype the march lacks, ...)
            warnings.warn(
                f"integer grid: MultiheadAttention has no integer form this step ({err}); this call uses float "
                "fake quantization",
                RuntimeWarning,
                stacklevel=3,  # the QAT attention's forward
            )
            raise FellBack(floats) from None
        codes = [_codes(t, fq).to(DType(fq.dtype).to_torch()) for t, fq in zip(inputs, binding.inputs, strict=True)]
        out_c, w_c = q(*codes, **options)
    out_fq, w_fq = m.output_fake_quants()
    out = _Straight.apply(floats[0], out_c.to(torch.float32) * out_fq.scale.detach().reshape(()))
    if floats[1] is None or w_c is None:
        return out, None
    weights = _Straight.apply(floats[1], w_c.to(torch.float32) * w_fq.scale.detach().reshape(()))
    return out, weights


QATMultiheadAttention.grid_hooks = (applies, attention_grid_forward)
