"""A CenterPoint-style multi-task BEV head as the toolkit writes it: a shared conv, one ``SepHead``
per task whose sub-heads are attributes set with ``self.__setattr__(name, ...)`` and read back with
``self.__getattr__(name)``, a ``forward`` that returns ``{"reg": ..., "heatmap": ...}`` per task, and
the qconfigs set by a ``set_qconfig()`` helper on the modules (``self.qconfig = ...`` plus the
high-precision qconfig on each sub-head's last conv) instead of a ``qconfig_dict``.

The flow: calibration qconfigs -> calibrate -> ``state_dict()`` -> a fresh model with QAT qconfigs
loads it strictly -> QAT -> convert -> check -> compile -> save -> load -> run; the outputs stay
dicts all the way, in the artifact too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from names_flow import finish
from torch import nn

import qir
from qir.march import March, march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.qconfig import default_calib_8bit_weight_32bit_out_fake_quant_qconfig

HEADS = {"reg": (2, 2), "height": (1, 2), "dim": (3, 2), "rot": (2, 2)}


def conv_bn_relu(c: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True))


class SepHead(nn.Module):
    def __init__(self, c: int, heads: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        self.heads = heads
        for name, (classes, num_conv) in heads.items():
            layers: list[nn.Module] = [conv_bn_relu(c) for _ in range(num_conv - 1)]
            layers.append(nn.Conv2d(c, classes, 1))
            self.__setattr__(name, nn.Sequential(*layers))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        ret = {}
        for head in self.heads:
            ret[head] = self.__getattr__(head)(x)
        return ret

    def set_qconfig(self, out_qconfig: object) -> None:
        for head in self.heads:
            self.__getattr__(head)[-1].qconfig = out_qconfig


class CenterHead(nn.Module):
    def __init__(self, c: int = 16, tasks: tuple[int, ...] = (1, 2)) -> None:
        super().__init__()
        self.quant = QuantStub(scale=None)
        self.shared_conv = conv_bn_relu(c)
        self.task_heads = nn.ModuleList(SepHead(c, {**HEADS, "heatmap": (n, 2)}) for n in tasks)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        x = self.shared_conv(self.quant(x))
        return [{k: self.dequant(v) for k, v in task(x).items()} for task in self.task_heads]

    def set_qconfig(self, qconfig: object, out_qconfig: object) -> None:
        self.qconfig = qconfig
        for task in self.task_heads:
            task.set_qconfig(out_qconfig)


def _head(seed: int = 0) -> CenterHead:
    torch.manual_seed(seed)
    head = CenterHead()
    for m in head.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return head.eval()


def _bev() -> tuple[torch.Tensor]:
    return (torch.randn(2, 16, 12, 12),)


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def _calibrated_then_qat() -> nn.Module:
    """The toolkit's two stages: calibration with qconfig attributes, then QAT from its checkpoint."""
    float_model = _head()
    float_model.set_qconfig(get_default_calib_qconfig(), default_calib_8bit_weight_32bit_out_fake_quant_qconfig)
    calib = prepare_qat_fx(float_model)
    calib.eval()
    with torch.no_grad():
        for _ in range(3):
            calib(*_bev())
    fresh = _head(seed=1)  # another run: only the checkpoint carries the weights and scales
    fresh.set_qconfig(get_default_qat_qconfig(), get_default_qat_out_qconfig())
    qat = prepare_qat_fx(fresh)
    qat.load_state_dict(calib.state_dict(), strict=True)
    return qat


def test_set_qconfig_attributes_reach_every_sub_head() -> None:
    qat = _calibrated_then_qat()
    for t in (0, 1):
        for name in (*HEADS, "heatmap"):
            last = qat.get_submodule(f"task_heads.{t}.{name}.1")
            assert last.activation_post_process is None  # high-precision output
            assert qat.get_submodule(f"task_heads.{t}.{name}.0.0").activation_post_process is not None


def test_dict_outputs_train_convert_compile_and_survive_the_artifact(tmp_path: Path) -> None:
    qat = _calibrated_then_qat()
    qat.train()
    opt = torch.optim.SGD([p for p in qat.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(2):
        loss = sum(v.square().mean() for task in qat(*_bev()) for v in task.values())
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    qat.eval()
    set_fake_quantize(qat, "validation")
    converted = convert_fx(qat)
    inputs = _bev()
    result = finish(qat, converted, inputs)  # check, compile, the program equals the converted model
    assert [list(task) for task in result.integer_out] == [[*HEADS, "heatmap"]] * 2
    # qint32 outputs at the accumulator's own scale: the integer model computes what validation QAT does
    assert result.max_error() <= 1e-5
    compiled = qir.quantization.compile_model(converted, list(inputs), hbm=tmp_path / "center.hbm")
    loaded = qir.load_compiled(tmp_path / "center.hbm")
    for program in (compiled, loaded):
        out = program(*inputs)
        assert isinstance(out, list) and all(isinstance(task, dict) for task in out)
        for got, want in zip(out, result.integer_out, strict=True):
            assert list(got) == list(want)  # the keys in the model's order
            for k in want:
                assert torch.equal(got[k], want[k])
