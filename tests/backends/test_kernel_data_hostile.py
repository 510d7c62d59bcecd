"""Values that arrive with the data and that a kernel indexes or sizes with are checked before
use: each bad value is a DataError naming the kernel and the field (a negative batch index used
to wrap to the last image silently, a NaN box coordinate became a garbage integer, a forged
coordinate sized a Python loop, an out-of-range level left rows silently zero)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from backends.common.kernels.base import get_kernel
from backends.common.kernels.data_checks import DataError, check_index
from backends.common.kernels.infer import ShapeError
from backends.common.kernels.softmax import softmax_input
from backends.common.program import Instruction, Program, ValueRef
from backends.common.runtime import CompiledModel

ROI = {"output_size": [2, 2], "sampling_ratio": -1, "bits": 8, "mean_bits": 8, "out_dtype": "qint8"}


def _run(op: str, attrs: dict[str, Any], args: list[Any], consts: dict[str, torch.Tensor] | None = None) -> Any:
    inst = Instruction(op, tuple(f"in{i}" for i in range(len(args))), ("out",), attrs, {k: k for k in consts or {}})
    kernel = get_kernel(op)
    return kernel.run(inst, args, kernel.prepare(inst, consts or {}))


def _roi_align(boxes: torch.Tensor, sampling_ratio: int = -1) -> Any:
    attrs = {**ROI, "sampling_ratio": sampling_ratio, "spatial_scale": 1.0, "aligned": False, "box_list": False}
    attrs |= {"multiplier": 1, "shift": 0}
    x = torch.randint(-5, 5, (2, 3, 8, 8), dtype=torch.int8)
    return _run("roi_align", attrs, [x, boxes])


def test_roi_boxes_good_ones_run() -> None:
    out = _roi_align(torch.tensor([[0.0, 1, 1, 6, 6], [1.0, 0, 0, 8, 8]]))[0]
    assert out.shape == (2, 3, 2, 2)


@pytest.mark.parametrize(
    ("batch", "match"),
    [(-1.0, "batch index .* holds -1"), (2.0, "batch index .* holds 2"), (0.5, "not a whole number")],
)
def test_roi_batch_index_outside_the_images_is_refused(batch: float, match: str) -> None:
    with pytest.raises(DataError, match=f"roi_align: .*{match}"):
        _roi_align(torch.tensor([[batch, 1, 1, 6, 6]]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_roi_coordinates_must_be_finite(bad: float) -> None:
    with pytest.raises(DataError, match=r"roi_align: the box coordinates holds .*not a finite number"):
        _roi_align(torch.tensor([[0.0, 1, bad, 6, 6]]))


def test_a_huge_box_does_not_size_the_sampling_loop() -> None:
    # refused before any sampling (unchecked, this box meant 10**8 samples per bin: a hang)
    with pytest.raises(DataError, match=r"spans 1e\+09 feature-map pixels along y, over 16 times the size-8 map"):
        _roi_align(torch.tensor([[0.0, 1, 1, 6, 1e9]]))
    with pytest.raises(DataError, match="beyond 2\\*\\*52"):  # a fixed ratio: only exactness bounds it
        _roi_align(torch.tensor([[0.0, 1, 1, 6, 1e30]]), sampling_ratio=2)
    assert _roi_align(torch.tensor([[0.0, 1, 1, 6, 40.0]]), sampling_ratio=2)[0].shape == (1, 3, 2, 2)


def test_roi_levels_refuse_nan_boxes() -> None:
    attrs = {"k_min": 2, "k_max": 5, "canonical_scale": 224, "canonical_level": 4, "eps": 1e-6}
    assert _run("roi_levels", attrs, [torch.tensor([[0.0, 0, 10, 10]])])[0].tolist() == [0]
    with pytest.raises(DataError, match="roi_levels: the box coordinates holds nan"):
        _run("roi_levels", attrs, [torch.tensor([[0.0, 0, float("nan"), 10]])])


def _multi_scale(levels: torch.Tensor) -> Any:
    attrs = {
        **ROI,
        "spatial_scales": [1.0, 0.5],
        "feature_sizes": [[8, 8], [4, 4]],
        "multipliers": [1, 1],
        "shifts": [0, 0],
    }
    f0 = torch.randint(-5, 5, (1, 3, 8, 8), dtype=torch.int8)
    f1 = torch.randint(-5, 5, (1, 3, 4, 4), dtype=torch.int8)
    boxes = torch.tensor([[1.0, 1, 6, 6], [0.0, 0, 7, 7]])
    return _run("multi_scale_roi_align", attrs, [levels, f0, f1, boxes])


def test_multi_scale_levels_are_checked() -> None:
    assert _multi_scale(torch.tensor([0, 1]))[0].shape == (2, 3, 2, 2)
    with pytest.raises(DataError, match="multi_scale_roi_align: the level input holds 2, outside \\[0, 2\\)"):
        _multi_scale(torch.tensor([0, 2]))
    with pytest.raises(DataError, match="multi_scale_roi_align: the level input holds -1"):
        _multi_scale(torch.tensor([-1, 0]))
    with pytest.raises(DataError, match=r"\[3\] level indices for 2 boxes"):
        _multi_scale(torch.tensor([0, 1, 1]))


def test_gather_index_from_the_data_is_checked() -> None:
    x = torch.arange(12, dtype=torch.int8).reshape(3, 4)
    assert _run("gather", {"dim": 1}, [x, torch.tensor([[0, 3]] * 3)])[0].tolist() == [[0, 3], [4, 7], [8, 11]]
    with pytest.raises(DataError, match=r"gather: the index input holds 4, outside \[0, 4\)"):
        _run("gather", {"dim": 1}, [x, torch.tensor([[0, 4]] * 3)])
    with pytest.raises(DataError, match=r"gather: the index input holds -1"):
        _run("gather", {"dim": 0}, [x, torch.tensor([[-1, 0, 0, 0]])])


def test_the_runtime_names_the_file_kernel_and_node() -> None:
    program = Program(
        march="bayes",
        inputs=("x", "i"),
        outputs="y",
        instructions=[Instruction("gather", ("x", "i"), ("y",), {"dim": 0}, {}, "head.pick")],
        constants={},
    )
    run = CompiledModel(program, source="m.hbm")
    x = torch.arange(6, dtype=torch.int8).reshape(3, 2)
    assert run(x, torch.tensor([[2, 0]])).tolist() == [[4, 1]]
    with pytest.raises(DataError, match=r"compiled model 'm.hbm': gather for 'head.pick': gather: the index input"):
        run(x, torch.tensor([[3, 0]]))


def test_check_index_takes_whole_floats_and_empty_indices() -> None:
    check_index("k", "f", torch.tensor([0.0, 2.0]), 3)
    check_index("k", "f", torch.zeros(0, dtype=torch.int64), 0)
    with pytest.raises(DataError, match="k: f holds 3, outside"):
        check_index("k", "f", torch.tensor([3]), 3)


def _softmax_table_check(table: torch.Tensor, shift: int = 20, multiplier: int = 2**30) -> None:
    inst = Instruction("softmax", ("x",), ("y",), {"dim": -1, "multiplier": multiplier, "shift": shift}, {"table": "t"})
    softmax_input(inst, torch.empty(2, 10, dtype=torch.int8, device="meta"), {"t": table}, -1)


def test_softmax_table_values_are_checked_at_load() -> None:
    good = torch.arange(256, dtype=torch.int16) * 128
    good[255] = 32767
    _softmax_table_check(good)
    zero_top = good.clone()
    zero_top[255] = 0  # every row's sum could be 0: a division by zero at run
    with pytest.raises(ShapeError, match=r"entry 255 .* > 0"):
        _softmax_table_check(zero_top)
    negative = good.clone()
    negative[3] = -5
    with pytest.raises(ShapeError, match="entries must be >= 0"):
        _softmax_table_check(negative)
    with pytest.raises(ShapeError, match="overflows int64"):
        _softmax_table_check(good, shift=60)


def test_a_repeat_count_from_the_data_is_bounded_before_anything_is_built() -> None:
    """``x.repeat(n)`` with ``n`` computed at run time: the layout function checks the count it
    is handed (a value, not an attribute the loader saw) before torch allocates."""
    inst = Instruction("shape_fn", ("x", "n"), ("y",), {"fn": "repeat", "args": [ValueRef("x"), 1, ValueRef("n")]})
    run = CompiledModel(Program("bayes", ("x", "n"), "y", [inst], {}), source="r.hbm")
    x = torch.zeros(2, 3, dtype=torch.int8)
    assert run(x, 2).shape == (2, 6)
    with pytest.raises(RuntimeError, match=r"shape_fn .*repeat\(1, 1000000000\) of a \[2, 3\] tensor .*limit"):
        run(x, 10**9)
    with pytest.raises(RuntimeError, match="repetitions must be non-negative"):
        run(x, -1)
    with pytest.raises(RuntimeError, match="integer sizes"):
        run(x, torch.tensor(2))
