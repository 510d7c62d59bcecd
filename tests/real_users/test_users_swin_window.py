"""A Swin-style transformer as users port it: a patch-embed conv, LayerNorm on (B, L, C) tokens, window
partition / reverse by view + permute with sizes read from ``x.shape``, a shifted window by ``torch.roll``,
window attention with a scaled ``q @ k^T`` (FloatFunctional ``mul_scalar`` and ``matmul``), a learned
relative-position bias added before ``nn.Softmax(dim=-1)``, a GELU MLP and FloatFunctional residual adds.

Calibration -> strict checkpoint into a fresh QAT model -> QAT -> validation -> convert -> check ->
compile -> perf / visualize / ONNX on Bayes (Bernoulli2's table has no LayerNorm, Linear or reshape:
check_model says so by name). The learned bias is a float parameter: read next to quantized tensors
without a QuantStub it is refused at prepare, naming the parameter and the fix."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.quantized import FloatFunctional

from qir.frontend.tracer import TraceError
from qir.march import March, march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    perf_model,
    prepare_qat_fx,
    set_fake_quantize,
    visualize_model,
)
from qir.quantization.compile import CompileError
from qir.quantization.prepare_checks import UnconvertibleModelError

WS = 2  # window size


def window_partition(x: torch.Tensor, ws: int) -> torch.Tensor:
    b, h, w, c = x.shape
    x = x.view(b, h // ws, ws, w // ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws * ws, c)


def window_reverse(windows: torch.Tensor, ws: int, h: int, w: int) -> torch.Tensor:
    b = windows.shape[0] // (h * w // ws // ws)
    x = windows.view(b, h // ws, w // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(b, h, w, -1)


class WindowAttention(nn.Module):
    def __init__(self, dim: int, heads: int, quant_bias: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.softmax = nn.Softmax(dim=-1)
        self.relative_position_bias = nn.Parameter(torch.randn(heads, WS * WS, WS * WS) * 0.1)
        self.bias_quant = QuantStub() if quant_bias else nn.Identity()
        self.mul_scale = FloatFunctional()
        self.matmul_qk = FloatFunctional()
        self.matmul_v = FloatFunctional()
        self.add_bias = FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b_, n, c = x.shape
        qkv = self.qkv(x).reshape(b_, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = self.mul_scale.mul_scalar(q, self.scale)
        attn = self.matmul_qk.matmul(q, k.transpose(-2, -1))
        # Bayes adds without broadcasting over N: the bias is expanded to the windows
        bias = self.bias_quant(self.relative_position_bias).unsqueeze(0).expand(b_, -1, -1, -1)
        attn = self.softmax(self.add_bias.add(attn, bias))
        x = self.matmul_v.matmul(attn, v).transpose(1, 2).reshape(b_, n, c)
        return self.proj(x)


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, shift: int, quant_bias: bool = True) -> None:
        super().__init__()
        self.shift = shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, quant_bias)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim))
        self.add1 = FloatFunctional()
        self.add2 = FloatFunctional()

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b, _, c = x.shape
        shortcut = x
        x = self.norm1(x).view(b, h, w, c)
        if self.shift:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        x = window_reverse(self.attn(window_partition(x, WS)), WS, h, w)
        if self.shift:
            x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
        x = self.add1.add(shortcut, x.view(b, h * w, c))
        return self.add2.add(x, self.mlp(self.norm2(x)))


class TinySwin(nn.Module):
    def __init__(self, dim: int = 8, classes: int = 5, quant_bias: bool = True) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.patch_embed = nn.Conv2d(3, dim, 4, 4)
        self.norm0 = nn.LayerNorm(dim)
        self.blocks = nn.ModuleList([SwinBlock(dim, 2, 0, quant_bias), SwinBlock(dim, 2, WS // 2, quant_bias)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(self.quant(x))
        _, _, h, w = x.shape
        x = self.norm0(x.flatten(2).transpose(1, 2))
        for blk in self.blocks:
            x = blk(x, h, w)
        return self.dequant(self.head(self.norm(x).mean(1)))


def _images() -> tuple[torch.Tensor]:
    return (torch.rand(2, 3, 16, 16) * 2 - 1,)


@pytest.fixture(autouse=True)
def _bayes() -> Iterator[None]:
    torch.manual_seed(0)
    with march_scope(March.BAYES):
        yield


def _calibrated_then_qat(model: nn.Module, fresh: nn.Module) -> nn.Module:
    """The toolkit's two runs: calibrate and save; prepare a fresh model for QAT, load strictly, train."""
    calib = prepare_qat_fx(model, {"": get_default_calib_qconfig()})
    calib.eval()
    set_fake_quantize(calib, "calibration")
    with torch.no_grad():
        for _ in range(3):
            calib(*_images())
    buf = io.BytesIO()
    torch.save(calib.state_dict(), buf)
    buf.seek(0)
    qat = prepare_qat_fx(fresh, {"": get_default_qat_qconfig()})
    qat.load_state_dict(torch.load(buf), strict=True)
    qat.train()
    opt = torch.optim.SGD([p for p in qat.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(2):
        loss = qat(*_images()).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.eval()
    set_fake_quantize(qat, "validation")
    return qat


def test_the_swin_block_calibrates_trains_converts_and_compiles_on_bayes(tmp_path: Path) -> None:
    model = TinySwin().eval()
    qat = _calibrated_then_qat(model, TinySwin().eval())
    x = _images()
    converted = convert_fx(qat)
    with torch.no_grad():
        want, got, ref = qat(*x), converted(*x), model(*x)
    assert torch.equal(got, want)  # validation mode computes what the integer model computes
    assert float((want - ref).abs().max()) < 0.1 * float(ref.abs().max())  # and stays near the float model
    assert check_model(converted, x, advice=0).ok
    program = compile_model(converted, list(x))
    assert torch.equal(program(*x), got)
    profile = perf_model(converted, list(x), out_dir=str(tmp_path))
    assert (tmp_path / "perf.json").exists() and profile
    visualize_model(converted, list(x), save_path=str(tmp_path / "swin.svg"), show=False)
    assert "<svg" in (tmp_path / "swin.svg").read_text()


def test_bernoulli2_names_the_layers_its_table_lacks() -> None:
    with march_scope(March.BERNOULLI2):
        qat = prepare_qat_fx(TinySwin().eval(), {"": get_default_qat_qconfig()})
        x = _images()
        qat(*x)
        qat.eval()
        converted = convert_fx(qat)
        report = check_model(converted, x, advice=0)
        assert not report.ok
        assert "norm0" in str(report) and "torch.nn.LayerNorm" in str(report)
        with pytest.raises(CompileError, match=r"not legal on bernoulli2"):
            compile_model(converted, list(x))


def test_a_float_parameter_added_to_quantized_attention_is_refused_at_prepare() -> None:
    # without the QuantStub, QAT trained with the bias unquantized and convert_fx refused the add only
    # after training (or, with no other quantized module in between, failed with an internal message)
    with pytest.raises(
        UnconvertibleModelError,
        match=r"node 'add' \(module 'blocks\.0\.attn\.add_bias', FloatFunctional\) in the forward of module "
        r"'blocks\.0\.attn' \(WindowAttention\) takes the float tensor 'blocks\.0\.attn\.relative_position_bias'"
        r".*QuantStub",
    ):
        prepare_qat_fx(TinySwin(quant_bias=False).eval(), {"": get_default_qat_qconfig()})


class ConvPlusBias(nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 1)
        self.register_buffer("offset", torch.randn(1, 4, 1, 1))
        self.ff = FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.quant(x))
        if self.op == "ff":
            y = self.ff.mul(y, self.offset)
        elif self.op == "operator":
            y = y + self.offset
        else:
            y = torch.cat([y, self.offset.expand_as(y)], 1)
        return self.dequant(y)


@pytest.mark.parametrize("op", ["ff", "operator", "cat"])
def test_a_float_buffer_next_to_quantized_tensors_is_refused_by_name(op: str) -> None:
    # the old convert_fx error named neither the node nor the fix:
    # "QFunctional was converted with 1 input scale(s) but the call uses input 1"
    with pytest.raises(UnconvertibleModelError, match=r"float tensor 'offset'.*QuantStub"):
        prepare_qat_fx(ConvPlusBias(op), {"": get_default_qat_qconfig()})


def test_int_of_a_traced_size_says_how_to_write_it() -> None:
    class Reverse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b = int(x.shape[0] / 2)  # the official Swin's window_reverse
            return self.dequant(self.quant(x).view(b, -1))

    with pytest.raises(TraceError, match=r"int\(\) or float\(\) of a traced value.*w\.shape\[0\] // "):
        prepare_qat_fx(Reverse(), {"": get_default_qat_qconfig()})
