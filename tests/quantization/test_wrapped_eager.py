"""Eager mode (``prepare_qat`` / ``convert`` without fx): an ``fx_wrap``-ed method is Python like the
rest of the forward, and the QAT modules it calls are converted too. Eager ``convert`` traces the
model to learn input scales, and the trace does not look into a wrapped method, so it converts
such a model from its recorded forwards (qir/quantization/eager_record.py); before, it left
those modules QAT in the "converted" model."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import qir.nn.qat as qat_nn
import qir.nn.quantized as int_nn
from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert,
    get_default_qat_qconfig,
    prepare_qat,
    set_fake_quantize,
)
from qir.quantization.convert import ConvertError
from qir.utils.fx_helper import wrap


@pytest.fixture(params=["bayes", "bernoulli2"])
def march(request: pytest.FixtureRequest) -> Iterator[str]:
    torch.manual_seed(0)
    with march_scope(request.param):
        yield request.param


class Net(nn.Module):
    """Eager style: the user's stubs around the conv the wrapped post-process calls."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.dequant = DeQuantStub()
        self.post_quant = QuantStub()
        self.post_conv = nn.Conv2d(8, 4, 1)
        self.post_relu = nn.ReLU()
        self.post_dequant = DeQuantStub()

    @wrap()
    def post(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:  # Python fx would not trace: the reason it is wrapped
            x = x * 1.0
        y = self.post_dequant(self.post_relu(self.post_conv(self.post_quant(x))))
        return y.flatten(1).topk(5, dim=1)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.dequant(self.conv(self.quant(x))))


def _prepared() -> nn.Module:
    model = Net()
    model.qconfig = get_default_qat_qconfig()
    return prepare_qat(model)


def test_eager_convert_converts_the_modules_a_wrapped_method_calls(march: str) -> None:
    qat = _prepared()
    assert isinstance(qat.post_conv, qat_nn.Conv2d)
    for _ in range(3):
        qat(torch.randn(2, 3, 8, 8) * 2)
    qat.eval()
    set_fake_quantize(qat, "validation")
    before = copy.deepcopy(qat.state_dict())
    converted = convert(qat)
    assert isinstance(converted.post_conv, int_nn.Conv2d) and isinstance(converted.conv, int_nn.Conv2d)
    assert isinstance(converted.post_quant, int_nn.QuantStub)
    assert all(torch.equal(v, before[k]) for k, v in qat.state_dict().items())  # the QAT model is untouched
    x = torch.randn(4, 3, 8, 8) * 2
    dtypes: list[torch.dtype] = []
    converted.post_conv.register_forward_hook(lambda m, a, out: dtypes.append(a[0].dtype))
    assert torch.equal(converted(x), qat(x))  # QAT validation runs this convert: bit for bit
    assert dtypes == [torch.int8]  # the conv inside the wrapped method computes on codes


def test_eager_convert_without_a_recorded_forward_names_the_method(march: str) -> None:
    names = (
        r"wrapped method Net.post calls the QAT module\(s\) 'post_quant', 'post_conv'.*run the prepare_qat model once"
    )
    with pytest.raises(ConvertError, match=names):
        convert(_prepared())
