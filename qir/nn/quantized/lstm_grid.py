"""QAT LSTMCell on the integer grid: the forward's values are the converted cell's.

As for attention (qir.nn.quantized.attention_grid): the QAT ``LSTMCell`` is a composition of
linears, the add, sigmoid / tanh tables and products, each with its own fake quant, and its
integer form (:class:`qir.nn.quantized.LSTMCell`) derives every integer parameter from those fake
quants' scales and the current weights. On the grid a bound cell runs its float forward first
(every observer updates, autograd records it), then builds the integer cell from the state that
forward left (``LSTMCell.from_qat`` with the scales of ``x`` or of ``x, h, c``, as convert does)
and runs it on the input codes; ``(h', c')`` carry the integer values with the float forward's
gradients. So each step's outputs equal ``convert_fx`` of the state after the step's observer
updates, by construction.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from qir.ir.types import DType
from qir.nn.qat.lstm import LSTM_FQ_DTYPES
from qir.nn.qat.lstm import LSTMCell as QATLSTMCell
from qir.nn.quantized.attention_grid import _Straight
from qir.nn.quantized.lstm import LSTMCell
from qir.quantization.fake_quantize import float_fake_quant_active
from qir.quantization.integer_grid import _ATTR, _PLAIN_FQ, FellBack, GridBinding, _on, _plain_fq, grid_step
from qir.quantization.integer_grid_functional import _codes

__all__ = ["applies", "lstm_grid_forward"]


def _tensors(x: Any, hx: Any) -> list[Any]:
    return [x] if hx is None else [x, *hx]


def applies(m: QATLSTMCell, x: Any, hx: Any) -> bool:
    """Whether the bound cell ``m`` computes on the grid for this call (checked before its float forward)."""
    binding: GridBinding | None = m.__dict__.get(_ATTR)
    if binding is None or float_fake_quant_active():
        return False
    ts = _tensors(x, hx)
    if len(ts) != len(binding.inputs) or any(not isinstance(t, torch.Tensor) or t.dtype != torch.float32 for t in ts):
        return False
    w_fqs = [m.weight_ih_fake_quant, m.weight_hh_fake_quant]
    a_fqs = [getattr(m, n) for n in LSTM_FQ_DTYPES]
    if any(type(f) not in _PLAIN_FQ for f in w_fqs) or any(_plain_fq(f) is None for f in a_fqs):
        return False  # a learnable-scale fake quant keeps its own forward
    return _on([*binding.inputs, *w_fqs, *a_fqs])


@grid_step
def lstm_grid_forward(
    m: QATLSTMCell, x: torch.Tensor, hx: Any, floats: tuple[torch.Tensor, torch.Tensor], on_grid: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs ``(h', c')`` of ``m``'s call on ``x`` / ``hx`` whose float forward gave ``floats``: on
    the grid when ``on_grid`` (:func:`applies`) and convert takes the cell, else ``floats`` (counted
    as a fallback in ``integer_grid_report``)."""
    if not on_grid:
        raise FellBack(floats)
    binding: GridBinding = m.__dict__[_ATTR]
    ts = _tensors(x, hx)
    with torch.no_grad():
        try:
            q = LSTMCell.from_qat(m, [fq.scale.detach() for fq in binding.inputs], binding.march)
        except (ValueError, NotImplementedError) as err:
            # convert refuses this cell in its current state (a qint16 state on Bernoulli2, ...)
            warnings.warn(
                f"integer grid: LSTMCell has no integer form this step ({err}); this call uses float fake quantization",
                RuntimeWarning,
                stacklevel=3,  # the QAT cell's forward
            )
            raise FellBack(floats) from None
        codes = [_codes(t, fq).to(DType(fq.dtype).to_torch()) for t, fq in zip(ts, binding.inputs, strict=True)]
        h_c, c_c = q(codes[0]) if hx is None else q(codes[0], (codes[1], codes[2]))
    h_fq, c_fq = m.output_fake_quants()
    h = _Straight.apply(floats[0], h_c.to(torch.float32) * h_fq.scale.detach().reshape(()))
    c = _Straight.apply(floats[1], c_c.to(torch.float32) * c_fq.scale.detach().reshape(()))
    return h, c


QATLSTMCell.grid_hooks = (applies, lstm_grid_forward)
