"""A DETR / BEVFormer-style query decoder as Horizon users write it: memory from a conv feature by
``x.flatten(2).permute(0, 2, 1)``, learned queries quantized straight from a parameter,
``self.query_quant(self.query_embed.weight).unsqueeze(0).repeat(bs, 1, 1)`` with ``bs`` from
``feat.shape[0]``, multi-head attention with ``FloatFunctional().matmul(q, k, y_trans=True)``,
``mul_scalar`` and softmax, LayerNorm over the last dim, a GELU FFN, a high-precision class
Linear and a sigmoid box branch. Calibration -> QAT -> convert -> check -> compile -> run.

A QuantStub whose input is a parameter is a float input of that stub (check_model said the
parameter was qint8 and refused), and compiles to the parameter's codes, quantized when the
program is compiled with the run-time rule (lowering refused the parameter before)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from names_flow import fx_flow
from torch import nn

from qir.march import March, march_scope
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
)
from qir.quantization.qconfig import default_calib_8bit_weight_32bit_out_fake_quant_qconfig


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.scale = self.dh**-0.5
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.softmax = nn.Softmax(dim=-1)
        self.mm1, self.mm2, self.mul = FloatFunctional(), FloatFunctional(), FloatFunctional()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        b, nq, c = query.shape
        nk = key.shape[1]
        q = self.q(query).view(b, nq, self.h, self.dh).permute(0, 2, 1, 3)
        k = self.k(key).view(b, nk, self.h, self.dh).permute(0, 2, 1, 3)
        v = self.v(value).view(b, nk, self.h, self.dh).permute(0, 2, 1, 3)
        attn = self.softmax(self.mul.mul_scalar(self.mm1.matmul(q, k, x_trans=False, y_trans=True), self.scale))
        return self.o(self.mm2.matmul(attn, v).permute(0, 2, 1, 3).reshape(b, nq, c))


class DecoderLayer(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.self_attn, self.cross_attn = Attention(d, heads), Attention(d, heads)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.add1, self.add2, self.add3, self.add_pos = (FloatFunctional() for _ in range(4))

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        q = self.add_pos.add(tgt, query_pos)
        tgt = self.norm1(self.add1.add(tgt, self.self_attn(q, q, tgt)))
        tgt = self.norm2(self.add2.add(tgt, self.cross_attn(tgt, memory, memory)))
        return self.norm3(self.add3.add(tgt, self.ffn(tgt)))


class DETRHead(nn.Module):
    def __init__(self, c: int = 16, queries: int = 6, classes: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.quant, self.query_quant, self.pos_quant = QuantStub(), QuantStub(), QuantStub()
        self.input_proj = nn.Conv2d(c, c, 1)
        self.query_embed = nn.Embedding(queries, c)
        self.query_pos = nn.Embedding(queries, c)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(layers))
        self.cls = nn.Linear(c, classes + 1)
        self.box = nn.Sequential(nn.Linear(c, c), nn.ReLU(), nn.Linear(c, 4))
        self.box_sigmoid = nn.Sigmoid()
        self.dequant = DeQuantStub()

    def forward(self, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs = feat.shape[0]
        memory = self.input_proj(self.quant(feat)).flatten(2).permute(0, 2, 1)
        tgt = self.query_quant(self.query_embed.weight).unsqueeze(0).repeat(bs, 1, 1)
        pos = self.pos_quant(self.query_pos.weight).unsqueeze(0).repeat(bs, 1, 1)
        for layer in self.layers:
            tgt = layer(tgt, memory, pos)
        return self.dequant(self.cls(tgt)), self.dequant(self.box_sigmoid(self.box(tgt)))


def _feature() -> tuple[torch.Tensor]:
    return (torch.randn(2, 16, 5, 6),)


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def test_the_decoder_with_parameter_queries_calibrates_trains_converts_and_compiles() -> None:
    calib = {
        "": get_default_calib_qconfig(),
        "module_name": {"cls": default_calib_8bit_weight_32bit_out_fake_quant_qconfig},
    }
    qat = {"": get_default_qat_qconfig(), "module_name": {"cls": get_default_qat_out_qconfig()}}
    result = fx_flow(DETRHead().eval(), _feature, calib, qat, steps=2)  # check_model passes, the artifact is exact
    logits, boxes = result.integer_out
    assert logits.shape == (2, 6, 5) and boxes.shape == (2, 6, 4)
    box_lsb = float(result.qat.get_submodule("box_sigmoid").activation_post_process.scale)
    assert float((boxes - result.qat_out[1]).abs().max()) <= 2.01 * box_lsb
    assert float((logits - result.qat_out[0]).abs().max()) <= 1e-4  # qint32 logits at the accumulator scale
    # the queries are a parameter: the program holds their codes, one per query and channel
    converted_stub = result.converted.get_submodule("query_quant")
    codes = converted_stub(result.converted.get_submodule("query_embed").weight)
    assert codes.dtype == torch.int8 and codes.shape == (6, 16)


def test_another_batch_size_runs_the_same_program() -> None:
    from qir.quantization import compile_model, convert_fx, prepare_qat_fx

    qat = prepare_qat_fx(DETRHead().eval(), {"": get_default_qat_qconfig()})
    qat(*_feature())
    qat.eval()
    converted = convert_fx(qat)
    program = compile_model(converted, list(_feature()))
    x = torch.randn(3, 16, 5, 6)  # bs read from the shape at run time: the queries repeat 3 times
    for got, want in zip(program(x), converted(x), strict=True):
        assert got.shape[0] == 3 and torch.equal(got, want)
