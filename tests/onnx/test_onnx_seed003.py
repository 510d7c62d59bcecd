"""Seed 003: a QAT model from prepare_qat_fx exported exactly as the seed calls export_to_onnx."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from onnx_testing import load, q_params, run_ort
from torch import nn
from torch.quantization import DeQuantStub, QuantStub

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from qir.march import March, set_march
from qir.quantization import (
    FakeQuantize,
    disable_observer,
    float_fake_quant,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
)
from qir.utils.onnx_helper import export_to_onnx


class ConvBNReLU(nn.Sequential):
    def __init__(self, channels: int = 3) -> None:
        super().__init__(nn.Conv2d(channels, channels, 1), nn.BatchNorm2d(channels), nn.ReLU())


class ConvBNAddReLU(nn.Sequential):
    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.add = torch.nn.quantized.FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        out = self.bn(out)
        return self.relu(self.add.add(x, out))


class ConvAddReLU(nn.Sequential):
    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)
        self.relu = nn.ReLU()
        self.add = torch.nn.quantized.FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        return self.relu(self.add.add(x, out))


class ConvReLU(nn.Sequential):
    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)
        self.relu = torch.nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv(x))


class _SeluModule(nn.Module):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.selu(input)


class HybridModel(nn.Module):
    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.layer0 = ConvBNReLU()
        self.layer1 = ConvReLU()  # the seed writes ConvBNReLU() but names layer1.conv: its ConvReLU is meant
        self.layer2 = ConvBNReLU()
        self.selu = _SeluModule()
        self.conv0 = nn.Conv2d(channels, channels, 1)
        self.conv1 = nn.Conv2d(channels, channels, 1)
        self.dequant = DeQuantStub()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self.selu(input)  # the seed's text reads an undefined x here
        x = self.layer0(x)
        x = self.selu(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.conv0(x)
        x = self.conv1(x)
        x = self.selu(x)
        return self.dequant(x)


class NonHybridModel(nn.Module):
    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.layer0 = ConvBNReLU()
        self.layer1 = ConvAddReLU()
        self.layer2 = ConvBNAddReLU()
        self.conv1 = nn.Conv2d(channels, channels, 1)
        self.dequant = DeQuantStub()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self.quant(input)
        x = self.layer0(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.conv1(x)
        return self.dequant(x)


DATA_SHAPE = [1, 3, 224, 224]


def seed_qat_model(model: nn.Module, **hybrid: Any) -> nn.Module:
    """Steps 2-4 of the seed: march, calibration, QAT model with a high-precision conv1."""
    set_march(March.BAYES)
    calibration_model = prepare_qat_fx(model, {"": get_default_calib_qconfig()}, **hybrid)
    calibration_model.eval()
    for _ in range(5):
        calibration_model(torch.rand(size=DATA_SHAPE))
    return prepare_qat_fx(
        calibration_model,
        {"": get_default_qat_qconfig(), "module_name": [("conv1", get_default_qat_out_qconfig())]},
        **hybrid,
    )


def check_seed_export(qat_model: nn.Module, data: torch.Tensor, path: Path) -> None:
    """The QuantizeLinear nodes are the model's enabled fake quants, with their scales; onnxruntime agrees."""
    fqs = [m for m in qat_model.modules() if isinstance(m, FakeQuantize) and m.fake_quant_enabled]
    params = q_params(load(path))
    assert len(params) == len(fqs) > 0
    # every fake quant's scale appears on a QuantizeLinear, per channel with its axis
    onnx_scales = sorted((tuple(s.reshape(-1).tolist()), axis if s.ndim else None) for s, _, axis in params)
    model_scales = sorted((tuple(fq.scale.tolist()), fq.ch_axis) for fq in fqs)
    assert onnx_scales == model_scales
    assert all(zp.dtype == np.int8 and not zp.any() for _, zp, _ in params)
    (got,) = run_ort(path, data)
    with torch.no_grad(), float_fake_quant():  # the export is the float fake-quant graph, not the integer grid
        want = qat_model(data).numpy()
    # Weights match exactly (exported pre-rounded); an activation tie, or a conv sum that lands on
    # the other side of a rounding boundary in onnxruntime's summation order, moves one code at a
    # few points per layer, and the 1x1 convs keep that local.
    close = np.abs(got - want) <= 1e-5
    assert close.mean() > 0.999
    assert np.abs(got - want).max() < 0.05


