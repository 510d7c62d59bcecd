"""prepare_qat_fx refuses, before any calibration or training, a float module with a qconfig that
has no quantized form and receives quantized tensors (``nn.GroupNorm``, ``nn.LSTM``, an unfused
batch norm), and an ``nn.LSTMCell`` on Bernoulli2 (no qint16 cell state); convert_fx used to
refuse them after training, with advice that did not fit. A module whose qconfig is None (by
``module_name`` or by a ``.qconfig = None`` attribute, as torch's propagation reads it) is kept
float on purpose and prepares as before."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import qir.nn.qat as qat_nn
from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.convert import ConvertError
from qir.quantization.debug import check_qconfig
from qir.quantization.prepare_checks import UnconvertibleModelError


@pytest.fixture(params=["bayes", "bernoulli2"])
def march(request: pytest.FixtureRequest) -> Iterator[str]:
    torch.manual_seed(0)
    with march_scope(request.param):
        yield request.param


class Middle(nn.Module):
    """conv -> ``mid`` -> conv, all on quantized tensors unless ``float_mid`` puts stubs around it."""

    def __init__(self, mid: nn.Module, float_mid: bool = False) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.mid = mid
        self.float_mid = float_mid
        self.mid_dequant, self.mid_quant = DeQuantStub(), QuantStub()
        self.head = nn.Conv2d(8, 8, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.quant(x))
        if self.float_mid:
            y = self.mid_quant(self.mid(self.mid_dequant(y)))
        else:
            y = self.mid(y)
        return self.dequant(self.head(y))


class Sequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.rnn = nn.LSTM(8, 8)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.rnn(self.quant(x))[0])


def _x() -> torch.Tensor:
    return torch.randn(2, 4, 6, 6)


def test_a_module_without_a_quantized_form_is_refused_at_prepare(march: str) -> None:
    with pytest.raises(UnconvertibleModelError) as caught:
        prepare_qat_fx(Middle(nn.GroupNorm(2, 8)), {"": get_default_qat_qconfig()}, (_x(),))
    message = str(caught.value)
    assert caught.value.where == "mid"
    assert "module 'mid' (GroupNorm) receives quantized tensors and has a qconfig" in message
    assert f"no quantized form on {march}" in message
    assert "qconfig_dict={'module_name': [('mid', None)]}" in message and "DeQuantStub before it" in message
    assert "hybrid=True" in message
    with pytest.raises(UnconvertibleModelError, match=r"module 'rnn' \(LSTM\).*unroll the sequence over cells"):
        prepare_qat_fx(Sequence(), {"": get_default_qat_qconfig()}, (torch.randn(3, 2, 8),))
    model = Middle(nn.InstanceNorm2d(8))
    model.qconfig = get_default_qat_qconfig()  # the qconfig from an attribute: refused the same
    with pytest.raises(UnconvertibleModelError, match=r"module 'mid' \(InstanceNorm2d\)"):
        prepare_qat_fx(model, example_inputs=(_x(),))


def test_the_fix_the_refusal_gives_converts(march: str) -> None:
    model = Middle(nn.GroupNorm(2, 8), float_mid=True)
    qat = prepare_qat_fx(model, {"": get_default_qat_qconfig(), "module_name": [("mid", None)]}, (_x(),))
    for _ in range(2):
        qat(_x())
    qat.eval()
    set_fake_quantize(qat, "validation")
    x = _x()
    assert torch.equal(qat(x), convert_fx(qat)(x))
    hybrid = prepare_qat_fx(Middle(nn.GroupNorm(2, 8)), {"": get_default_qat_qconfig()}, (_x(),), hybrid=True)
    assert type(hybrid.mid) is nn.GroupNorm  # placed on the CPU, behind generated stubs


def test_qconfig_none_keeps_a_module_float_on_purpose(march: str) -> None:
    """Kept float deliberately (``module_name`` None, or a ``.qconfig = None`` attribute): prepare
    leaves it to convert, which still names it when it receives quantized tensors."""
    by_name = prepare_qat_fx(
        Middle(nn.GroupNorm(2, 8)), {"": get_default_qat_qconfig(), "module_name": [("mid", None)]}, (_x(),)
    )
    model = Middle(nn.GroupNorm(2, 8))
    model.qconfig = get_default_qat_qconfig()
    model.mid.qconfig = None
    by_attr = prepare_qat_fx(model, example_inputs=(_x(),))
    for qat in (by_name, by_attr):
        qat(_x())
        qat.eval()
        set_fake_quantize(qat, "validation")
        with pytest.raises(ConvertError, match=r"module 'mid' \(GroupNorm\) receives quantized tensors") as caught:
            convert_fx(qat)
        # no qconfig would help it: the advice is the stubs
        assert "GroupNorm has no quantized form" in str(caught.value) and "give it a qconfig" not in str(caught.value)
        # prepare's refusal and convert's use one wording (prepare_checks.float_module_on_codes)
        for phrase in (
            "GroupNorm has no quantized form (no QAT class in qir.nn.qat.QAT_MODULE_MAP)",
            "put a DeQuantStub before it and a QuantStub after it; or prepare with hybrid=True, which places it",
        ):
            assert phrase in str(caught.value)
            with pytest.raises(UnconvertibleModelError, match=re.escape(phrase.replace("form", f"form on {march}"))):
                prepare_qat_fx(Middle(nn.GroupNorm(2, 8)), {"": get_default_qat_qconfig()}, (_x(),))


def test_a_qconfig_none_attribute_is_not_inherited_over(march: str) -> None:
    """``child.qconfig = None`` under a parent's qconfig keeps the child float, as torch's
    propagate_qconfig_ reads it (it inherited the parent's before); a stub's constructor None inherits."""
    model = Middle(nn.Conv2d(8, 8, 1))
    model.qconfig = get_default_qat_qconfig()
    model.mid.qconfig = None
    qat = prepare_qat_fx(model, example_inputs=(_x(),))
    assert type(qat.mid) is nn.Conv2d and isinstance(qat.head, qat_nn.Conv2d)
    assert isinstance(qat.quant, qat_nn.QuantStub)
    qat(_x())
    qat.eval()
    set_fake_quantize(qat, "validation")
    with pytest.raises(ConvertError, match=r"module 'mid' \(Conv2d\).*its qconfig is None.*give it a qconfig"):
        convert_fx(qat)


def test_lstm_cell_on_bernoulli2_is_refused_at_prepare(march: str) -> None:
    class Cell(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.cell = nn.LSTMCell(4, 8)
            self.dequant = DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.cell(self.quant(x))[0])

    x = torch.randn(2, 4)
    if march == "bayes":
        qat = prepare_qat_fx(Cell(), {"": get_default_qat_qconfig()}, (x,))
        assert isinstance(qat.cell, qat_nn.LSTMCell)
        return
    with pytest.raises(UnconvertibleModelError) as caught:
        prepare_qat_fx(Cell(), {"": get_default_qat_qconfig()}, (x,))
    assert "module 'cell' (LSTMCell) keeps its cell state" in str(caught.value)
    assert "cell_post_process" in str(caught.value) and "bernoulli2 requantizes to qint8 only" in str(caught.value)
    kept = prepare_qat_fx(Cell(), {"": get_default_qat_qconfig(), "module_name": [("cell", None)]}, (x,))
    assert type(kept.cell) is nn.LSTMCell


def test_check_qconfig_reports_the_refusals(march: str) -> None:
    report = check_qconfig(Middle(nn.GroupNorm(2, 8)), _x(), {"": get_default_qat_qconfig()}, march=march)
    (found,) = report.of_kind("unconvertible")
    assert found.where == "mid" and "GroupNorm" in found.message and not report.ok


def test_eager_prepare_reads_a_qconfig_none_attribute_as_fx_does(march: str) -> None:
    """The same model, the same attributes: eager ``prepare_qat`` keeps ``mid`` float (it and what it
    holds) like ``prepare_qat_fx``; the stubs' constructor None still inherits."""
    from qir.quantization import prepare_qat

    model = Middle(nn.Sequential(nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 1)))
    model.qconfig = get_default_qat_qconfig()
    model.mid.qconfig = None
    eager = prepare_qat(model)
    fx = prepare_qat_fx(model, example_inputs=(_x(),))
    for qat in (eager, fx):
        assert all(type(m) is nn.Conv2d for m in qat.mid.children())
        assert isinstance(qat.conv, qat_nn.Conv2d) and isinstance(qat.head, qat_nn.Conv2d)
        assert isinstance(qat.quant, qat_nn.QuantStub)
    assert model.mid.qconfig is None and type(model.conv) is nn.Conv2d  # the user's model untouched
