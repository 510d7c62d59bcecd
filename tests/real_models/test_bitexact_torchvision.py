"""torchvision resnet18 and mobilenet_v2 (random weights) on Bayes: the compiled artifact equals the
converted model bit for bit.

Runs only when selected (torchvision installed):
``/work/tvenv/bin/python -m pytest -m torchvision tests/real_models/test_bitexact_torchvision.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.ao.quantization import DeQuantStub

import qir
from qir.march import march_scope
from qir.quantization import QuantStub, compile_model, convert_fx, get_default_qat_qconfig, prepare_qat_fx

pytestmark = pytest.mark.torchvision
tv = pytest.importorskip("torchvision")


class Stubbed(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.body = body
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.body(self.quant(x)))


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_torchvision_bitexact(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    body = getattr(tv.models, name)().eval()
    with march_scope("bayes"):
        prepared = prepare_qat_fx(Stubbed(body), {"": get_default_qat_qconfig()})
        prepared.train()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _ in range(2):
                prepared(torch.randn(4, 3, 224, 224, generator=g))
        converted = convert_fx(prepared.eval())
        example = torch.randn(1, 3, 224, 224, generator=g)
        traced = torch.jit.trace(converted, example)
        compile_model(traced, [example], hbm=tmp_path / f"{name}.hbm", opt=2)
    run = qir.load_compiled(tmp_path / f"{name}.hbm")
    compared = 0
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 3, 224, 224, generator=g)
            got, want = run(x), converted(x)
            assert torch.equal(got, want), f"{name}: max diff {(got - want).abs().max()}"
            compared += x.shape[0]
    assert compared == 16