def test_seed003_non_hybrid_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    monkeypatch.chdir(tmp_path)  # the seed writes "qat.onnx" into the working directory
    data = torch.rand(size=DATA_SHAPE)
    qat_model = seed_qat_model(NonHybridModel())
    qat_model(data)
    qat_model.eval()
    disable_observer(qat_model)  # fake quants observe in eval mode too; freeze scales for the comparison
    scales = {k: v.clone() for k, v in qat_model.state_dict().items()}

    export_to_onnx(qat_model, data, "qat.onnx", enable_onnx_checker=True, operator_export_type=None)

    assert all(torch.equal(v, qat_model.state_dict()[k]) for k, v in scales.items())  # nothing observed or rounded
    check_seed_export(qat_model, data, tmp_path / "qat.onnx")


def test_seed003_hybrid_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    monkeypatch.chdir(tmp_path)
    data = torch.rand(size=DATA_SHAPE)
    hybrid = {
        "hybrid": True,
        "hybrid_dict": {"module_name": ["layer1.conv", "conv0"], "module_type": [_SeluModule]},
    }
    qat_model = seed_qat_model(HybridModel(), **hybrid)
    qat_model(data)
    qat_model.eval()
    disable_observer(qat_model)

    export_to_onnx(qat_model, data, "qat.onnx", enable_onnx_checker=True, operator_export_type=None)

    check_seed_export(qat_model, data, tmp_path / "qat.onnx")
    # Q/DQ around the BPU parts only: the CPU convs (layer1.conv, conv0) keep float weights; the three
    # selu calls read the float input, layer0's dequantized output and conv1's high-precision output
    graph = load(tmp_path / "qat.onnx").graph
    producer = {o: n.op_type for n in graph.node for o in n.output}
    convs = [n for n in graph.node if n.op_type == "Conv"]
    assert [producer.get(n.input[1], "float") for n in convs] == [
        "DequantizeLinear",
        "float",
        "DequantizeLinear",
        "float",
        "DequantizeLinear",
    ]
    selus = [n for n in graph.node if n.op_type == "Selu"]
    assert [producer.get(n.input[0], "input") for n in selus] == ["input", "DequantizeLinear", "Conv"]


@pytest.mark.parametrize("hybrid", [False, True])
def test_seed003_onnxruntime_layout_loads_fuses_and_agrees(hybrid: bool, tmp_path: Path) -> None:
    """The onnxruntime layout on the seed's models: CPU ops, a high-precision output, FloatFunctional adds."""
    import onnxruntime as ort

    torch.manual_seed(0)
    data = torch.rand(size=DATA_SHAPE)
    extra: dict[str, Any] = {}
    if hybrid:
        extra = {"hybrid": True, "hybrid_dict": {"module_name": ["layer1.conv", "conv0"], "module_type": [_SeluModule]}}
    qat_model = seed_qat_model(HybridModel() if hybrid else NonHybridModel(), **extra)
    qat_model(data)
    qat_model.eval()
    disable_observer(qat_model)
    path = tmp_path / "qat.onnx"
    export_to_onnx(qat_model, data, path, qdq_layout="onnxruntime")
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {sess.get_inputs()[0].name: data.numpy()})
    ops = [n.op_type for n in load(tmp_path / "optimized.onnx").graph.node]
    # the BPU convs with a quantized output fuse; the CPU convs and the high-precision conv1 stay float
    assert ops.count("QLinearConv") == (2 if hybrid else 3) and ops.count("QLinearAdd") == (0 if hybrid else 2)
    with torch.no_grad():
        want = qat_model(data).numpy()
    # measured: 0.3% (hybrid) and 1.0% (the fused conv + adds' extra rounding) of the output's range
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()
