"""The export loads and runs in onnxruntime with its default graph optimizations.

onnxruntime rewrites Q/DQ graphs when it loads them (QDQ propagation across Reshape/Transpose,
fusion into integer kernels); the other ONNX tests switch that off to compare exact values. Here
a prepared QAT model with an average pool and a flatten (a Reshape after a DequantizeLinear,
which onnxruntime 1.31 fails to load when the DequantizeLinear has an int8 zero point) must load
at every supported opset and agree with qir within onnxruntime's integer requantization.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.quantization import DeQuantStub, QuantStub

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from onnx_testing import load, q_params, quantize_nodes

from qir.march import March, march_scope
from qir.qconfig import get_default_qat_qconfig
from qir.quantization import prepare_qat_fx, set_fake_quantize
from qir.utils.onnx_helper import export_to_onnx


class ConvFlattenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(1, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.relu = nn.ReLU()
        self.pool = nn.AvgPool2d(2)
        self.fc = nn.Linear(6 * 4 * 4, 10)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(self.relu(self.bn(self.conv(self.quant(x)))))
        return self.dequant(self.fc(y.view(y.shape[0], -1)))


@pytest.fixture(scope="module")
def qat_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(16, 1, 8, 8)
    with march_scope(March.BAYES):
        model = prepare_qat_fx(ConvFlattenLinear(), {"": get_default_qat_qconfig()})
    model.train()
    for _ in range(4):
        model(x)
    set_fake_quantize(model, "validation")
    model.eval()
    return model, x


def _session(path: Path) -> object:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("opset", [21, 17])
def test_loads_with_default_optimizations_and_agrees(
    qat_model: tuple[nn.Module, torch.Tensor], opset: int, tmp_path: Path
) -> None:
    model, x = qat_model
    path = tmp_path / f"m{opset}.onnx"
    export_to_onnx(model, (x,), path, input_names=["x"], opset_version=opset)
    sess = _session(path)  # raised "output_dtype INT8 does not match y_zero_point type UINT8" at 21
    (got,) = sess.run(None, {"x": x.numpy()})  # type: ignore[attr-defined]
    want = model(x).detach().numpy()
    # onnxruntime computes the conv and linear in integers with its own requantization, so codes
    # may differ by one here and there; a few output steps bound that.
    step = float(model.fc.activation_post_process.scale)
    assert np.abs(got - want).max() <= 4 * step + 1e-6
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.9


@pytest.mark.parametrize("opset", [21, 17])
def test_only_the_quantize_carries_the_zero_point(
    qat_model: tuple[nn.Module, torch.Tensor], opset: int, tmp_path: Path
) -> None:
    model, x = qat_model
    path = tmp_path / f"m{opset}.onnx"
    export_to_onnx(model, (x,), path, opset_version=opset)
    graph = load(path)
    nodes = quantize_nodes(graph)
    assert nodes
    for _, zp, _ in q_params(graph):  # the zero point names the type: int8 here, always 0
        assert zp.dtype == np.int8 and not zp.any()
    dq = [n for n in graph.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) >= len(nodes) and all(len(n.input) == 2 for n in dq), "a DequantizeLinear has a zero point"


class _Selu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.selu(x)


class HybridNet(nn.Module):
    """BPU conv -> CPU selu -> BPU conv -> flatten -> linear; no stubs (hybrid generates them)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(1, 4, 3, padding=1)
        self.selu = _Selu()
        self.conv1 = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(self.selu(self.conv0(x)))
        return self.fc(torch.flatten(y, 1))


def test_hybrid_export_loads_with_default_optimizations(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 1, 8, 8)
    with march_scope(March.BAYES):
        model = prepare_qat_fx(
            HybridNet(), {"": get_default_qat_qconfig()}, hybrid=True, hybrid_dict={"module_type": [_Selu]}
        )
    model.train()
    model(x)
    set_fake_quantize(model, "validation")
    model.eval()
    path = tmp_path / "hybrid.onnx"
    export_to_onnx(model, (x,), path, input_names=["x"])
    graph = load(path)
    assert any(n.op_type == "Selu" for n in graph.graph.node)  # the CPU op stays float
    (got,) = _session(path).run(None, {"x": x.numpy()})  # type: ignore[attr-defined]
    want = model(x).detach().numpy()
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.9
    assert np.abs(got - want).max() <= 0.1 * np.abs(want).max()
