"""The fused float model a prepared model records (re-prepare starts from it) shares no tensor
with the model that trains, on both prepare paths, including a module held at two paths and a
weight two layers share; and it holds the float values, not the trained ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qir.march import march_scope
from qir.quantization import QuantStub, get_default_qat_qconfig, prepare_qat_fx
from qir.quantization.prepare import PREPARE_PATH_KEY, PREPARE_RECORD_KEY


class Net(nn.Module):
    def __init__(self, alias: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.pool = nn.MaxPool2d(2)  # max pool: the module-swap path today
        if alias:
            self.again = self.conv2  # one module at two paths
        if tied:
            self.conv3 = nn.Conv2d(4, 4, 1)
            self.conv3.weight = self.conv2.weight  # one weight in two layers
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(torch.relu(self.bn(self.conv1(self.quant(x)))))
        if hasattr(self, "conv3"):
            y = self.conv3(y)
        if hasattr(self, "pool"):
            y = self.pool(y)
        return self.dequant(y)


def _storages(m: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*m.parameters(), *m.buffers()) if t.numel()}


@pytest.mark.parametrize("alias", [False, True])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pooled", [False, True])
def test_the_record_shares_nothing_with_the_trained_model(alias: bool, tied: bool, pooled: bool) -> None:
    torch.manual_seed(0)
    net = Net(alias, tied)
    if not pooled:
        del net.pool
    x = torch.randn(2, 3, 8, 8)
    qconfigs: dict = {"": get_default_qat_qconfig()}
    if tied:  # conv3 stays float in the QAT model and holds the weight conv2 (a QAT layer) shares
        qconfigs["module_name"] = {"conv3": None}
    with march_scope("bayes"):
        prepared = prepare_qat_fx(net, qconfigs, x)
    record = prepared.meta[PREPARE_RECORD_KEY].float_model
    assert _storages(record).isdisjoint(_storages(prepared))
    before = {k: v.clone() for k, v in record.state_dict().items()}
    opt = torch.optim.SGD(prepared.parameters(), lr=0.5)
    for _ in range(2):
        prepared(x).sum().backward()
        opt.step()
    after = record.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert PREPARE_PATH_KEY in prepared.meta


def test_re_prepare_starts_from_the_recorded_float_model() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    with march_scope("bayes"):
        first = prepare_qat_fx(Net(alias=True, tied=True), {"": get_default_qat_qconfig()}, x)
        first(x)
        again = prepare_qat_fx(first, {"": get_default_qat_qconfig()}, x)
    assert list(again.state_dict()) == list(first.state_dict())
    assert _storages(again).isdisjoint(_storages(first))
