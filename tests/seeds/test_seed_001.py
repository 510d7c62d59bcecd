"""Seed 001 ("Deep Exploration") run with qir: custom qconfig, fx fusion printout, RGB888 graph edit.

The seed's code is kept as written; only ``horizon_plugin_pytorch`` imports became ``qir``.
"""

# The seeds' code is kept as the seeds wrote it (only imports changed), old idioms included.
# ruff: noqa: UP008

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch

SEED_FUSION_PRINTOUT = """ModelForFusion(
  (quantx): QuantStub()
  (quanty): QuantStub()
  (conv): Identity()
  (bn): Identity()
  (relu): Identity()
  (dequant): DeQuantStub()
  (_generated_add_0): ConvAddReLU2d(
    (conv): Conv2d(3, 3, kernel_size=(3, 3), stride=(1, 1))
    (relu): ReLU()
  )
)"""

SEED_BEFORE = """opcode       name     target    args        kwargs
-----------  -------  --------  ----------  --------
placeholder  input_1  input     ()          {}
call_module  quant    quant     (input_1,)  {}
call_module  conv     conv      (quant,)    {}
output       output   output    (conv,)     {}"""

# the seed's "After" table without the function address column
SEED_AFTER_ROWS = [
    ("placeholder", "input_1", "()", "{}"),
    ("call_module", "quant", "(input_1,)", "{}"),
    ("call_function", "centered_yuv2rgb", "(quant,)", "{'swing': 'full'}"),
    ("call_module", "conv", "(centered_yuv2rgb,)", "{}"),
    ("output", "output", "(conv,)", "{}"),
]


def _printed(fn: object) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn()  # type: ignore[operator]
    return buf.getvalue()


def test_custom_qconfig() -> None:
    import qir as horizon
    from qir.quantization import (
        FakeQuantize,
        MovingAveragePerChannelMinMaxObserver,
        MovingAveragePerTensorMinMaxObserver,
        QConfig,
    )
    from qir.quantization import (
        get_default_calib_qconfig as _calib,  # only to build a calibration custom qconfig below
    )

    activation_8bit_fake_quant = FakeQuantize.with_args(
        observer=MovingAveragePerTensorMinMaxObserver,
        dtype="qint8",
        ch_axis=0,
        averaging_constant=0,  # Custom parameter for observer
    )
    weight_8bit_fake_quant = FakeQuantize.with_args(
        observer=MovingAveragePerChannelMinMaxObserver,
        dtype="qint8",
        ch_axis=0,
        averaging_constant=1,  # Custom parameter for observer
    )
    qat_8bit_qconfig = QConfig(activation=activation_8bit_fake_quant, weight=weight_8bit_fake_quant)
    custom_qconfig = qat_8bit_qconfig

    from tests_seed_models import FuseNet

    model = FuseNet()
    horizon.march.set_march(horizon.march.March.BAYES)
    # the seed's snippet pairs a calibration global with a QAT custom qconfig: qir refuses the mix
    with pytest.raises(ValueError, match="cannot be mixed"):
        horizon.quantization.prepare_qat_fx(
            model,
            {
                "": horizon.qconfig.default_calib_8bit_fake_quant_qconfig,
                "module_name": {
                    "conv": custom_qconfig,
                },
            },
        )
    # the same call with one kind works: QAT global + the custom QAT qconfig
    qat_model = horizon.quantization.prepare_qat_fx(
        model,
        {
            "": horizon.qconfig.default_qat_8bit_fake_quant_qconfig,
            "module_name": {
                "conv": custom_qconfig,
            },
        },
    )
    fused_conv = qat_model.get_submodule("_generated_add_0")
    assert fused_conv.activation_post_process.observer.averaging_constant == 0
    calib_model = horizon.quantization.prepare_qat_fx(model, {"": _calib()})
    calib_model(torch.rand(1, 3, 8, 8), torch.rand(1, 3, 6, 6))


def test_fusion_example_printout() -> None:
    from torch import nn
    from torch.quantization import DeQuantStub

    from qir.quantization import QuantStub, fuse_fx

    class ModelForFusion(nn.Module):
        def __init__(self):
            super(ModelForFusion, self).__init__()
            self.quantx = QuantStub()
            self.quanty = QuantStub()
            self.conv = nn.Conv2d(3, 3, 3)
            self.bn = nn.BatchNorm2d(3)
            self.relu = nn.ReLU()
            self.dequant = DeQuantStub()

        def forward(self, x, y):
            x = self.quantx(x)
            y = self.quanty(y)
            x = self.conv(x)
            x = self.bn(x)
            x = x + y
            x = self.relu(x)
            x = self.dequant(x)

            return x

    float_model = ModelForFusion()
    fused_model = fuse_fx(float_model)

    out = _printed(lambda: print(fused_model))
    assert out.startswith(SEED_FUSION_PRINTOUT + "\n")
    assert re.search(r"_generated_add_0\(quantx, quanty\)", out)
    assert "dequant = self.dequant(" in out


