"""A CRNN text recogniser as users port it: a conv backbone, the feature map read as a sequence of
columns (``view(b, c * h, w).permute(2, 0, 1)``), a bidirectional LSTM, a linear classifier per step;
log_softmax and CTC decoding run outside the model.

``nn.LSTM`` has no QAT form (the operator tables list ``nn.LSTMCell`` only): behind a DeQuantStub it
runs in float and the model converts; unrolled with two ``nn.LSTMCell`` the sequence calibrates, trains,
converts and compiles on Bayes (Bernoulli2 has no qint16 cell state)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from names_flow import fx_flow
from torch import nn
from torch.nn.quantized import FloatFunctional

from qir.march import March, march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)

HIDDEN = 8


class BiLSTM(nn.Module):
    """``nn.LSTM(nin, nh, bidirectional=True)`` over ``steps`` time steps, unrolled with two cells."""

    def __init__(self, nin: int, nh: int, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.fw = nn.LSTMCell(nin, nh)
        self.bw = nn.LSTMCell(nin, nh)
        self.cat = FloatFunctional()

    def forward(self, seq: torch.Tensor) -> torch.Tensor:  # seq: [T, B, C]
        state = self.fw(seq[0])
        forward = [state[0]]
        for t in range(1, self.steps):
            state = self.fw(seq[t], state)
            forward.append(state[0])
        state = self.bw(seq[self.steps - 1])
        backward = [state[0]]
        for t in range(self.steps - 2, -1, -1):
            state = self.bw(seq[t], state)
            backward.insert(0, state[0])
        return self.cat.cat([torch.stack(forward), torch.stack(backward)], dim=2)


class CRNN(nn.Module):
    def __init__(self, classes: int = 11, unrolled: bool = False) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, 8, 3, 1, 1),
            nn.BatchNorm2d(8),
            nn.ReLU(True),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(8, 8, 3, 1, 1),
            nn.BatchNorm2d(8),
            nn.ReLU(True),
            nn.MaxPool2d((2, 1), (2, 1)),
        )
        self.rnn: nn.Module = BiLSTM(16, HIDDEN, 4) if unrolled else nn.LSTM(16, HIDDEN, bidirectional=True)
        self.embedding = nn.Linear(HIDDEN * 2, classes)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.cnn(self.quant(x))
        b, c, h, w = conv.size()
        seq = conv.view(b, c * h, w).permute(2, 0, 1)  # [w, b, c * h]: one step per column
        rec = self.rnn(seq)
        if isinstance(rec, tuple):  # nn.LSTM returns (output, (h, c))
            rec = rec[0]
        t, b, hidden = rec.size()
        return self.dequant(self.embedding(rec.reshape(t * b, hidden)).view(t, b, -1))


def _lines() -> tuple[torch.Tensor]:
    return (torch.rand(2, 1, 8, 8) * 2 - 1,)  # 4 columns after the backbone


@pytest.fixture(autouse=True)
def _bayes() -> Iterator[None]:
    torch.manual_seed(0)
    with march_scope(March.BAYES):
        yield


def test_the_lstm_behind_a_dequant_stub_converts() -> None:
    class FloatRNN(CRNN):
        def __init__(self) -> None:
            super().__init__()
            self.rnn_dequant, self.rnn_quant = DeQuantStub(), QuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            conv = self.cnn(self.quant(x))
            b, c, h, w = conv.size()
            rec, _ = self.rnn(self.rnn_dequant(conv.view(b, c * h, w).permute(2, 0, 1)))
            t, b, hidden = rec.size()
            return self.dequant(self.embedding(self.rnn_quant(rec.reshape(t * b, hidden))).view(t, b, -1))

    qat = prepare_qat_fx(FloatRNN().eval(), {"": get_default_qat_qconfig()})
    x = _lines()
    qat(*x)
    qat.eval()
    set_fake_quantize(qat, "validation")
    converted = convert_fx(qat)
    with torch.no_grad():
        assert torch.equal(converted(*x), qat(*x))


def test_the_unrolled_crnn_calibrates_trains_converts_and_compiles() -> None:
    model = CRNN(unrolled=True).eval()
    result = fx_flow(model, _lines, steps=2)
    assert result.integer_out.shape == (4, 2, 11)
    assert torch.equal(result.integer_out, result.qat_out)
    with torch.no_grad():
        ref = model(*result.inputs)
    assert float((result.qat_out - ref).abs().max()) < 0.1 * float(ref.abs().max())
    log_probs = result.integer_out.log_softmax(2)  # the CTC decoder's input, outside the model
    assert log_probs.argmax(2).shape == (4, 2)
