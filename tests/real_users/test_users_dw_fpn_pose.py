"""The toolkit's DepthWiseFPN neck and HumanPoseHead as its configs build them: the neck takes the
backbone's list of stride-4..32 features and picks them by ``len(features)`` (4 or 5 levels), adds
each ``Interpolate(scale_factor=2, mode="bilinear", recompute_scale_factor=True)`` upsampled level to
a 1x1 lateral with ``FloatFunctional().add``, runs a depthwise 3x3 + ReLU, and returns the list; the
pose head runs conv + bn + relu blocks, ``Interpolate((h, w), align_corners=False)`` to the target
size, a high-precision ``out_conv`` (``get_default_qat_out_qconfig()`` from ``set_qconfig()``) and
returns ``OrderedDict(ldmk_pred=self.dequant(...))``. Calibration -> QAT -> convert -> check ->
compile -> run, the backbone's levels given as one list."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterator

import pytest
import torch
from names_flow import fx_flow
from torch import nn

from qir.march import March, march_scope
from qir.nn import Interpolate
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    fuse_fx,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.qconfig import default_calib_8bit_weight_32bit_out_fake_quant_qconfig


def conv_module(cin: int, cout: int, k: int, groups: int = 1, act: bool = False) -> nn.Sequential:
    """The toolkit's ConvModule2d: conv (+ bn) (+ act) in a Sequential."""
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, nn.ReLU(inplace=True)) if act else nn.Sequential(*layers)


class DepthWiseFPN(nn.Module):
    def __init__(self, feature_dim: int, in_channels: list[int]) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.p5_1x1 = conv_module(in_channels[3], feature_dim, 1)
        self.p5_upscale = Interpolate(scale_factor=2, mode="bilinear", align_corners=False, recompute_scale_factor=True)
        self.p4_1x1_plus = conv_module(in_channels[2], feature_dim, 1)
        self.conv_add1 = FloatFunctional()
        self.p4_3x3 = conv_module(feature_dim, feature_dim, 3, groups=feature_dim, act=True)
        self.p4_upscale = Interpolate(scale_factor=2, mode="bilinear", align_corners=False, recompute_scale_factor=True)
        self.p3_1x1_plus = conv_module(in_channels[1], feature_dim, 1)
        self.conv_add2 = FloatFunctional()
        self.p3_3x3 = conv_module(feature_dim, feature_dim, 3, groups=feature_dim, act=True)

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        assert len(self.in_channels) >= 4
        if len(features) == 4:
            s3, s4, s5 = features[1], features[2], features[3]
        elif len(features) == 5:
            s3, s4, s5 = features[2], features[3], features[4]
        else:
            raise Exception("please check backbone output.")
        p5_1x1 = self.p5_1x1(s5)
        p4 = self.p4_3x3(self.conv_add1.add(self.p5_upscale(p5_1x1), self.p4_1x1_plus(s4)))
        p3 = self.p3_3x3(self.conv_add2.add(self.p4_upscale(p4), self.p3_1x1_plus(s3)))
        return [p3, p4, p5_1x1]


class HumanPoseHead(nn.Module):
    def __init__(self, num_ldmk: int, num_filter: int, target_shape: tuple[int, int]) -> None:
        super().__init__()
        self.dequant = DeQuantStub()
        self.interpolate = Interpolate((target_shape[0], target_shape[1]), align_corners=False)
        self.head = nn.Sequential(conv_module(num_filter, num_filter, 3, act=True))
        self.out_conv = nn.Conv2d(num_filter, num_ldmk * 3, 1)

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        x = self.interpolate(self.head(x))
        return OrderedDict(ldmk_pred=self.dequant(self.out_conv(x)))

    def set_qconfig(self) -> None:
        self.head.qconfig = get_default_qat_qconfig()
        self.out_conv.qconfig = get_default_qat_out_qconfig()


class PoseNet(nn.Module):
    """Backbone levels in (one QuantStub per level, as the toolkit's FPN inputs), neck, head."""

    def __init__(self, levels: int = 4) -> None:
        super().__init__()
        chans = [4, 4, 8, 12, 16] if levels == 5 else [4, 8, 12, 16]
        self.quants = nn.ModuleList(QuantStub() for _ in chans)
        self.neck = DepthWiseFPN(8, chans[-4:])
        self.head = HumanPoseHead(num_ldmk=2, num_filter=8, target_shape=(12, 12))

    def forward(self, feats: list[torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
        p3, _, _ = self.neck([q(f) for q, f in zip(self.quants, feats, strict=True)])
        return self.head(p3)


def _levels(n: int = 4) -> tuple[list[torch.Tensor]]:
    sizes = [32, 16, 8, 4, 2][:n] if n == 5 else [16, 8, 4, 2]
    chans = [4, 4, 8, 12, 16] if n == 5 else [4, 8, 12, 16]
    return ([torch.randn(1, c, s, s) for c, s in zip(chans, sizes, strict=True)],)


def _random_bn(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return model.eval()


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def test_the_neck_and_pose_head_calibrate_train_convert_and_compile() -> None:
    model = _random_bn(PoseNet())
    float_out = model(*_levels())["ldmk_pred"]
    assert float_out.shape == (1, 6, 12, 12)
    out_calib = default_calib_8bit_weight_32bit_out_fake_quant_qconfig
    calib = {"": get_default_calib_qconfig(), "module_name": {"head.out_conv": out_calib}}
    qat = {"": get_default_qat_qconfig(), "module_name": {"head.out_conv": get_default_qat_out_qconfig()}}
    result = fx_flow(model, _levels, calib, qat, steps=2, example_inputs=True)
    out = result.integer_out["ldmk_pred"]
    assert out.shape == (1, 6, 12, 12) and out.dtype == torch.float32
    lsb = float(result.qat.get_submodule("head.head.0.0").activation_post_process.scale)
    w = result.qat.get_submodule("head.out_conv").weight.abs().sum(dim=(1, 2, 3)).max()
    # qint32 output: the error is what its input's LSB can move it, times the weights
    assert result.max_error() <= 2.01 * lsb * float(w)


def test_the_graph_is_specialised_to_the_number_of_levels_and_says_so() -> None:
    # the neck picks its inputs by len(features): prepared on 4 levels, the traced graph reads
    # features[1..3]; a 5-level list would silently feed it the wrong levels, so it is refused
    four, five = _levels(4), _levels(5)
    qat = prepare_qat_fx(_random_bn(PoseNet(4)), {"": get_default_qat_qconfig()}, example_inputs=four)
    assert qat.meta["qir.sequence_lengths"] == {"feats": 4}
    qat(*four)
    qat.eval()
    set_fake_quantize(qat, "validation")
    converted = convert_fx(qat)
    for model in (qat, converted, copy.deepcopy(converted)):
        with pytest.raises(ValueError, match=r"input 'feats' has 5 elements, but the model was traced for 4"):
            model(*five)
    # prepared on 5 levels, the neck's other branch is the one traced
    model5 = _random_bn(PoseNet(5))
    qat5 = prepare_qat_fx(model5, {"": get_default_qat_qconfig()}, example_inputs=five)
    assert torch.allclose(fuse_fx(model5, five)(*five)["ldmk_pred"], model5(*five)["ldmk_pred"], atol=1e-4)
    assert qat5(*five)["ldmk_pred"].shape == (1, 6, 12, 12)
