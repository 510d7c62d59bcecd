"""The float modules the library converts, with input shapes and scales (one table for all tests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

import qir.nn as qnn
from qir.nn.intrinsic import fused_class
from qir.nn.qat import QAT_CONV_CLASSES


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], nn.Module]
    shapes: tuple[tuple[int, ...], ...]
    scales: tuple[float, ...]
    exact: bool = False  # the quantized output equals the QAT output exactly
    has_weight: bool = False
    tags: frozenset[str] = field(default_factory=frozenset)


_CONV_FACTORIES: dict[type[nn.Module], tuple[Callable[[], nn.Module], tuple[int, ...], tuple[int, ...]]] = {
    nn.Conv1d: (lambda: nn.Conv1d(3, 4, 3, padding=1), (2, 3, 8), (2, 4, 8)),
    nn.Conv2d: (lambda: nn.Conv2d(3, 4, 3, padding=1), (2, 3, 6, 6), (2, 4, 6, 6)),
    nn.Conv3d: (lambda: nn.Conv3d(2, 3, 3, padding=1), (1, 2, 4, 4, 4), (1, 3, 4, 4, 4)),
    nn.ConvTranspose2d: (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
        (1, 4, 4, 4),
        (1, 6, 8, 8),
    ),
    nn.Linear: (lambda: nn.Linear(8, 5), (4, 8), (4, 5)),
}


def _conv_case(conv_t: type[nn.Module], has_add: bool, act: str | None) -> Case:
    factory, in_shape, out_shape = _CONV_FACTORIES[conv_t]

    def make() -> nn.Module:
        conv = factory()
        return fused_class(conv_t, has_add, act)(conv) if (has_add or act) else conv

    name = QAT_CONV_CLASSES[(conv_t, has_add, act)].__name__
    shapes = (in_shape, out_shape) if has_add else (in_shape,)
    scales = (0.02, 0.03) if has_add else (0.02,)
    return Case(name, make, shapes, scales, has_weight=True, tags=frozenset({"conv"}))


CONV_CASES = [_conv_case(*key) for key in QAT_CONV_CLASSES]

IMG = ((2, 3, 8, 8),)
OTHER_CASES = [
    Case("ReLU", nn.ReLU, IMG, (0.02,), exact=True),
    Case("ReLU6", nn.ReLU6, IMG, (0.05,), exact=True),
    Case("MaxPool2d", lambda: nn.MaxPool2d(3, 2, 1), IMG, (0.02,), exact=True),
    Case("AvgPool2d", lambda: nn.AvgPool2d(2), IMG, (0.02,)),
    Case("AvgPool2d-pad-excl", lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=False), IMG, (0.02,)),
    Case("AvgPool2d-ceil", lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True), IMG, (0.02,)),
    Case("AvgPool2d-divisor", lambda: nn.AvgPool2d(3, 1, 1, divisor_override=5), IMG, (0.02,)),
    Case("AdaptiveAvgPool2d", lambda: nn.AdaptiveAvgPool2d((3, 2)), ((2, 3, 7, 5),), (0.02,)),
    Case("Interpolate-nearest", lambda: qnn.Interpolate(scale_factor=2, mode="nearest"), IMG, (0.02,), exact=True),
    Case("Interpolate-bilinear", lambda: qnn.Interpolate(scale_factor=2, mode="bilinear"), IMG, (0.02,)),
    Case("Interpolate-bilinear-size", lambda: qnn.Interpolate(size=(5, 11), mode="bilinear"), IMG, (0.02,)),
    Case("Interpolate-align", lambda: qnn.Interpolate(size=(13, 6), mode="bilinear", align_corners=True), IMG, (0.02,)),
    Case("Upsample-nearest", lambda: nn.Upsample(scale_factor=2), IMG, (0.02,), exact=True),
    Case("Identity", nn.Identity, IMG, (0.02,), exact=True),
    Case("Dropout", lambda: nn.Dropout(0.3), IMG, (0.02,), exact=True),
    Case("Sigmoid", nn.Sigmoid, IMG, (0.05,), tags=frozenset({"lut"})),
    Case("GELU", nn.GELU, IMG, (0.05,), tags=frozenset({"lut"})),
    Case("Pow", lambda: qnn.Pow(3.0), IMG, (0.01,), tags=frozenset({"lut"})),
    *[
        Case(name, cls, IMG, (0.012,), tags=frozenset({"lut"}))
        for name, cls in qnn.UNARY_MODULES.items()
        if name != "Pow"
    ],
]

ALL_CASES = CONV_CASES + OTHER_CASES
