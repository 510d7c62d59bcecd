"""A detection head as the plugin's toolkit writes it: a qint16 box branch configured with
``torch.quantization.QConfig`` + the plugin's ``FakeQuantize.with_args(observer=MovingAverageMinMaxObserver,
quant_min=qinfo("qint16").min, ...)``, ``FloatFunctional().concatenate``, a high-precision last
conv, and post-processing that checks for ``QTensor``."""

import torch
from names_flow import fx_flow
from torch import nn
from torch.quantization import DeQuantStub, QConfig

from qir.dtype import qinfo, qint16
from qir.march import March, march_scope
from qir.nn.quantized import FloatFunctional
from qir.qtensor import QTensor
from qir.quantization import (
    FakeQuantize,
    MovingAverageMinMaxObserver,
    QuantStub,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
)
from qir.quantization.qconfig import default_calib_8bit_weight_32bit_out_fake_quant_qconfig

# the toolkit's "grid_qconfig", spelled as in its files (torch's QConfig, the plugin's FakeQuantize)
box_qconfig = QConfig(
    activation=FakeQuantize.with_args(
        observer=MovingAverageMinMaxObserver,
        quant_min=qinfo("qint16").min,
        quant_max=qinfo("qint16").max,
        dtype=qint16,
        saturate=True,
    ),
    weight=None,
)


class Head(nn.Module):
    def __init__(self, cin: int = 8, num_classes: int = 3, num_anchors: int = 2) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.stem = nn.Sequential(nn.Conv2d(3, cin, 3, padding=1), nn.ReLU())
        self.cls = nn.Conv2d(cin, num_classes * num_anchors, 1)  # logits: high-precision (qint32) output
        self.box = nn.Conv2d(cin, 4 * num_anchors, 1)
        self.ctr = nn.Conv2d(cin, num_anchors, 1)
        self.box_scale = FloatFunctional()  # qint16: box offsets need the range
        self.cat = FloatFunctional()
        self.dequant_cls = DeQuantStub()
        self.dequant_reg = DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.stem(self.quant(x))
        boxes = self.box_scale.mul_scalar(self.box(f), 4.0)
        reg = self.cat.concatenate([boxes, self.ctr(f)], dim=1)
        return self.dequant_cls(self.cls(f)), self.dequant_reg(reg)


def decode(pred: torch.Tensor, num_classes: int = 3, score_thresh: float = 0.5) -> torch.Tensor:
    """Post-processing as heads write it: accept a QTensor or a float tensor."""
    if isinstance(pred, QTensor):
        pred = pred.dequantize()
    scores = pred.sigmoid()
    return scores > score_thresh


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(2, 3, 8, 8),)


def test_detection_head_with_plugin_names_runs_end_to_end() -> None:
    torch.manual_seed(0)
    with march_scope(March.BAYES):
        result = fx_flow(
            Head(),
            _inputs,
            calib_dict={
                "": get_default_calib_qconfig(),
                "module_name": {
                    "cls": default_calib_8bit_weight_32bit_out_fake_quant_qconfig,
                    "box_scale": get_default_calib_qconfig(dtype=qint16),
                },
            },
            qat_dict={
                "": get_default_qat_qconfig(),
                "module_name": {"box_scale": box_qconfig, "cls": get_default_qat_out_qconfig()},
            },
        )
    assert result.qat.box_scale.activation_post_process.dtype.name == "qint16"
    assert result.qat.cls.activation_post_process is None  # the calibration and QAT out qconfigs agree
    (cls_int, reg_int), (cls_qat, reg_qat) = result.integer_out, result.qat_out
    lsb = float(result.qat.cat.activation_post_process.scale)
    assert (reg_int - reg_qat).abs().max() <= 2 * lsb
    # qint32 logits: no output rounding; what differs comes from 1-LSB differences in the stem
    assert (cls_int - cls_qat).abs().max() < 1e-2 * float(cls_qat.abs().max())
    # the same post-processing on the integer model's logits and on a QTensor of reg codes
    assert (decode(cls_int) != decode(cls_qat)).float().mean() < 0.05
    codes = QTensor(torch.round(reg_int / lsb).to(torch.int8), lsb)
    assert torch.equal(decode(codes), decode(codes.dequantize()))


def test_torch_qconfig_of_torch_factories_is_explained() -> None:
    import pytest
    from torch.ao.quantization import FakeQuantize as TorchFakeQuantize

    from qir.quantization import prepare_qat_fx

    bad = QConfig(activation=TorchFakeQuantize.with_args(), weight=None)
    with march_scope(March.BAYES), pytest.raises(TypeError, match=r"torch\.ao\.quantization factory, not a qir one"):
        prepare_qat_fx(Head(), {"": get_default_qat_qconfig(), "module_name": {"cls": bad}})