def _table_rows(text: str) -> list[tuple[str, ...]]:
    rows = []
    for line in text.strip().splitlines()[2:]:
        cells = re.split(r"\s{2,}", line.strip())
        rows.append(tuple(cells))
    return rows


def test_rgb888_graph_edit() -> None:
    import torch

    from qir import set_march
    from qir.quantization import (
        QuantStub,
        convert_fx,
        prepare_qat_fx,
    )
    from qir.quantization.qconfig import (
        default_qat_8bit_fake_quant_qconfig,
    )

    functional = pytest.importorskip("qir.functional")
    centered_yuv2rgb = functional.centered_yuv2rgb

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.quant = QuantStub()
            self.conv = torch.nn.Conv2d(3, 3, 3)
            self.bn = torch.nn.BatchNorm2d(3)
            self.relu = torch.nn.ReLU()

        def forward(self, input):
            x = self.quant(input)
            x = self.conv(x)
            x = self.bn(x)
            x = self.relu(x)
            return x

        def set_qconfig(self):
            self.qconfig = default_qat_8bit_fake_quant_qconfig

    data = torch.rand(1, 3, 28, 28)
    net = Net()

    # Set march to BERNOULLI2 for RDK X3, and to BAYES for RDK Ultra.
    set_march("bayes")

    net.set_qconfig()
    qat_net = prepare_qat_fx(net)
    qat_net(data)
    quantized_net = convert_fx(qat_net)
    traced = quantized_net
    before = _printed(lambda: (print("Before centered_yuv2rgb"), traced.graph.print_tabular()))

    # Replace QuantStub nodes with centered_yuv2rgb
    patterns = ["quant"]
    for n in traced.graph.nodes:
        if any(n.target == pattern for pattern in patterns):
            with traced.graph.inserting_after(n):
                new_node = traced.graph.call_function(centered_yuv2rgb, (n,), {"swing": "full"})
                n.replace_all_uses_with(new_node)
                new_node.args = (n,)

    traced.quant.scale.fill_(1.0)
    traced.recompile()
    after = _printed(lambda: (print("\nAfter centered_yuv2rgb"), traced.graph.print_tabular()))

    assert before.split("\n", 1)[1].strip() == SEED_BEFORE
    rows = _table_rows(after.strip().split("\n", 1)[1])
    assert [(r[0], r[1], r[-2], r[-1]) for r in rows] == SEED_AFTER_ROWS
    # the edited model runs on raw centered YUV codes (QuantStub scale 1: the codes pass through)
    yuv = torch.randint(-128, 128, (1, 3, 28, 28)).float()
    out = traced(yuv)
    assert out.dtype == torch.int8 and out.shape == (1, 3, 26, 26)


def test_segmented_deployment() -> None:
    """Seed 001's "Model Segmented Deployment": a QuantStub (scale=None) after the split point
    records stage 2's input scale during QAT; after convert each stage runs on its own, stage 2
    taking float input."""
    from torch import nn
    from torch.quantization import DeQuantStub

    import qir as horizon
    from qir.quantization import QuantStub

    class Stage1(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant = QuantStub()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.relu = nn.ReLU()
            self.dequant = DeQuantStub()

        def forward(self, x):
            return self.dequant(self.relu(self.conv(self.quant(x))))

    class Stage2(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant = QuantStub(scale=None)  # inserted after the segmentation point
            self.conv = nn.Conv2d(4, 2, 1)
            self.dequant = DeQuantStub()

        def forward(self, x):
            return self.dequant(self.conv(self.quant(x)))

    class TwoStage(nn.Module):
        def __init__(self):
            super().__init__()
            self.stage1 = Stage1()
            self.stage2 = Stage2()

        def forward(self, x):
            feat = self.stage1(x)
            feat = feat * 1.0  # the CPU part between the stages (float)
            return self.stage2(feat)

    horizon.march.set_march(horizon.march.March.BAYES)
    model = TwoStage()
    model.qconfig = horizon.quantization.get_default_qat_qconfig()
    qat_model = horizon.quantization.prepare_qat(model)
    for _ in range(3):
        qat_model(torch.rand(2, 3, 8, 8))
    qat_model.eval()
    horizon.quantization.set_fake_quantize(qat_model, "validation")
    quantized = horizon.quantization.convert(qat_model)
    # stage 2's QuantStub recorded the scale of stage 1's output
    s1 = qat_model.stage1.conv.activation_post_process.scale
    assert torch.allclose(quantized.stage2.quant.scale, qat_model.stage2.quant.activation_post_process.scale)
    assert float(quantized.stage2.quant.scale) > 0 and float(s1) > 0
    x = torch.rand(2, 3, 8, 8)
    whole = quantized(x)
    feat = quantized.stage1(x)  # stage 1 alone: float out (its DeQuantStub)
    assert feat.is_floating_point()
    torch.testing.assert_close(quantized.stage2(feat * 1.0), whole)  # stage 2 alone, float example input
    traced2 = torch.jit.trace(quantized.stage2, feat)
    torch.testing.assert_close(traced2(feat), whole)
