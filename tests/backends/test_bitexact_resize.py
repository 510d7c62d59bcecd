"""Bilinear resize compiles and runs bit-exactly against the converted model (int8 and int16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import DeQuantStub

import qir
from qir.march import march_scope
from qir.quantization import (
    QuantStub,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)


class Upsampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.quant(x))
        y = F.interpolate(y, scale_factor=2.0, mode="bilinear", align_corners=False)
        return self.dequant(y)


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
def test_bilinear_resize_is_bit_exact(dtype: str, tmp_path: object) -> None:
    torch.manual_seed(0)
    with march_scope("bayes"):
        qat = prepare_qat_fx(Upsampler(), {"": get_default_qat_qconfig(dtype=dtype)})
        for _ in range(3):
            qat(torch.randn(2, 3, 6, 6))
        set_fake_quantize(qat, "validation")
        converted = convert_fx(qat.eval())
        path = f"{tmp_path}/m.hbm"
        compile_model(converted, [torch.randn(1, 3, 6, 6)], hbm=path, check=False)
        loaded = qir.load_compiled(path)
        for i in range(20):
            x = torch.randn(1 + i % 3, 3, 6, 6)
            assert torch.equal(loaded(x), converted(x))
