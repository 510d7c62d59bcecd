"""The converted RoI modules check their boxes as the compiled kernels do, with the same code
(backends/common/kernels/data_checks.py ``check_rois``): a NaN coordinate, a batch index that
names no image (a negative one used to pick the last image silently), or a forged extent
that would size the sampling loop is a DataError naming the module and the field, and the
kernel refuses the same boxes with the same rule."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from backends.common.kernels.data_checks import DataError
from qir.nn import MultiScaleRoIAlign, RoIAlign, qat, quantized
from qir.quantization import get_default_qat_qconfig
from tests.backends.test_kernel_data_hostile import _roi_align as kernel_roi_align

QC = get_default_qat_qconfig()
GOOD = [[0.0, 1.0, 1.0, 5.0, 6.0], [1.0, 0.0, 2.0, 7.0, 7.5]]
BAD = [
    # (row, what the refusal says)
    ([2.0, 1.0, 1.0, 5.0, 6.0], r"the box batch index \(column 0 of the boxes\) holds 2, outside \[0, 2\)"),
    ([-1.0, 1.0, 1.0, 5.0, 6.0], r"the box batch index \(column 0 of the boxes\) holds -1, outside \[0, 2\)"),
    ([0.5, 1.0, 1.0, 5.0, 6.0], "the box batch index .* holds 0.5, not a whole number"),
    ([0.0, math.nan, 1.0, 5.0, 6.0], "the box coordinates holds nan, not a finite number"),
    ([0.0, 1.0, 1.0, 5.0, math.inf], "the box coordinates holds inf, not a finite number"),
    ([0.0, 1.0, 0.0, 5.0, 1e9], r"a box spans 1e\+09 feature-map pixels along y, over 16 times the size-8 map"),
]


def _roi_align(sampling_ratio: int = -1) -> Any:
    m = qat.RoIAlign.from_float(RoIAlign((2, 2), 1.0, sampling_ratio, False), QC).eval()
    m.activation_post_process.disable_observer().scale.fill_(0.05)
    return quantized.RoIAlign.from_qat(m, [torch.tensor(0.05)], "bayes")


def test_good_boxes_run() -> None:
    x = torch.randint(-5, 5, (2, 3, 8, 8), dtype=torch.int8)
    assert _roi_align()(x, torch.tensor(GOOD)).shape == (2, 3, 2, 2)


@pytest.mark.parametrize(("row", "match"), BAD, ids=[m[:30] for _, m in BAD])
def test_the_module_and_the_kernel_refuse_the_same_boxes(row: list[float], match: str) -> None:
    boxes = torch.tensor([GOOD[0], row])
    x = torch.randint(-5, 5, (2, 3, 8, 8), dtype=torch.int8)
    with pytest.raises(DataError, match=f"^RoIAlign: {match}"):
        _roi_align()(x, boxes)
    with pytest.raises(DataError, match=f"^roi_align: {match}"):
        kernel_roi_align(boxes)


def test_the_qat_module_samples_with_the_same_checks() -> None:
    m = qat.RoIAlign.from_float(RoIAlign((2, 2), 1.0, -1, False), QC).eval()
    with pytest.raises(DataError, match=r"RoIAlign: the box batch index .* holds -1"):
        m(torch.randn(2, 3, 8, 8), torch.tensor([[-1.0, 1.0, 1.0, 5.0, 6.0]]))


def test_multi_scale_boxes_are_checked_before_their_levels() -> None:
    names = ["p2", "p3"]
    m = qat.MultiScaleRoIAlign.from_float(MultiScaleRoIAlign(names, (2, 2), -1), QC).eval()
    m.activation_post_process.disable_observer().scale.fill_(0.05)
    qm = quantized.MultiScaleRoIAlign.from_qat(m, [torch.tensor(0.05), torch.tensor(0.05)], "bayes")
    x = {
        "p2": torch.randint(-5, 5, (1, 3, 16, 16), dtype=torch.int8),
        "p3": torch.randint(-5, 5, (1, 3, 8, 8), dtype=torch.int8),
    }
    shapes = [(64, 64)]
    assert qm(x, [torch.tensor([[1.0, 1.0, 20.0, 30.0]])], shapes).shape == (1, 3, 2, 2)
    # a NaN box's level matches no level: its row stayed silently zero
    with pytest.raises(DataError, match=r"^MultiScaleRoIAlign: the box coordinates holds nan"):
        qm(x, [torch.tensor([[1.0, math.nan, 20.0, 30.0]])], shapes)
    with pytest.raises(DataError, match=r"^MultiScaleRoIAlign: a box spans"):
        qm(x, [torch.tensor([[1.0, 1.0, 20.0, 1e9]])], shapes)
