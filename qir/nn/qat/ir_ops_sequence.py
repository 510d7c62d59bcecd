"""The IR's ``qat_lstm_cell`` op for qir's QAT LSTMCell: reader (module -> op) and builder.

The builder constructs the cell around the node's state tensors (shared, not copied): the float
weights and biases as parameters, every fake quant from its spec, registered in the module's own
order (:data:`~qir.ir.ops.qat_sequence.LSTM_FAKE_QUANTS`). Whether the cell is called with a state
is the call's, not the module's: the reader leaves ``has_state`` False and binding the call sets it.
"""

from __future__ import annotations

from typing import Any

import torch

from qir.ir.ops.qat import register_qat_module
from qir.ir.ops.qat_sequence import LSTM_FAKE_QUANTS, QATLstmCell
from qir.nn.qat.ir_ops import _param, build_fake_quant, fake_quant_factory, fake_quant_spec
from qir.nn.qat.lstm import LSTM_FQ_DTYPES, LSTMCell
from qir.quantization.qconfig import QConfig

__all__: list[str] = []

if LSTM_FAKE_QUANTS[2:] != tuple(LSTM_FQ_DTYPES):  # the IR spells the module's registration order
    raise ImportError(
        f"qir.ir.ops.qat_sequence.LSTM_FAKE_QUANTS {LSTM_FAKE_QUANTS[2:]} must list qir.nn.qat.lstm.LSTM_FQ_DTYPES "
        f"{tuple(LSTM_FQ_DTYPES)} in order"
    )


def _read_lstm_cell(m: Any) -> QATLstmCell:
    return QATLstmCell(
        input_size=int(m.input_size),
        hidden_size=int(m.hidden_size),
        fake_quants=tuple(fake_quant_spec(getattr(m, n), f"LSTMCell.{n}") for n in LSTM_FAKE_QUANTS),
        bias=bool(m.bias),
    )


def _build_lstm_cell(op: Any, tensors: dict[str, torch.Tensor]) -> LSTMCell:
    weight = fake_quant_factory(op.fake_quant("weight_ih_fake_quant"))
    qc = QConfig(activation=fake_quant_factory(op.fake_quant("activation_post_process")), weight=weight)
    m = LSTMCell(op.input_size, op.hidden_size, op.bias, qconfig=qc, device="meta")
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")[: 4 if op.bias else 2]:
        m._parameters[name] = _param(tensors[name])
    for name, spec in zip(LSTM_FAKE_QUANTS, op.fake_quants, strict=True):
        m._modules[name] = build_fake_quant(spec, tensors, name)
    return m


register_qat_module(QATLstmCell, LSTMCell, _read_lstm_cell, _build_lstm_cell)
