"""The toolkit's SegHead as its segmentation configs build it: ``forward(self, feats)`` slices the
backbone's list (``feats[self.feat_start_index : self.feat_end_index]``), inserts a 2x upsampled
copy of the first level (``Interpolate(scale_factor=2, recompute_scale_factor=True)``) with
``feats.insert(0, ...)``, and runs ``multi_apply(self.forward_single, feats, range(n))``: per output
stride a separable conv (depthwise 3x3, pointwise 1x1 + bn + relu) and a 1x1 predictor, one
``DeQuantStub`` shared by every stride; with ``argmax_output`` (deployment) the predictor is padded
with ``F.pad`` and reduced by ``argmax(dim=1, keepdim=True)`` on the codes instead of dequantized.
Calibration -> QAT -> convert -> check -> compile -> run."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from names_flow import finish, fx_flow
from torch import nn

from qir.march import March, march_scope
from qir.nn import Interpolate
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)


def multi_apply(func: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[list[Any], ...]:
    """The toolkit's helper: ``func`` over zipped arguments, results transposed into lists."""
    pfunc = partial(func, **kwargs) if kwargs else func
    return tuple(map(list, zip(*map(pfunc, *args), strict=True)))


def _as_list(obj: Any) -> list[Any]:
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


class SeparableConvModule2d(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(
            nn.Conv2d(cin, cin, 3, padding=1, groups=cin),
            nn.Conv2d(cin, cout, 1),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )


class SegHead(nn.Module):
    def __init__(
        self,
        num_classes: int,
        in_strides: list[int],
        out_strides: list[int],
        stride2channels: dict[int, int],
        feat_channels: int = 8,
        upscale: bool = True,
        argmax_output: bool = False,
        padding_to_alighed_dim: tuple[int, int, int, int] | None = None,
    ) -> None:
        super().__init__()
        self.in_strides, self.out_strides = sorted(in_strides), sorted(out_strides)
        self.feat_start_index = (
            self.in_strides.index(min(self.out_strides)) if min(self.out_strides) in self.in_strides else 0
        )
        self.feat_end_index = (
            self.in_strides.index(max(self.out_strides)) + 1 if max(self.out_strides) in self.in_strides else 1
        )
        self.in_channels = [stride2channels[i] for i in self.in_strides]
        if upscale:
            self.in_channels.insert(0, stride2channels[self.in_strides[0]])
        self.upscale, self.argmax_output = upscale, argmax_output
        self.dequant_output = not argmax_output
        self.padding_to_alighed_dim = padding_to_alighed_dim
        self.dequant = DeQuantStub()
        self.prefix = ["stride" + str(i) for i in self.out_strides]
        self.seg_convs = nn.ModuleDict(
            {
                p: nn.ModuleList([SeparableConvModule2d(self.in_channels[i + self.feat_start_index], feat_channels)])
                for i, p in enumerate(self.prefix)
            }
        )
        self.output_convs = nn.ModuleDict({p: nn.Conv2d(feat_channels, num_classes, 1) for p in self.prefix})
        self.upsample = Interpolate(scale_factor=2, align_corners=False, recompute_scale_factor=True, mode="bilinear")

    def forward_single(self, x: torch.Tensor, stride_index: int = 0) -> tuple[torch.Tensor]:
        seg_feat = x
        for seg_layer in self.seg_convs[self.prefix[stride_index]]:
            seg_feat = seg_layer(seg_feat)
        seg_pred = self.output_convs[self.prefix[stride_index]](seg_feat)
        if self.argmax_output:
            if self.padding_to_alighed_dim is not None:
                seg_pred = F.pad(seg_pred, self.padding_to_alighed_dim)
            seg_pred = seg_pred.argmax(dim=1, keepdim=True)
        if self.dequant_output:
            seg_pred = self.dequant(seg_pred)
        return (seg_pred,)

    def forward(self, feats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        feats = _as_list(feats[self.feat_start_index : self.feat_end_index])
        if self.upscale:
            feats.insert(0, self.upsample(feats[0]))
        outs = multi_apply(self.forward_single, feats, range(len(self.out_strides)))
        assert isinstance(outs, Sequence) and len(outs) == 1 and isinstance(outs[0], Sequence)
        return outs[0]


class Segmenter(nn.Module):
    def __init__(self, argmax_output: bool) -> None:
        super().__init__()
        self.quants = nn.ModuleList(QuantStub() for _ in range(3))
        self.head = SegHead(
            4,
            [8, 16, 32],
            [4, 8],
            {8: 6, 16: 8, 32: 8},
            argmax_output=argmax_output,
            padding_to_alighed_dim=(0, 0, 0, 0) if argmax_output else None,
        )

    def forward(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.head([q(f) for q, f in zip(self.quants, feats, strict=True)])


def _levels() -> tuple[list[torch.Tensor]]:
    return ([torch.randn(1, c, s, s) for c, s in ((6, 8), (8, 4), (8, 2))],)


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


def test_the_seg_head_calibrates_trains_converts_and_compiles() -> None:
    result = fx_flow(_random_bn(Segmenter(argmax_output=False)), _levels, steps=2, example_inputs=True)
    assert [tuple(o.shape) for o in result.integer_out] == [(1, 4, 16, 16), (1, 4, 8, 8)]
    lsb = max(
        float(m.activation_post_process.scale)
        for n, m in result.qat.named_modules()
        if n.startswith("head.output_convs") and getattr(m, "activation_post_process", None) is not None
    )
    assert result.max_error() <= 2.01 * lsb


def test_the_argmax_deployment_head_loads_the_trained_state_and_compiles() -> None:
    # the toolkit trains with dequantized logits and deploys argmax_output=True from the checkpoint
    float_model = _random_bn(Segmenter(argmax_output=False))
    trained = fx_flow(float_model, _levels, steps=2, example_inputs=True)
    deploy_float = Segmenter(argmax_output=True)
    deploy_float.load_state_dict(float_model.state_dict())
    deploy = prepare_qat_fx(deploy_float.eval(), {"": get_default_qat_qconfig()}, example_inputs=_levels())
    deploy.load_state_dict(trained.qat.state_dict(), strict=True)
    deploy.eval()
    set_fake_quantize(deploy, "validation")
    result = finish(deploy, convert_fx(deploy), trained.inputs)  # checked, compiled, artifact == converted
    for classes, logits, qat_classes in zip(result.integer_out, trained.integer_out, result.qat_out, strict=True):
        assert classes.shape[1] == 1 and not classes.is_floating_point()
        assert torch.equal(classes, logits.argmax(dim=1, keepdim=True))  # argmax of the codes = of the logits
        assert torch.equal(classes, qat_classes)  # validation QAT computes the integer grid
