"""``qdq_layout="onnxruntime"``: the export onnxruntime fuses into QLinearConv / QLinearAdd.

The default layout (one Q/DQ pair per fake quant) leaves onnxruntime with float convs between
Q/DQ pairs. The onnxruntime layout must (a) be what onnxruntime's optimizer turns into integer
kernels, (b) compute what the default layout computes wherever its rewrites are exact, and
(c) stay close to qir's converted integer model where they are not (a fused conv + add).
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.quantization import DeQuantStub, QuantStub

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from onnx_testing import initializer, load, run_ort

from qir.march import March, march_scope
from qir.qconfig import get_default_qat_qconfig
from qir.quantization import convert_fx, prepare_qat_fx, set_fake_quantize
from qir.utils.onnx_helper import export_to_onnx


class ResNetLet(nn.Module):
    """conv-bn-relu, max pool, a residual block (conv-bn-relu, conv-bn + add + relu), flatten, linear."""

    def __init__(self, bias: bool = True, residual: bool = True) -> None:
        super().__init__()
        self.residual = residual
        self.quant = QuantStub()
        self.conv0 = nn.Conv2d(3, 16, 3, padding=1, bias=bias)
        self.relu0 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv1 = nn.Conv2d(16, 16, 3, padding=1, bias=bias)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, bias=bias)
        self.relu2 = nn.ReLU()
        self.fc = nn.Linear(16 * 8 * 8, 10, bias=bias)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(self.relu0(self.conv0(self.quant(x))))
        z = self.conv2(self.relu1(self.conv1(y)))
        z = self.relu2(z + y if self.residual else z)
        return self.dequant(self.fc(torch.flatten(z, 1)))


def _prepared(model: nn.Module, x: torch.Tensor) -> nn.Module:
    with march_scope(March.BAYES):
        prepared = prepare_qat_fx(model, {"": get_default_qat_qconfig()})
        prepared.train()
        for _ in range(4):
            prepared(x)
        set_fake_quantize(prepared, "validation")
        prepared.eval()
    return prepared


@pytest.fixture(scope="module")
def residual(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, torch.Tensor, Path, Path]:
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16)
    model = _prepared(ResNetLet(), x)
    tmp = tmp_path_factory.mktemp("ort_layout")
    export_to_onnx(model, (x,), tmp / "ort.onnx", input_names=["x"], qdq_layout="onnxruntime")
    export_to_onnx(model, (x,), tmp / "fq.onnx", input_names=["x"])
    return model, x, tmp / "ort.onnx", tmp / "fq.onnx"


def _optimized_ops(path: Path, tmp: Path) -> collections.Counter[str]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    # the QDQ fusions are "extended" optimizations; layout (NCHWc) changes come only above that
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp / f"{path.stem}.optimized.onnx")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in load(so.optimized_model_filepath).graph.node)


def test_onnxruntime_fuses_every_conv_and_the_add(
    residual: tuple[nn.Module, torch.Tensor, Path, Path], tmp_path: Path
) -> None:
    _, _, ort_path, fq_path = residual
    ops = _optimized_ops(ort_path, tmp_path)
    assert ops["QLinearConv"] == 3 and ops["QLinearAdd"] == 1, ops
    assert not ops["Conv"] and not ops["FusedConv"] and not ops["Add"], ops
    before = _optimized_ops(fq_path, tmp_path)  # the default layout: float convs between Q/DQ
    assert not before["QLinearConv"] and before["FusedConv"] + before["Conv"] == 3, before


def test_weights_and_biases_are_integer_initializers(residual: tuple[nn.Module, torch.Tensor, Path, Path]) -> None:
    model, _, ort_path, _ = residual
    graph = load(ort_path)
    producers = {o: n for n in graph.graph.node for o in n.output}
    assert not [
        n
        for n in graph.graph.node
        if n.op_type == "QuantizeLinear" and n.input[0] in {t.name for t in graph.graph.initializer}
    ]
    convs = [n for n in graph.graph.node if n.op_type == "Conv"]
    for conv in convs:
        dq_x, dq_w, dq_b = (producers[i] for i in conv.input)
        w = initializer(graph, dq_w.input[0])
        assert w.dtype == np.int8 and w.ndim == 4
        s_w = initializer(graph, dq_w.input[1])
        assert s_w.shape == (w.shape[0],) and next(a.i for a in dq_w.attribute if a.name == "axis") == 0
        b, s_b = initializer(graph, dq_b.input[0]), initializer(graph, dq_b.input[1])
        s_x = initializer(graph, dq_x.input[1])
        assert b.dtype == np.int32
        np.testing.assert_allclose(s_b, (np.float64(s_x) * s_w.astype(np.float64)).astype(np.float32), rtol=0)
    # qir's integer bias: round half up of b / (s_in * s_w) in float64
    conv0 = convs[0]
    dq_x, dq_w, dq_b = (producers[i] for i in conv0.input)
    s_acc = np.float64(initializer(graph, dq_x.input[1])) * initializer(graph, dq_w.input[1]).astype(np.float64)
    float_bias = model.conv0.bias.detach().double().numpy()
    np.testing.assert_array_equal(initializer(graph, dq_b.input[0]), np.floor(float_bias / s_acc + 0.5))


def test_exact_rewrites_compute_what_the_default_layout_computes(tmp_path: Path) -> None:
    """No bias, no residual: every rewrite is exact, so both layouts agree bit for bit as written."""
    torch.manual_seed(1)
    x = torch.randn(8, 3, 16, 16)
    model = _prepared(ResNetLet(bias=False, residual=False), x)
    export_to_onnx(model, (x,), tmp_path / "ort.onnx", qdq_layout="onnxruntime")
    export_to_onnx(model, (x,), tmp_path / "fq.onnx")
    ops = collections.Counter(n.op_type for n in load(tmp_path / "ort.onnx").graph.node)
    assert ops["Clip"] == 3 and ops["MaxPool"] == 1  # the ReLU ceilings and the pool on codes are there
    (got,), (want,) = run_ort(tmp_path / "ort.onnx", x), run_ort(tmp_path / "fq.onnx", x)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(want)) > 20
    optimized = _optimized_ops(tmp_path / "ort.onnx", tmp_path)
    assert optimized["QLinearConv"] == 3 and not optimized["Conv"] and not optimized["FusedConv"], optimized


def _ort_optimized(path: Path, x: torch.Tensor) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]


def test_onnxruntime_integer_kernels_stay_close_to_qir_integer_model(
    residual: tuple[nn.Module, torch.Tensor, Path, Path],
) -> None:
    model, x, ort_path, _ = residual
    with march_scope(March.BAYES):
        want = convert_fx(model)(x).detach().numpy()
    got = _ort_optimized(ort_path, x)
    step = float(model.fc.activation_post_process.scale)
    lsb = np.abs(got - want) / step
    # measured: max 3 LSB of the output; the fused conv + add's extra rounding is the cause
    assert lsb.max() <= 4 + 1e-3
    assert (got.argmax(1) == want.argmax(1)).all()


def test_unknown_layout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"qdq_layout='qlinear'.*'fake_quant', 'onnxruntime'"):
        export_to_onnx(nn.Conv2d(1, 1, 1), torch.zeros(1, 1, 2, 2), tmp_path / "a.onnx", qdq_layout="qlinear")
    assert not (tmp_path / "a.onnx").exists()
