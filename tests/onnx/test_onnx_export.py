"""export_to_onnx: float and hand-built QAT models, checked with onnx's checker and onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from onnx_testing import HandQatConv, conv_input, load, q_params, quantize_nodes, run_ort, ties

from qir.quantization import FakeQuantize
from qir.utils.onnx_helper import export_to_onnx


class ConvBNReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


def test_float_conv_bn_relu_matches_torch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ConvBNReLU()
    model(torch.randn(4, 3, 8, 8) * 3)  # non-trivial running statistics
    model.eval()
    x = torch.randn(2, 3, 8, 8)
    path = tmp_path / "float.onnx"
    export_to_onnx(model, x, path, enable_onnx_checker=True, operator_export_type=None)
    (got,) = run_ort(path, x)
    np.testing.assert_allclose(got, model(x).detach().numpy(), rtol=0, atol=1e-5)
    assert not quantize_nodes(load(path))


@pytest.fixture(scope="module")
def qat_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[HandQatConv, Path, dict[str, object]]:
    model = HandQatConv()
    model.train()  # export must switch a copy to eval and leave this flag alone
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path_factory.mktemp("qat") / "qat.onnx"
    export_to_onnx(model, (conv_input(),), path, enable_onnx_checker=True, operator_export_type=None)
    return model, path, before


def test_qat_graph_holds_the_fake_quant_scales(qat_export: tuple[HandQatConv, Path, dict[str, object]]) -> None:
    model, path, _ = qat_export
    params = q_params(load(path))
    assert len(params) == 4  # input, weight, int8 output, int16 output
    for (scale, zp, axis), fq in zip(params, model.fake_quants(), strict=True):
        np.testing.assert_array_equal(scale.reshape(-1), fq.scale.numpy())
        assert zp.dtype == (np.int16 if fq is model.out16_fq else np.int8) and not zp.any()
        assert scale.ndim == (0 if fq.ch_axis is None else 1)
        if fq.ch_axis is not None:
            assert axis == fq.ch_axis


def test_qat_onnxruntime_equals_qir_away_from_ties(qat_export: tuple[HandQatConv, Path, dict[str, object]]) -> None:
    _, path, _ = qat_export
    x = conv_input()
    ref = HandQatConv().eval()
    with torch.no_grad():
        assert not ties(x, ref.input_fq.scale).any()
        assert not ties(ref.conv.weight, ref.weight_fq.scale, axis=0).any()
        y = ref.conv_out(x)
        assert not ties(y, ref.out8_fq.scale).any() and not ties(y, ref.out16_fq.scale).any()
        want = [t.numpy() for t in ref(x)]
    got = run_ort(path, x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
        assert len(np.unique(w)) > 20  # a real spread of codes, not a saturated output


def test_export_does_not_mutate_the_model(qat_export: tuple[HandQatConv, Path, dict[str, object]]) -> None:
    model, _, before = qat_export
    assert model.training and all(m.training for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert isinstance(v, torch.Tensor)
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), k
    for fq in model.fake_quants():
        assert type(fq) is FakeQuantize and fq.fake_quant_enabled and not fq.observer_enabled


def test_unsupported_arguments_are_refused(tmp_path: Path) -> None:
    from torch.onnx import OperatorExportTypes, TrainingMode

    model = HandQatConv()
    x = conv_input()
    with pytest.raises(ValueError, match="int16"):
        export_to_onnx(model, x, tmp_path / "a.onnx", opset_version=20)
    with pytest.raises(NotImplementedError, match="operator_export_type"):
        export_to_onnx(model, x, tmp_path / "a.onnx", operator_export_type=OperatorExportTypes.ONNX_ATEN)
    with pytest.raises(NotImplementedError, match="eval mode"):
        export_to_onnx(model, x, tmp_path / "a.onnx", training=TrainingMode.TRAINING)
    with pytest.raises(NotImplementedError, match="custom_opsets"):
        export_to_onnx(model, x, tmp_path / "a.onnx", custom_opsets={"horizon": 1})
    with pytest.raises(ValueError, match="opset_version 9"):
        export_to_onnx(model, x, tmp_path / "a.onnx", opset_version=9)
    assert not (tmp_path / "a.onnx").exists()
