"""Detection code written for the plugin's ``AnchorGenerator(feat_strides, scales, ratios)``, run
with only its imports changed. qir's ``AnchorGenerator`` is torchvision's (the operator tables name
it as torchvision's replacement); the plugin's call must not be read as torchvision sizes: each
spelling is refused with an error naming both signatures, and torchvision's spellings still run."""

from __future__ import annotations

import pytest
import torch

import qir.nn as horizon_nn


def test_the_plugins_spellings_are_refused_not_misread() -> None:
    # the toolkit's RPN anchors: strides 8/16/32, one scale, three ratios
    with pytest.raises(TypeError, match=r"plugin's argument\(s\) ratios, scales.*horizon_plugin_pytorch's"):
        horizon_nn.AnchorGenerator([8, 16, 32], scales=[8], ratios=[0.5, 1.0, 2.0])
    with pytest.raises(TypeError, match=r"at most 2 positional arguments, got 3.*feat_strides"):
        horizon_nn.AnchorGenerator([8, 16, 32], [8], [0.5, 1.0, 2.0])
    with pytest.raises(TypeError, match=r"AnchorGenerator\(\[8, 16, 32\], \.\.\.\) is ambiguous"):
        horizon_nn.AnchorGenerator([8, 16, 32])  # strides to the plugin, one size per level to torchvision


def test_torchvisions_spellings_still_run() -> None:
    images = torch.zeros(1, 3, 64, 64)
    feats = [torch.zeros(1, 4, 8, 8), torch.zeros(1, 4, 4, 4)]
    nested = horizon_nn.AnchorGenerator(((32,), (64,)), ((0.5, 1.0, 2.0),) * 2)
    keyword = horizon_nn.AnchorGenerator(sizes=(32, 64), aspect_ratios=(0.5, 1.0, 2.0))
    a, b = nested(images, feats), keyword(images, feats)
    assert a[0].shape == (8 * 8 * 3 + 4 * 4 * 3, 4) and torch.equal(a[0], b[0])
