"""convert_fx leaves the QAT model as it was, on both paths, without deep-copying it on the pass path.

The quantize-pass path traces the QAT model itself (its forward runs on scratch buffers) and
the conversion rules write new tensors only: every parameter and buffer keeps its object, its
values and its version counter (integer-exact validation reads the counters to know its twin is
current), the fake quants keep their switches, the model keeps its mode, and the converted
model shares no storage with it (training the QAT model on cannot change the deployed one).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import qir
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
)
from qir.quantization.convert import CONVERT_PATH_KEY
from qir.quantization.fake_quantize import FakeQuantize


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.b1(self.c1(self.quant(x))))
        y = self.relu(self.c2(y) + y)
        return self.dequant(self.fc(y.flatten(1)))


def _snapshot(m: nn.Module) -> dict[str, Any]:
    tensors = {**dict(m.named_parameters()), **dict(m.named_buffers())}
    return {
        "tensors": {k: (id(t), t._version, t.detach().clone()) for k, t in tensors.items()},
        "switches": [
            (n, f.observer_enabled, f.fake_quant_enabled, f.state)
            for n, f in m.named_modules()
            if isinstance(f, FakeQuantize)
        ],
        "modules": [(n, id(s), type(s), s.training) for n, s in m.named_modules()],
    }


def _assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["modules"] == after["modules"]
    assert before["switches"] == after["switches"]
    assert list(before["tensors"]) == list(after["tensors"])
    for k, (i, v, t) in before["tensors"].items():
        j, w, u = after["tensors"][k]
        assert (i, v) == (j, w), f"{k}: replaced or written in place"
        assert torch.equal(t, u), k


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("head", ["qint8", "qint32"])
def test_convert_fx_leaves_the_qat_model_untouched(train: bool, head: str) -> None:
    torch.manual_seed(0)
    qir.set_march("bayes")
    x = torch.randn(2, 3, 8, 8)
    qc: dict[str, Any] = {"": get_default_qat_qconfig()}
    if head == "qint32":
        qc["module_name"] = {"fc": get_default_qat_out_qconfig()}
    qat = prepare_qat_fx(Net(), qc, x)
    for _ in range(2):
        qat(torch.randn(2, 3, 8, 8) * 2)  # observers hold a moving average: one more batch would move it
    qat.train(train)
    before = _snapshot(qat)
    out = convert_fx(qat, example_inputs=torch.randn(4, 3, 8, 8) * 5)
    assert out.meta[CONVERT_PATH_KEY] == "quantize pass"
    _assert_same(before, _snapshot(qat))
    qat_storage = {t.untyped_storage().data_ptr() for t in [*qat.parameters(), *qat.buffers()] if t.numel()}
    shared = [k for k, t in out.state_dict().items() if t.numel() and t.untyped_storage().data_ptr() in qat_storage]
    assert shared == []
    # converting again gives the same model: nothing the first conversion did stuck to the QAT model
    again = convert_fx(qat, example_inputs=x)
    assert torch.equal(out.eval()(x), again.eval()(x))


def test_the_shared_weight_fake_quant_carries_nothing_between_models() -> None:
    """The pass builds one weight fake quant per FakeQuantSpec and gives it each layer's state in turn:
    converting a model of other weights (same qconfig) in between leaves a conversion unchanged."""
    torch.manual_seed(0)
    qir.set_march("bayes")
    x = torch.randn(2, 3, 8, 8)
    qats = []
    for gain in (1.0, 50.0):
        net = Net()
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(gain)
        # a weight observer with memory (averaging 0.5): another layer's range left in the shared fake
        # quant would move this one's re-observed scale
        qconfig = get_default_qat_qconfig(weight_qkwargs={"averaging_constant": 0.5})
        qat = prepare_qat_fx(net, {"": qconfig}, x)
        qat(x)
        qats.append(qat.eval())
    converted = [convert_fx(q) for q in (qats[0], qats[1], qats[0])]
    assert all(c.meta[CONVERT_PATH_KEY] == "quantize pass" for c in converted)
    first, other, again = (c.state_dict() for c in converted)
    assert list(first) == list(again)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["c1.scale"], other["c1.scale"])  # the other model did convert to other scales
