"""The ``quantize`` pass's rule for ``qat_lstm_cell``: the QAT cell -> ``qlstm_cell``.

It rebuilds the QAT cell from the op (sharing its state tensors), converts it with the quantized
LSTMCell's ``from_qat`` (module swapping's arithmetic) at the scales of its inputs (x, or x, h and
c: the call's form), and reads ``qlstm_cell`` and its integer state (the ``ih`` / ``hh`` linears'
buffers, the tables) off the converted cell under the same state-dict prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from passes.quantize import register_quantize_rule
from qir.ir.ops.integer_sequence import QLstmCell
from qir.nn.quantized.lstm import LSTMCell

__all__: list[str] = []


def _lstm_cell(op: Any, tensors: dict[str, torch.Tensor], scales: Sequence[torch.Tensor], march: str) -> Any:
    qat = op.to_module(tensors)
    q = LSTMCell.from_qat(qat, list(scales), march)
    new = QLstmCell.from_module(q)
    state = dict(q.named_buffers()) | dict(q.named_parameters())
    return new, {role: state[role] for role in new.param_roles()}


register_quantize_rule("qat_lstm_cell", _lstm_cell)
