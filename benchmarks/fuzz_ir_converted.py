"""Converted-model seeds for benchmarks/fuzz_ir.py: integer IR traced from convert_fx results.

Three small models, each prepared for QAT, stepped on three batches, converted on both marches
(Bayes and Bernoulli2; the sequence model on Bayes only, whose LSTM cell state is qint16) and
traced: their graphs hold the integer ops (``qquant_stub``, ``qconv`` as conv / depthwise conv
with a fused add / linear, ``qmax_pool2d``, ``qlut``, ``qsoftmax``, ``qlayer_norm``, ``qcat`` as
cat and stack, ``qinterpolate``, ``qadaptive_avg_pool2d``, ``qmatmul``, ``qmul_scalar``,
``qprelu``, ``qglu``, ``qmul``, ``qreduce``, ``qadd``, ``qminmax``, ``qlut_method``, ``qrelu6``,
``qavg_pool2d``, ``qadd_scalar``, ``qdiv``, ``qtensor_div``, ``qmultihead_attention``,
``qlstm_cell`` with and without its state, ``qdequant_stub``; qint16 codes into ``qlut`` and
``qlut_method``: segmented tables) with their integer state
(weights, multipliers, shifts, tables) as constants. The fuzzer binds those real constants to
a mutated text wherever its declared type still matches, so a mutant runs on the values a
converted model holds.
"""

from __future__ import annotations

import torch
from torch import nn

import qir
from qir.frontend import trace
from qir.ir import print_graph
from qir.march import march_scope
from qir.nn.modules.functional import FloatFunctional
from qir.quantization import DeQuantStub, QuantStub, convert_fx, get_default_qat_qconfig, prepare_qat_fx


class _Vision(nn.Module):
    """conv-bn-relu, depthwise conv + add, max pool, sigmoid, softmax, layer norm, cat, upsample, pool, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.mp = nn.MaxPool2d(2)
        self.sig = nn.Sigmoid()
        self.sm = nn.Softmax(-1)
        self.ln = nn.LayerNorm([4, 4])
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 5)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(self.quant(x))))
        z = self.mp(self.dw(y) + y)
        c = torch.cat([self.sig(z), self.ln(self.sm(z))], dim=1)
        return self.dequant(self.fc(self.gap(self.up(c)).flatten(1)))


class _Math(nn.Module):
    """Attention-style matmuls and the functional integer ops."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.qkv = nn.Linear(8, 24)
        self.sm = nn.Softmax(-1)
        self.prelu = nn.PReLU(5)
        self.glu = nn.GLU(-1)
        self.relu6 = nn.ReLU6()
        self.ap = nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False)
        self.div = qir.nn.Div()
        self.dequant = DeQuantStub()
        for name in ("mm1", "mm2", "ms", "mul", "sum", "sub", "mx", "ex", "adds", "adds2", "td", "st"):
            setattr(self, name, FloatFunctional())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.quant(x)).chunk(3, dim=-1)
        att = self.sm(self.ms.mul_scalar(self.mm1.matmul(q, k, y_trans=True), 0.35))
        p = self.glu(self.prelu(self.mm2.matmul(att, v)))
        m = self.mul.mul(p, p)
        r = self.mx.maximum(m, self.sub.sub(self.sum.sum(m, dim=-1, keepdim=True), m))
        r = self.ap(self.relu6(self.ex.exp(r)).unsqueeze(1)).squeeze(1)
        r = self.div(r, self.adds.add_scalar(r, 1.0))
        return self.dequant(self.st.stack([r, self.td.div(r, self.adds2.add_scalar(r, 2.0))], dim=1))


class _Sequence(nn.Module):
    """Self-attention, an LSTM cell with its state from QuantStubs, one without state, a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.qx, self.qh, self.qc = QuantStub(), QuantStub(), QuantStub()
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.cell = nn.LSTMCell(8, 8)
        self.cell0 = nn.LSTMCell(8, 8)
        self.fc = nn.Linear(8, 4)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        q = self.qx(x)
        a, _ = self.att(q, q, q, need_weights=False)
        h1, _ = self.cell(a.flatten(0, 1), (self.qh(h), self.qc(c)))
        h2, _ = self.cell0(h1)
        return self.dequant(self.fc(h2))


class _Lut16(nn.Module):
    """qint16 codes into Tanh (a qint16 output, a segmented ``table16``) and FloatFunctional.exp."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.act = nn.Tanh()
        self.ff = FloatFunctional()
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.ff.exp(self.act(self.quant(x))))


def _one(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (torch.randn(shape, generator=gen),)


def _sequence_inputs(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.randn(shape, generator=gen)
    n = shape[0] * shape[1]
    return x, torch.randn(n, shape[2], generator=gen).tanh(), torch.randn(n, shape[2], generator=gen)


#: (name, model, input shape, inputs from the shape, marches, activation dtype): the LSTM cell
#: keeps its cell state in qint16, and qint16 codes into a table are segmented tables, which only
#: Bayes produces
MODELS = (
    ("vision", _Vision, (2, 3, 8, 8), _one, ("bayes", "bernoulli2"), "qint8"),
    ("math", _Math, (2, 5, 8), _one, ("bayes", "bernoulli2"), "qint8"),
    ("sequence", _Sequence, (2, 5, 8), _sequence_inputs, ("bayes",), "qint8"),
    ("lut16", _Lut16, (2, 64), _one, ("bayes",), "qint16"),
)


def converted_seeds() -> list[tuple[str, str, dict[str, torch.Tensor]]]:
    """(name, text, constants) of each model converted on each march and traced."""
    seeds = []
    for name, make, shape, inputs, marches, dtype in MODELS:
        for march in marches:
            torch.manual_seed(0)
            gen = torch.Generator().manual_seed(0)
            batches = [inputs(shape, gen) for _ in range(3)]
            with march_scope(march):
                qconfig = get_default_qat_qconfig(dtype=dtype)
                qat = prepare_qat_fx(make(), {"": qconfig}, example_inputs=batches[0])
                for batch in batches:
                    qat(*batch)
                model = convert_fx(qat.eval())
            graph = trace(model, batches[0])
            seeds.append((f"converted:{name}:{march}", print_graph(graph), dict(graph.constants)))
    return seeds
