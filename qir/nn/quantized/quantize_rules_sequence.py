"""The ``quantize`` pass's rules for ``qat_lstm_cell`` and ``qat_multihead_attention``: -> ``qlstm_cell``,
``qmultihead_attention``.

Each rebuilds the QAT layer from the op (sharing its state tensors), converts it with the quantized
class's ``from_qat`` (module swapping's arithmetic) at the scales of its code inputs (x, or x, h and
c: the cell's call form; query, key and value, not the float masks), and reads the integer op and
its integer state (the linears' buffers, the tables) off the converted module under the same
state-dict prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from passes.quantize import register_quantize_rule
from qir.ir.ops.integer_sequence import QLstmCell, QMultiheadAttention
from qir.nn.quantized.attention import MultiheadAttention
from qir.nn.quantized.lstm import LSTMCell

__all__: list[str] = []


def _rule(quantized: Any, integer_op: Any) -> Any:
    def rule(op: Any, tensors: dict[str, torch.Tensor], scales: Sequence[torch.Tensor], march: str) -> Any:
        q = quantized.from_qat(op.to_module(tensors), list(scales), march)
        new = integer_op.from_module(q)
        state = dict(q.named_buffers()) | dict(q.named_parameters())
        return new, {role: state[role] for role in new.param_roles()}

    return rule


register_quantize_rule("qat_lstm_cell", _rule(LSTMCell, QLstmCell))
register_quantize_rule("qat_multihead_attention", _rule(MultiheadAttention, QMultiheadAttention))
