"""A conv shared by two call sites stays one weight when only one site fuses (with an add)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.prepare import PREPARE_BY_PASS, PREPARE_PATH_KEY


class SharedConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        a = self.conv(x) + x  # this call fuses into a ConvAdd2d
        return self.dequant(self.conv(a))  # this one stays a conv


class SharedConvLate(nn.Module):
    """The plain call first, then the call that fuses with an add."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.conv(self.quant(x))
        return self.dequant(self.conv(a) + a)


def _weights(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters(remove_duplicate=False) if n.endswith("weight")}


def test_the_fused_and_the_plain_call_share_one_weight_through_training() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 8)
    with march_scope("bayes"):
        qat = prepare_qat_fx(SharedConv(), {"": get_default_qat_qconfig()}, x)
    w = _weights(qat)
    assert len(w) == 2 and len({id(p) for p in w.values()}) == 1, list(w)
    assert type(qat.get_submodule(next(n for n in w if n != "conv.weight").rsplit(".", 1)[0])).__name__ == "ConvAdd2d"
    opt = torch.optim.SGD(qat.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        qat(x).square().mean().backward()
        opt.step()
    a, b = _weights(qat).values()
    assert torch.equal(a, b)
    state = qat.state_dict()
    assert set(_weights(qat)) <= set(state)  # both keys in checkpoints, as torch ties do
    with march_scope("bayes"):
        fresh = prepare_qat_fx(SharedConv(), {"": get_default_qat_qconfig()}, x)
        fresh(x)
        fresh.load_state_dict(state, strict=True)
        assert len({id(p) for p in _weights(fresh).values()}) == 1
        set_fake_quantize(qat, "validation")
        qat.eval()
        converted = convert_fx(qat)
        assert torch.equal(compile_model(converted, [x])(x), converted(x))


@pytest.mark.parametrize("net", [SharedConv, SharedConvLate])
def test_calibration_then_qat_keeps_the_tie(net: type[nn.Module]) -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 4, 8, 8)
    with march_scope("bayes"):
        calib = prepare_qat_fx(net(), {"": get_default_calib_qconfig()}, x)
        calib.eval()
        calib(x)
        qat = prepare_qat_fx(calib, {"": get_default_qat_qconfig()}, x)
    # the re-prepare traces the fused ConvAdd2d as an opaque call holding the conv's weight: the
    # insert-observers pass ties it to the conv's QAT weight whichever call comes first, as module swapping does
    assert qat.meta[PREPARE_PATH_KEY] == PREPARE_BY_PASS
    assert len({id(p) for p in _weights(qat).values()}) == 1
    assert len({id(p) for p in _weights(calib).values()}) == 1
