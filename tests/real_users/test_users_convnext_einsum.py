"""A ConvNeXt block with a window-free attention step, as BEV backbones write them: a 7x7 depthwise
conv, ``permute(0, 2, 3, 1)`` to channels-last for ``nn.LayerNorm`` and the Linear / GELU MLP, the
layer scale ``gamma`` quantized by its own QuantStub, then attention written with
``torch.einsum("bhqd,bhkd->bhqk", q, k) * (c // heads) ** -0.5`` and
``torch.einsum("bhqk,bhkd->bhqd", attn.softmax(-1), v)``. Calibration -> QAT -> convert -> check ->
compile -> run.

A batched-matmul einsum becomes ``matmul`` (with the transpose the equation implies), so it gets a
FloatFunctional ``matmul`` (it stayed einsum, which has no integer form: convert refused it). The
attention scale computed from sizes is a number when prepare types the graph without example
inputs (its invented 1-sized dims gave ``0 ** -0.5``, a failure taken for a tensor: a two-tensor
``mul`` that convert refused)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from names_flow import fx_flow
from torch import nn

from qir.march import March, march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.prepare_checks import UnconvertibleModelError


class Block(nn.Module):
    def __init__(self, c: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.pw1, self.act, self.pw2 = nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c)
        self.gamma = nn.Parameter(0.1 * torch.ones(c))
        self.gamma_quant = QuantStub()
        self.qkv = nn.Linear(c, 3 * c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pw2(self.act(self.pw1(self.norm(self.dw(x).permute(0, 2, 3, 1)))))
        x = x + (self.gamma_quant(self.gamma) * y).permute(0, 3, 1, 2)
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        q, k, v = self.qkv(t).reshape(b, h * w, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.einsum("bhqd,bhkd->bhqk", q, k) * (c // self.heads) ** -0.5
        o = torch.einsum("bhqk,bhkd->bhqd", attn.softmax(dim=-1), v)
        return x + o.transpose(1, 2).reshape(b, h * w, c).transpose(1, 2).reshape(b, c, h, w)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.stem = nn.Conv2d(3, 16, 4, 4)
        self.block = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.block(self.stem(self.quant(x))))


def _image() -> tuple[torch.Tensor]:
    return (torch.rand(1, 3, 16, 16),)


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def test_einsum_attention_becomes_matmuls_and_the_scale_a_number() -> None:
    qat = prepare_qat_fx(Net().eval(), {"": get_default_qat_qconfig()})  # no example inputs
    methods = {str(n.target) for n in qat.graph.nodes if n.op == "call_method"}
    assert "matmul" in methods and "mul_scalar" in methods
    assert not [n for n in qat.graph.nodes if n.target is torch.einsum]
    scale = next(n for n in qat.graph.nodes if n.op == "call_method" and n.target == "mul_scalar")
    assert isinstance(scale.args[1], torch.fx.Node)  # (c // heads) ** -0.5, computed at run time


def test_the_block_calibrates_trains_converts_and_compiles() -> None:
    result = fx_flow(Net().eval(), _image, steps=2)
    assert result.integer_out.shape == (1, 16, 4, 4)
    lsb = max(
        float(m.activation_post_process.scale)
        for n, m in result.qat.named_modules()
        if n.startswith("block._generated_add") and getattr(m, "activation_post_process", None) is not None
    )
    assert result.max_error() <= 2.01 * lsb  # measured 0: validation QAT computes the integer grid


class ClassQueries(nn.Module):
    """A segmentation head scoring every pixel against class embeddings, as mask decoders write it:
    ``torch.einsum("bchw,bkc->bkhw", feat, queries)`` (not a batched matmul: no integer form)."""

    def __init__(self, float_scores: bool = False) -> None:
        super().__init__()
        self.float_scores = float_scores
        self.quant, self.quant_q, self.dequant, self.dequant_q = QuantStub(), QuantStub(), DeQuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        feat, q = self.conv(self.quant(x)), self.quant_q(queries)
        if self.float_scores:  # the fix the error names: dequantize first, score in float
            return torch.einsum("bchw,bkc->bkhw", self.dequant(feat), self.dequant_q(q))
        return self.dequant(torch.einsum("bchw,bkc->bkhw", feat, q))


def test_an_einsum_with_no_integer_form_is_refused_at_prepare_naming_module_and_fix() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = ClassQueries()

        def forward(self, x: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
            return self.head(x, queries)

    with pytest.raises(
        UnconvertibleModelError,
        match=r"einsum\('bchw,bkc->bkhw'.*module 'head' \(ClassQueries\).*torch\.matmul.*DeQuantStub",
    ):
        prepare_qat_fx(Model().eval(), {"": get_default_qat_qconfig()})
    # the same einsum on dequantized tensors runs in float: prepared and converted
    model = ClassQueries(float_scores=True).eval()
    inputs = (torch.rand(1, 3, 6, 6), torch.randn(1, 4, 8))
    qat = prepare_qat_fx(model, {"": get_default_qat_qconfig()})
    qat(*inputs)
    qat.eval()
    set_fake_quantize(qat, "validation")
    with torch.no_grad():
        assert torch.equal(convert_fx(qat)(*inputs), qat(*inputs))  # float after the DeQuantStubs
