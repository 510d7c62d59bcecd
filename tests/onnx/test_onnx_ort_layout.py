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
from qir.quantization import FakeQuantize, convert_fx, prepare_qat_fx, set_fake_quantize
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


class ReLU6Chain(nn.Module):
    """conv-relu6, depthwise conv-relu6, conv (mobilenet_v2's layers), bias-free so every rewrite is exact."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False),
            nn.ReLU6(),
            nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False),
            nn.ReLU6(),
            nn.Conv2d(16, 8, 1, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.body(self.quant(x)))


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


@pytest.mark.parametrize("net", ["relu_maxpool", "relu6_depthwise"])
def test_exact_rewrites_compute_what_the_default_layout_computes(net: str, tmp_path: Path) -> None:
    """No bias, no residual: every rewrite is exact, so both layouts agree bit for bit as written."""
    torch.manual_seed(1)
    x = torch.randn(8, 3, 16, 16) * 4  # wide enough that ReLU6 clips
    float_model = ResNetLet(bias=False, residual=False) if net == "relu_maxpool" else ReLU6Chain()
    model = _prepared(float_model, x)
    if net == "relu6_depthwise":
        # coarser activation scales put Q(6) below 127 codes, so the integer ceilings are not just 127
        for m in model.modules():
            if isinstance(m, FakeQuantize) and m.ch_axis is None:
                m.scale.mul_(2)
    export_to_onnx(model, (x,), tmp_path / "ort.onnx", qdq_layout="onnxruntime")
    export_to_onnx(model, (x,), tmp_path / "fq.onnx")
    ops = collections.Counter(n.op_type for n in load(tmp_path / "ort.onnx").graph.node)
    if net == "relu_maxpool":
        assert ops["Clip"] == 3 and ops["MaxPool"] == 1  # the ReLU ceilings and the pool on codes are there
    else:
        graph = load(tmp_path / "ort.onnx")
        clips = [n for n in graph.graph.node if n.op_type == "Clip"]
        assert len(clips) == 2 and all(initializer(graph, c.input[1]).dtype == np.uint8 for c in clips)
        producers = {o: n for n in graph.graph.node for o in n.output}
        for clip in clips:  # the ceiling is Q(6) at the ReLU6 output's scale, below the int8 ceiling
            scale = initializer(graph, producers[clip.input[0]].input[1])
            ceiling = int(initializer(graph, clip.input[2]))
            assert ceiling == round(float(np.float32(6) / scale)) < 127
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


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("other_signed", [True, False])
def test_intermediate_scale_clipping_never_changes_the_output(relu: bool, other_signed: bool) -> None:
    """At the fused conv + add's intermediate scale, cutting the conv's code to int8 changes no output code."""
    from qir.utils.onnx.ort_layout import _intermediate_scale

    rng = np.random.default_rng(0)
    lo, hi = (-128, 127) if other_signed else (0, 127)  # a post-ReLU operand has codes 0..127

    def out_codes(v: np.ndarray, s_out: float) -> np.ndarray:
        return np.clip(np.round((np.maximum(v, 0) if relu else v) / s_out), -128, 127)

    for _ in range(50):
        s_out, s_o = rng.uniform(0.01, 1.0, 2)
        s_mid = float(_intermediate_scale(s_out, lo * s_o, hi * s_o, relu))
        c = rng.uniform(-400, 400, 20_000) * s_mid  # far past the int8 range
        o = rng.integers(lo, hi + 1, c.shape) * s_o
        rounded = np.round(c / s_mid)
        assert (np.abs(rounded) > 128).any()
        clipped = np.clip(rounded, -128, 127)
        np.testing.assert_array_equal(out_codes(clipped * s_mid + o, s_out), out_codes(rounded * s_mid + o, s_out))
    # a post-ReLU operand under a ReLU needs no more than the larger of the two scales (plus a hair)
    assert _intermediate_scale(0.5, 0.0, 127 * 0.25, True) <= 0.5 * (1 + 2.0**-15)


def test_older_opset_still_fuses(residual: tuple[nn.Module, torch.Tensor, Path, Path], tmp_path: Path) -> None:
    """The ops the layout adds (uint8 Clip, int32 DequantizeLinear, per-axis Q/DQ) exist below opset 18,
    where torch's exporter converts down (17: the lowest it converts this model to)."""
    model, x, _, _ = residual
    path = tmp_path / "opset17.onnx"
    export_to_onnx(model, (x,), path, input_names=["x"], qdq_layout="onnxruntime", opset_version=17)
    assert next(o.version for o in load(path).opset_import if o.domain in ("", "ai.onnx")) == 17
    ops = _optimized_ops(path, tmp_path)
    assert ops["QLinearConv"] == 3 and ops["QLinearAdd"] == 1, ops
