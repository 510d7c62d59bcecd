"""qir.nn.functional: the plugin's window / shuffle helpers through the whole flow; the detection
helpers refused by name."""

import pytest
import torch
from torch import nn

import qir.nn.functional as hF  # the plugin users' spelling
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)


def test_window_partition_and_reverse_are_swins() -> None:
    x = torch.arange(2 * 4 * 6 * 3, dtype=torch.float32).reshape(2, 4, 6, 3)
    win = hF.window_partition(x, 2)
    assert win.shape == (2 * 2 * 3, 2, 2, 3)
    assert torch.equal(win[1], x[0, 0:2, 2:4])  # the second window of the first image
    assert torch.equal(hF.window_reverse(win, 2, 4, 6), x)


def test_channel_shuffle_matches_torch() -> None:
    x = torch.randn(2, 6, 3, 3)
    assert torch.equal(hF.channel_shuffle(x, 3), torch.nn.functional.channel_shuffle(x, 3))


class _WindowMixer(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(c, c, 1, groups=2)
        self.proj = nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = hF.channel_shuffle(self.conv(self.quant(x)), 2)
        win = hF.window_partition(x.permute(0, 2, 3, 1), 2)  # (B*nW, 2, 2, C)
        out = hF.window_reverse(self.proj(win), 2, 4, 4)  # (B, 4, 4, C)
        return self.dequant(out.permute(0, 3, 1, 2))


def test_window_and_shuffle_helpers_prepare_convert_check_and_compile() -> None:
    torch.manual_seed(0)
    qat = prepare_qat_fx(_WindowMixer(), {"": get_default_qat_qconfig()})
    for _ in range(3):
        qat(torch.randn(2, 8, 4, 4))
    set_fake_quantize(qat, "validation")
    x = torch.randn(2, 8, 4, 4)
    converted = convert_fx(qat)
    out = converted(x)
    lsb = float(qat.proj.activation_post_process.scale)
    assert (out - qat(x)).abs().max() <= 2 * lsb
    assert check_model(converted, x, advice=0).ok
    assert torch.equal(compile_model(converted, [x])(x), out)


@pytest.mark.parametrize("name", ["nms", "decode", "get_top_n", "point_pillars_scatter", "bgr_to_yuv444"])
def test_post_processing_helpers_are_refused_with_what_to_use(name: str) -> None:
    with pytest.raises(ImportError, match=rf"qir\.nn\.functional\.{name} is not supported by qir: "):
        getattr(hF, name)
