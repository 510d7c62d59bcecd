"""An FCOS-style head as the toolkit's heads are written: ``forward(self, feats)`` takes the list
of FPN levels, checks it with ``assert len(feats) == len(self.strides)``, and runs one shared
conv tower over ``for i, feat in enumerate(feats)`` with a per-level ``Scale``-like learned
multiplier, returning lists of per-level outputs. Calibration -> QAT -> convert -> check ->
compile -> run.

With ``example_inputs`` the list's length is known while tracing: the forward gets a real list
(``len``, ``enumerate``, ``zip`` work) of getitems of one input (fx failed on the assert:
"symbolically traced variables cannot be used as inputs to control flow"). Without it, the
error says to pass them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from names_flow import fx_flow
from torch import nn

from backends.common.runtime import InputError
from qir.frontend.tracer import TraceError
from qir.march import March, march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    compile_model,
    get_default_qat_qconfig,
    load_compiled,
    prepare_qat_fx,
)


class FCOSHead(nn.Module):
    def __init__(self, c: int = 8, classes: int = 3, strides: tuple[int, ...] = (8, 16, 32)) -> None:
        super().__init__()
        self.strides = strides
        self.quants = nn.ModuleList(QuantStub() for _ in strides)
        self.tower = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.cls = nn.Conv2d(c, classes, 3, padding=1)
        self.reg = nn.Conv2d(c, 4, 3, padding=1)
        self.dequant = nn.ModuleList(DeQuantStub() for _ in range(2 * len(strides)))

    def forward(self, feats: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        assert len(feats) == len(self.strides), f"expected {len(self.strides)} levels, got {len(feats)}"
        cls_out, reg_out = [], []
        for i, feat in enumerate(feats):
            t = self.tower(self.quants[i](feat))
            cls_out.append(self.dequant[2 * i](self.cls(t)))
            reg_out.append(self.dequant[2 * i + 1](torch.relu(self.reg(t))))
        return cls_out, reg_out


def _levels() -> tuple[list[torch.Tensor]]:
    return ([torch.randn(2, 8, s, s) for s in (16, 8, 4)],)


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def test_a_list_of_levels_traces_with_its_length_checked() -> None:
    qat = prepare_qat_fx(FCOSHead().eval(), {"": get_default_qat_qconfig()}, example_inputs=_levels())
    placeholders = [n for n in qat.graph.nodes if n.op == "placeholder"]
    assert [str(n.target) for n in placeholders] == ["feats"]  # still one input taking the whole list
    cls_out, reg_out = qat(*_levels())
    assert [tuple(o.shape) for o in cls_out] == [(2, 3, s, s) for s in (16, 8, 4)]
    assert len(reg_out) == 3


def test_without_example_inputs_the_error_says_to_pass_them() -> None:
    with pytest.raises(TraceError, match=r"assert len\(feats\)(.|\n)*pass example_inputs"):
        prepare_qat_fx(FCOSHead().eval(), {"": get_default_qat_qconfig()})


def test_the_list_head_calibrates_trains_converts_and_compiles() -> None:
    result = fx_flow(FCOSHead().eval(), _levels, steps=2, example_inputs=True)
    cls_out, reg_out = result.integer_out
    assert [tuple(o.shape) for o in reg_out] == [(2, 4, s, s) for s in (16, 8, 4)]
    assert [tuple(o.shape) for o in cls_out] == [(2, 3, s, s) for s in (16, 8, 4)]
    lsb = max(
        float(m.activation_post_process.scale)
        for n, m in result.qat.named_modules()
        if n.startswith(("cls", "reg")) and getattr(m, "activation_post_process", None) is not None
    )
    assert result.max_error() <= 2.01 * lsb
    # the forward read the list's length: the converted model refuses a list of another length
    with pytest.raises(ValueError, match=r"input 'feats' has 2 elements, but the model was traced for 3"):
        result.converted(_levels()[0][:2])


def test_the_compiled_head_checks_the_list_length_and_each_level_shape(tmp_path: Path) -> None:
    result = fx_flow(FCOSHead().eval(), _levels, steps=1, example_inputs=True)
    levels = result.inputs[0]
    compile_model(result.converted, list(result.inputs), hbm=tmp_path / "head.hbm")
    loaded = load_compiled(tmp_path / "head.hbm")  # the memory bound is computed from the declared list
    assert loaded.program.meta["input_shapes"] == [{"items": [list(t.shape) for t in levels]}]
    got, want = loaded(levels), result.converted(levels)
    assert all(torch.equal(a, b) for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True))
    # as the converted model does, the program refuses a list of another length (it indexed a missing
    # level, or silently dropped the extra one, before) and a level of another size
    with pytest.raises(InputError, match=r"input 0 has 2 elements, but the model was compiled for 3"):
        loaded(levels[:2])
    with pytest.raises(InputError, match=r"input 0 has 4 elements"):
        loaded([*levels, levels[0]])
    with pytest.raises(InputError, match=r"must be a list or tuple of 3 tensors, got Tensor"):
        loaded(levels[0])
    with pytest.raises(InputError, match=r"input 0\[1\] has shape \[2, 8, 5, 5\]; it was compiled for \[2, 8, 8, 8\]"):
        loaded([levels[0], torch.randn(2, 8, 5, 5), levels[2]])
    assert all(o.shape[0] == 1 for o in loaded([t[:1] for t in levels])[0])  # the batch stays free
