"""[N, C, (D,) H, W] facts of tensors of rank 1 to 5, and the rank-3 tensors detection heads build."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.quantization import DeQuantStub, QuantStub

from passes.legality_facts import NCHW_LAYOUTS, nchw_axis, shape_facts
from qir.ir.types import DType, TensorType
from qir.march import march_scope
from qir.quantization import check_model, compile_model, convert_fx, get_default_qat_qconfig, prepare_qat_fx

_shapes = st.integers(1, 5).flatmap(lambda r: st.lists(st.integers(1, 300), min_size=r, max_size=r)).map(tuple)


@given(_shapes)
def test_nchw_facts_cover_every_element_once(shape: tuple[int, ...]) -> None:
    f = shape_facts(TensorType(shape, DType.qint8))
    n, c, h, w = f["input_n"], f["input_c"], f["input_h"], f["input_w"]
    d = f.get("input_d", 1)
    assert n * c * d * h * w == math.prod(shape)  # no dim counted twice, none left out
    assert f["in_channels"] == c and f["input_shape"] == shape and f["input_rank"] == len(shape)
    assert ("input_d" in f) == (len(shape) == 5)
    layout = NCHW_LAYOUTS[len(shape)]
    named = {"n": n, "c": c, "d": d, "h": h, "w": w}
    assert [named[k] for k in layout] == list(shape)  # each dim is the letter its layout gives it
    assert all(named[k] == 1 for k in "nchw" if k not in layout)
    if len(shape) == 4:
        assert (n, c, h, w) == shape
    if len(shape) >= 3:
        assert w == shape[-1]  # W is the last dim of a signal, an image and a volume


@given(st.sampled_from([0, 6, 7]))
def test_ranks_without_a_layout_build_no_nchw_facts(rank: int) -> None:
    f = shape_facts(TensorType((2,) * rank, DType.qint8))
    assert not {"input_n", "input_c", "input_h", "input_w", "input_d", "in_channels"} & set(f)
    assert f["input_rank"] == rank


@given(st.integers(1, 5), st.data())
def test_reduce_axes_are_nchw_positions(rank: int, data: st.DataObject) -> None:
    dim = data.draw(st.integers(-rank, rank - 1))
    axis = nchw_axis(dim, rank)
    letter = NCHW_LAYOUTS[rank][dim % rank]
    assert axis == {"n": 0, "c": 1, "h": 2, "w": 3}.get(letter)
    assert nchw_axis(rank, rank) is None and nchw_axis(0, 6) is None


class _Head(nn.Module):
    """A detection head's output: (N, C, H, W) -> permute -> (N, H*W*A, k), concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(8, 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.q(x)).permute(0, 2, 3, 1).reshape(x.shape[0], -1, 6)
        return self.dq(torch.cat([y, y], dim=1))


def _converted(x: torch.Tensor) -> nn.Module:
    with march_scope("bayes"):
        qat = prepare_qat_fx(_Head(), {"": get_default_qat_qconfig()})
        qat(x)
        return convert_fx(qat.eval())


def test_rank3_cat_is_checked_per_element_and_compiles() -> None:
    x = torch.rand(1, 8, 16, 16)  # cat input (1, 256, 6): 1,536 elements per batch
    model = _converted(x)
    report = check_model(model, x, march="bayes")
    assert report.ok, str(report)
    program = compile_model(model, [x], march="bayes")
    assert torch.equal(program(x), model(x))


def test_rank3_cat_over_the_bound_reports_its_element_count() -> None:
    x = torch.rand(1, 8, 128, 96)  # cat input (1, 12288, 6): 73,728 > 65536 per batch
    report = check_model(_converted(x), x, march="bayes")
    found = [v for v in report.violations if v.rule == "HWC<=65536"]
    assert len(found) == 1 and found[0].actual == 12288 * 6
