"""The IR's ``qat_lstm_cell`` / ``qat_multihead_attention`` ops for qir's QAT LSTMCell and
MultiheadAttention: readers (module -> op) and builders.

The builder constructs the cell around the node's state tensors (shared, not copied): the float
weights and biases as parameters, every fake quant from its spec, registered in the module's own
order (:data:`~qir.ir.ops.qat_sequence.LSTM_FAKE_QUANTS`). Whether the cell is called with a state
is the call's, not the module's: the reader leaves ``has_state`` False and binding the call sets it
(as it sets the attention's masks and ``need_weights``).
"""

from __future__ import annotations

from typing import Any

import torch

from qir.ir.ops.attention import load_dotted
from qir.ir.ops.qat import register_qat_module
from qir.ir.ops.qat_sequence import LSTM_FAKE_QUANTS, MHA_FAKE_QUANTS, QATLstmCell, QATMultiheadAttention
from qir.nn.qat.attention import MHA_FQ_DTYPES, MultiheadAttention
from qir.nn.qat.ir_ops import _param, build_fake_quant, fake_quant_factory, fake_quant_spec
from qir.nn.qat.lstm import LSTM_FQ_DTYPES, LSTMCell
from qir.quantization.qconfig import QConfig

__all__: list[str] = []

# the IR spells the modules' registration order
if LSTM_FAKE_QUANTS[2:] != tuple(LSTM_FQ_DTYPES) or MHA_FAKE_QUANTS[4:-2] != tuple(MHA_FQ_DTYPES):
    raise ImportError(
        "qir.ir.ops.qat_sequence.LSTM_FAKE_QUANTS / MHA_FAKE_QUANTS must list qir.nn.qat's LSTM_FQ_DTYPES / "
        "MHA_FQ_DTYPES in order"
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


def _fq_module(m: Any, name: str) -> Any:
    owner, _, leaf = name.rpartition(".")
    return getattr(m.get_submodule(owner) if owner else m, leaf)


def _read_attention(m: Any) -> QATMultiheadAttention:
    return QATMultiheadAttention(
        embed_dim=int(m.embed_dim),
        num_heads=int(m.num_heads),
        fake_quants=tuple(fake_quant_spec(_fq_module(m, n), f"MultiheadAttention.{n}") for n in MHA_FAKE_QUANTS),
        dropout=float(m.dropout),
        bias=m.in_proj_bias is not None,
        batch_first=bool(m.batch_first),
    )


def _build_attention(op: Any, tensors: dict[str, torch.Tensor]) -> MultiheadAttention:
    weight = fake_quant_factory(op.fake_quant("wq_fake_quant"))
    qc = QConfig(activation=fake_quant_factory(op.fake_quant("activation_post_process")), weight=weight)
    m = MultiheadAttention(op.embed_dim, op.num_heads, op.dropout, op.bias, op.batch_first, qconfig=qc, device="meta")
    params = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
    load_dotted(m, {r: tensors[r] for r in (params if op.bias else params[::2])})
    for name, spec in zip(MHA_FAKE_QUANTS, op.fake_quants, strict=True):
        owner, _, leaf = name.rpartition(".")
        (m.get_submodule(owner) if owner else m)._modules[leaf] = build_fake_quant(spec, tensors, name)
    return m


register_qat_module(QATMultiheadAttention, MultiheadAttention, _read_attention, _build_attention)
