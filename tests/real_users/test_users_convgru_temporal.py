"""A temporal model as Horizon users write it for video: a per-frame encoder and a ConvGRU cell
unrolled over the frames, ``z, r = torch.split(sigmoid(conv(cat([x, h]))), ch, dim=1)`` and the
update ``(1 - z) * h + z * h_tilde``, then ``torch.stack`` of the dequantized per-frame outputs.
Calibration -> QAT -> convert -> check -> compile -> run.

``1 - z`` (a number minus a quantized tensor) becomes a generated ``mul_scalar`` by -1 and an
``add_scalar``; pieces of a ``split`` of a quantized tensor are quantized values (before, code on
them was taken for code built from sizes and left float); the ``torch.stack`` after the DeQuantStubs
stays a float op, in the converted model and in the artifact."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from names_flow import fx_flow
from torch import nn

from qir.march import March, march_scope
from qir.quantization import DeQuantStub, QuantStub, prepare_qat_fx
from qir.quantization.qconfig import get_default_qat_qconfig


class ConvGRUCell(nn.Module):
    def __init__(self, cin: int, ch: int, k: int = 3) -> None:
        super().__init__()
        self.ch = ch
        self.conv_zr = nn.Conv2d(cin + ch, 2 * ch, k, padding=k // 2)
        self.conv_h = nn.Conv2d(cin + ch, ch, k, padding=k // 2)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        zr = torch.sigmoid(self.conv_zr(torch.cat([x, h], dim=1)))
        z, r = torch.split(zr, self.ch, dim=1)
        h_tilde = torch.tanh(self.conv_h(torch.cat([x, r * h], dim=1)))
        return (1 - z) * h + z * h_tilde


class Temporal(nn.Module):
    def __init__(self, frames: int = 3, c: int = 8) -> None:
        super().__init__()
        self.frames = frames
        self.quant_x, self.quant_h = QuantStub(), QuantStub()
        self.enc = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.cell = ConvGRUCell(c, c)
        self.head = nn.Conv2d(c, 2, 1)
        self.dequant = DeQuantStub()

    def forward(self, clip: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.quant_h(h0)
        outs = []
        for t in range(self.frames):  # (B, T, 3, H, W): one frame per step
            h = self.cell(self.enc(self.quant_x(clip[:, t])), h)
            outs.append(self.dequant(self.head(h)))
        return torch.stack(outs, dim=1), self.dequant(h)


def _clip() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(2, 3, 3, 8, 8), torch.randn(2, 8, 8, 8) * 0.5


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def test_one_minus_a_gate_is_quantized_and_the_stack_of_outputs_stays_float() -> None:
    qat = prepare_qat_fx(Temporal().eval(), {"": get_default_qat_qconfig()})
    generated = {n for n, _ in qat.named_modules() if "_generated_" in n}
    # per frame: mul_scalar(z, -1) and add_scalar(., 1) in the cell; nothing for the float stack
    assert {"cell._generated_mul_0", "cell._generated_add_0"} <= generated
    assert not any("stack" in n for n in generated)
    calls = [n for n in qat.graph.nodes if n.op == "call_method" and n.target in ("mul_scalar", "add_scalar")]
    assert sorted(n.args[2] for n in calls)[:3] == [-1.0] * 3  # type: ignore[index]
    assert any(n.target is torch.stack for n in qat.graph.nodes if n.op == "call_function")


def test_the_gru_calibrates_trains_converts_and_compiles() -> None:
    result = fx_flow(Temporal().eval(), _clip, steps=2)
    seq, h = result.integer_out
    assert seq.shape == (2, 3, 2, 8, 8) and seq.dtype == torch.float32 and h.shape == (2, 8, 8, 8)
    head_lsb = float(result.qat.get_submodule("head").activation_post_process.scale)
    assert result.max_error() <= 2.01 * head_lsb  # validation QAT computes the integer grid
