"""Seed 003's fx flows (calibration, then QAT with a high-precision last conv), run with qir.

Changes from the seed: ``horizon_plugin_pytorch`` -> ``qir``. ``export_to_onnx`` runs when
``qir.utils.onnx_helper`` exists and ``check_model`` / ``compile_model`` when they exist.
The hybrid variant (section 2.2) runs as the seed writes it, with two slips fixed (see
:func:`test_seed_003_hybrid`).
"""

# The seeds' code is kept as the seeds wrote it (only imports changed), old idioms included.
# ruff: noqa: UP008, B007

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest


def test_seed_003_non_hybrid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    import torch
    from torch import nn
    from torch.quantization import DeQuantStub, QuantStub

    import qir.quantization as qq
    from qir.march import March, set_march
    from qir.quantization import (
        convert_fx,
        get_default_calib_qconfig,
        get_default_qat_out_qconfig,
        get_default_qat_qconfig,
        prepare_qat_fx,
    )

    # 1.浮点模型准备
    class ConvBNReLU(nn.Sequential):
        def __init__(self, channels=3):
            super(ConvBNReLU, self).__init__(
                nn.Conv2d(channels, channels, 1),
                nn.BatchNorm2d(channels),
                nn.ReLU(),
            )

    class ConvBNAddReLU(nn.Sequential):
        def __init__(self, channels=3):
            super(ConvBNAddReLU, self).__init__()
            self.conv = nn.Conv2d(channels, channels, 1)
            self.bn = nn.BatchNorm2d(channels)
            self.relu = nn.ReLU()
            self.add = torch.nn.quantized.FloatFunctional()

        def forward(self, x):
            out = self.conv(x)
            out = self.bn(out)
            return self.relu(self.add.add(x, out))

    class ConvAddReLU(nn.Sequential):
        def __init__(self, channels=3):
            super(ConvAddReLU, self).__init__()
            self.conv = nn.Conv2d(channels, channels, 1)
            self.relu = nn.ReLU()
            self.add = torch.nn.quantized.FloatFunctional()

        def forward(self, x):
            out = self.conv(x)
            return self.relu(self.add.add(x, out))

    class NonHybridModel(nn.Module):
        def __init__(self, channels=3):
            super().__init__()
            # 插入 QuantStub
            self.quant = QuantStub()
            self.layer0 = ConvBNReLU()
            self.layer1 = ConvAddReLU()
            self.layer2 = ConvBNAddReLU()
            self.conv1 = nn.Conv2d(channels, channels, 1)
            # 插入 DequantStub
            self.dequant = DeQuantStub()

        def forward(self, input):
            x = self.quant(input)
            x = self.layer0(x)
            x = self.layer1(x)
            x = self.layer2(x)
            x = self.conv1(x)
            return self.dequant(x)

    torch.manual_seed(0)  # the harness fixes the seed; the seed's own lines follow unchanged
    data_shape = [1, 3, 224, 224]
    data = torch.rand(size=data_shape)
    model = NonHybridModel()
    float_res = model(data)
    # 2.设置 march
    set_march(March.BAYES)
    # 3.校准(推荐默认使用)
    calibration_model = prepare_qat_fx(
        model,
        {
            "": get_default_calib_qconfig(),
        },
    )
    calibration_model.eval()
    for i in range(5):
        calibration_model(torch.rand(size=data_shape))
    # 4.模型量化
    qat_model = prepare_qat_fx(
        calibration_model,
        {
            "": get_default_qat_qconfig(),
            # 设置最后一个conv高精度输出
            "module_name": [("conv1", get_default_qat_out_qconfig())],
        },
    )
    qat_res = qat_model(data)
    # 5.量化训练&精度验证
    # 6.评测定点精度
    quantize_model = convert_fx(qat_model)
    quantize_res = quantize_model(data)

    # what the flow must show
    assert float_res.shape == qat_res.shape == quantize_res.shape
    assert qat_model.get_submodule("conv1").activation_post_process is None  # high-precision output
    assert quantize_model.get_submodule("conv1").dtype.name == "qint32"
    qat_model.eval()
    qq.set_fake_quantize(qat_model, "validation")  # no more observing: the scales convert_fx used
    qat_eval = qat_model(data)
    assert (quantize_res - qat_eval).abs().max() <= 0.02 * qat_eval.abs().max()
    # the input model was not touched by either prepare
    assert isinstance(model.layer0[1], nn.BatchNorm2d) and isinstance(
        model.layer2.add, torch.nn.quantized.FloatFunctional
    )

    # 7.模型编译
    if importlib.util.find_spec("qir.utils.onnx_helper") is not None:
        export_to_onnx = importlib.import_module("qir.utils.onnx_helper").export_to_onnx
        export_to_onnx(qat_model, data, "qat.onnx", enable_onnx_checker=True, operator_export_type=None)
        assert (tmp_path / "qat.onnx").exists()
    traced_model = torch.jit.trace(quantize_model, data)
    assert torch.equal(traced_model(data), quantize_res)
    if hasattr(qq, "check_model"):
        qq.check_model(quantize_model, data, advice=1)
    if hasattr(qq, "compile_model"):
        (tmp_path / "model_output").mkdir()
        qq.compile_model(traced_model, [data], opt=3, hbm="./model_output/model.hbm")


