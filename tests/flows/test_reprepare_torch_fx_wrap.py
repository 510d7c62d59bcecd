"""A function marked with ``torch.fx.wrap`` (torchvision's swin ``shifted_window_attention``) stays one call when a
prepared model is prepared again (calibration, then QAT from the calibrated model)."""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)


def pad_to_window(x: torch.Tensor, window: int) -> torch.Tensor:
    """Shape-dependent control flow: fx cannot trace into it."""
    pad = (window - x.shape[-1] % window) % window
    if pad >= 1:
        x = F.pad(x, (0, pad, 0, pad))
    return x


torch.fx.wrap("pad_to_window")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pad_to_window(self.dequant(self.conv(self.quant(x))), 4)  # float post-processing


def test_a_torch_fx_wrapped_call_survives_a_second_prepare() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6)
    with march_scope("bayes"):
        calib = prepare_qat_fx(Net().eval(), {"": get_default_calib_qconfig()})
        calib(x)
        qat = prepare_qat_fx(calib, {"": get_default_qat_qconfig()})  # traces the calibrated model's float twin
        assert [n.target for n in qat.graph.nodes if n.op == "call_function"] == [pad_to_window]
        qat(x)
        set_fake_quantize(qat.eval(), "validation")
        with torch.no_grad():
            got, want = qat(x), convert_fx(qat)(x)
    assert got.shape == (2, 4, 8, 8)
    assert torch.equal(got, want)