def test_seed_003_hybrid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed 003's hybrid flow as the seed writes it, with its two slips fixed: ``forward`` starts
    with ``self.selu(input)`` (the seed reads an undefined ``x``), and layer1 is the seed's
    ``ConvReLU`` (its children ``conv`` / ``relu`` are what ``hybrid_dict`` names)."""
    monkeypatch.chdir(tmp_path)
    import numpy as np  # noqa: F401  (the seed imports it)
    import torch
    from torch import nn
    from torch.quantization import DeQuantStub, QuantStub  # noqa: F401

    import qir.quantization as qq
    from qir.march import March, set_march
    from qir.nn import qat  # noqa: F401
    from qir.quantization import (
        convert_fx,
        get_default_calib_qconfig,
        get_default_qat_out_qconfig,
        get_default_qat_qconfig,
        prepare_qat_fx,
    )

    class ConvBNReLU(nn.Sequential):
        def __init__(self, channels=3):
            super(ConvBNReLU, self).__init__(
                nn.Conv2d(channels, channels, 1),
                nn.BatchNorm2d(channels),
                nn.ReLU(),
            )

    # 1.浮点模型准备
    class ConvReLU(nn.Sequential):
        def __init__(self, channels=3):
            super().__init__()
            self.conv = nn.Conv2d(channels, channels, 1)
            self.relu = torch.nn.ReLU()

        def forward(self, x):
            x = self.conv(x)
            x = self.relu(x)
            return x

    # 封装 functional selu 为 module,便于单独设置
    class _SeluModule(nn.Module):
        def forward(self, input):
            return torch.nn.functional.selu(input)

    class HybridModel(nn.Module):
        def __init__(self, channels=3, layer1=ConvReLU):
            super().__init__()
            # 第一层为cpu节点
            # self.quant = QuantStub()
            self.layer0 = ConvBNReLU()
            self.layer1 = layer1()  # the seed writes ConvBNReLU() (see test_seed_003_hybrid_literal_layer1)
            self.layer2 = ConvBNReLU()
            self.selu = _SeluModule()
            self.conv0 = nn.Conv2d(channels, channels, 1)
            self.conv1 = nn.Conv2d(channels, channels, 1)
            # 插入 DequantStub
            self.dequant = DeQuantStub()

        def forward(self, input):
            x = self.selu(input)  # the seed writes self.selu(x)
            x = self.layer0(x)
            x = self.selu(x)
            x = self.layer1(x)
            x = self.layer2(x)
            x = self.conv0(x)
            x = self.conv1(x)
            x = self.selu(x)
            return self.dequant(x)

    data_shape = [1, 3, 224, 224]
    data = torch.rand(size=data_shape)
    model = HybridModel()
    # float 模型的推理不要放在 prepare_qat_fx 之后,prepare_qat_fx 会对 float 模型做 inplace 修改
    float_res = model(data)
    # 2.设置 march
    set_march(March.BAYES)
    # 3.校准(推荐默认使用)
    calibration_model = prepare_qat_fx(
        model,
        {
            "": get_default_calib_qconfig(),
        },
        hybrid=True,
        hybrid_dict={
            "module_name": ["layer1.conv", "conv0"],
            "module_type": [_SeluModule],
        },
    )
    # calibration 阶段需确保原有模型不会发生变化
    calibration_model.eval()
    for i in range(5):
        calibration_model(torch.rand(size=data_shape))
    # 4.模型量化
    qat_model = prepare_qat_fx(
        calibration_model,
        {
            "": get_default_qat_qconfig(),
            # 设置最后一个conv高精度输出
            "module_name": [("conv1", get_default_qat_out_qconfig())],
        },
        hybrid=True,
        hybrid_dict={
            "module_name": ["layer1.conv", "conv0"],
            "module_type": [_SeluModule],
        },
    )
    # qat 模型的推理不要放在 convert_fx 之后,convert_fx 会对 qat 模型做 inplace 修改
    qat_res = qat_model(data)
    # 5.量化训练&精度验证
    # 6.导出onnx
    if importlib.util.find_spec("qir.utils.onnx_helper") is not None:
        export_to_onnx = importlib.import_module("qir.utils.onnx_helper").export_to_onnx
        export_to_onnx(qat_model, data, "qat.onnx", enable_onnx_checker=True, operator_export_type=None)
        assert (tmp_path / "qat.onnx").exists()
    # 7.评测定点精度
    # 异构方案的quantize_model仅可用于评测精度,无法用于模型编译
    quantize_model = convert_fx(qat_model)
    quantize_res = quantize_model(data)

    # what the flow must show
    assert float_res.shape == qat_res.shape == quantize_res.shape
    plan = qq.hybrid_placement(qat_model)
    assert plan.cpu_modules() == ["selu", "layer1.conv", "conv0"]
    assert [p.target for p in plan.placements if p.placed].count("selu") == 3
    assert plan.stubs("quant") == ["layer0._generated_quant_0", "layer1._generated_quant_0", "_generated_quant_0"]
    assert type(quantize_model.conv0) is nn.Conv2d and type(quantize_model.selu) is _SeluModule
    assert quantize_model.get_submodule("conv1").dtype.name == "qint32"
    qat_model.eval()
    qq.set_fake_quantize(qat_model, "validation")
    qat_eval = qat_model(data)
    assert (quantize_res - qat_eval).abs().max() <= 0.02 * qat_eval.abs().max()
    assert isinstance(model.layer0[1], nn.BatchNorm2d) and type(model.conv0) is nn.Conv2d  # input untouched
    # 8. hb_mapper compiles the ONNX file; qir's compile_model compiles the hybrid integer model, its CPU part
    # as float kernels calling the converted model's torch functions (docs/hybrid.md)
    program = qq.compile_model(quantize_model, [data])
    assert torch.equal(program(data), quantize_res)

    # the seed's literal layer1 = ConvBNReLU() has children 0 / 1 / 2, not conv: a clear error
    with pytest.raises(ValueError, match=r"'layer1\.conv' names no module; modules under 'layer1': layer1\.0 "):
        prepare_qat_fx(
            HybridModel(layer1=ConvBNReLU),
            {"": get_default_calib_qconfig()},
            hybrid=True,
            hybrid_dict={"module_name": ["layer1.conv", "conv0"], "module_type": [_SeluModule]},
        )
