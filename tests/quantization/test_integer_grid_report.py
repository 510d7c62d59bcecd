"""integer_grid_report counts what each bound module's QAT forwards did: a module whose grid forward
did not apply to a call (and ran the float fake quantization instead) is reported as such, not as
"grid"; calibration and validation forwards are not training steps and do not count."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from qir.march import march_scope
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    DeQuantStub,
    FakeQuantState,
    QuantStub,
    get_default_qat_qconfig,
    integer_grid_report,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.integer_grid import GridTally, bind_integer_grid
from qir.quantization.prepare_checks import UnconvertibleModelError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from bitexact_models import chain, randomize_bn


class _Norms(nn.Module):
    """Two LayerNorms: ``big`` has an eps the integer rule cannot take at a small input scale
    (``eps * N**2 / s_in**2 >= 2**59``), so its grid forward falls back; ``ok`` stays on the grid."""

    def __init__(self) -> None:
        super().__init__()
        self.q = QuantStub()
        self.ok = nn.LayerNorm(8)
        self.big = nn.LayerNorm(8, eps=1e12)
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.q(x)
        return self.dq(self.ok(x) + self.big(x))


class _AddNumber(nn.Module):
    """``x + k`` with the number ``k`` an argument of the call: a NaN has no integer code."""

    def __init__(self) -> None:
        super().__init__()
        self.q = QuantStub()
        self.ff = FloatFunctional()
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor, k: float) -> torch.Tensor:
        return self.dq(self.ff.add_scalar(self.q(x), k))


def _prepare(model: nn.Module, march: str = "bayes") -> nn.Module:
    with march_scope(march):
        return prepare_qat_fx(model, {"": get_default_qat_qconfig()}).train()


def test_a_layer_norm_that_falls_back_is_reported_with_its_count() -> None:
    torch.manual_seed(0)
    qat = _prepare(_Norms())
    assert integer_grid_report(qat)["big"] == "grid"  # bound; nothing ran yet
    x = torch.randn(2, 5, 8) * 1e-3
    qat(x).sum().backward()
    report = integer_grid_report(qat)
    assert report["ok"] == "grid"
    assert report["big"] == "float fake quant in 1 of 1 forwards since binding", report
    qat(x)
    assert integer_grid_report(qat)["big"] == "float fake quant in 2 of 2 forwards since binding"


def test_add_scalar_of_a_nan_falls_back_in_that_step_only() -> None:
    qat = _prepare(_AddNumber())
    x = torch.randn(2, 4)
    qat(x, 0.5)
    assert integer_grid_report(qat)["ff"] == "grid"
    qat(x, math.nan)
    qat(x, 0.25)
    assert integer_grid_report(qat)["ff"] == "float fake quant in 1 of 3 forwards since binding"


def test_validation_and_calibration_forwards_are_not_counted() -> None:
    qat = _prepare(_AddNumber())
    x = torch.randn(2, 4)
    qat(x, 0.5)
    set_fake_quantize(qat, FakeQuantState.CALIBRATION)  # float forwards: a NaN falls back, uncounted
    with pytest.warns(RuntimeWarning, match="skipped batches holding NaN"):
        qat(x, math.nan)
        set_fake_quantize(qat, FakeQuantState.VALIDATION)  # the integer twin runs
    qat.eval()(x, 0.5)
    assert qat.get_submodule("ff").__dict__["integer_grid_tally"] == GridTally(on_grid=1, fell_back=0)
    assert integer_grid_report(qat)["ff"] == "grid"


def test_a_pool_the_march_cannot_requantize_this_step_is_reported() -> None:
    # the first steps' global pool output range is over 255x narrower than its input's, a ratio
    # Bernoulli2 cannot requantize: the pool runs the float fake quant of the exact mean that step
    spec = [("conv", 2, 1, 1), ("convrelu", 9, 1, 2), ("convbn", 8, 3, 1), ("convbnrelu", 7, 3, 2)]
    spec += [("convrelu", 2, 3, 2), ("maxpool", 2, 1, 2)]
    torch.manual_seed(0)
    qat = _prepare(randomize_bn(chain(spec, 3, "conv"), 0), "bernoulli2")
    g = torch.Generator().manual_seed(0)
    with pytest.warns(RuntimeWarning, match="cannot requantize on bernoulli2"):
        for _ in range(3):
            qat(torch.randn(3, 3, 12, 12, generator=g)).sum().backward()
    report = integer_grid_report(qat)
    pools = [p for p, r in report.items() if r.startswith("float fake quant in ")]
    assert pools and all(report[p].endswith(" of 3 forwards since binding") for p in pools), report
    assert all(r == "grid" for p, r in report.items() if p not in pools), report


class _Attention(nn.Module):
    """A linear feeding nn.MultiheadAttention (``p``: its dropout)."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.q = QuantStub()
        self.fc = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2, dropout=p, batch_first=True)
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.q(x))
        return self.dq(self.attn(h, h, h)[0])


class _Cells(nn.Module):
    """Two LSTM cells, the second reading the first's (h, c)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = QuantStub()
        self.cell0, self.cell1 = nn.LSTMCell(4, 6), nn.LSTMCell(4, 6)
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.q(x)
        h, c = self.cell0(x[0])
        h, c = self.cell1(x[1], (h, c))
        return self.dq(h)


def test_an_attention_convert_refuses_is_reported_not_grid() -> None:
    # qint16 projections: bound (the scales are known), but Bernoulli2 has no qint16 output, so the
    # integer module cannot be built and the call keeps the float forward
    torch.manual_seed(0)
    q16 = get_default_qat_qconfig(dtype="qint16")
    with march_scope("bernoulli2"):
        qat = prepare_qat_fx(
            _Attention(),
            {"": get_default_qat_qconfig(), "module_name": {"attn": q16}},
            example_inputs=(torch.randn(2, 5, 8),),
        ).train()
    assert integer_grid_report(qat) == {"fc": "grid", "attn": "grid"}  # bound; nothing ran yet
    with pytest.warns(RuntimeWarning, match="MultiheadAttention has no integer form this step"):
        qat(torch.randn(2, 5, 8)).sum().backward()
    assert integer_grid_report(qat) == {"fc": "grid", "attn": "float fake quant in 1 of 1 forwards since binding"}


def test_attention_dropout_in_training_is_reported_and_eval_is_not_counted() -> None:
    torch.manual_seed(0)
    with march_scope("bayes"):
        qat = prepare_qat_fx(_Attention(0.1), {"": get_default_qat_qconfig()}, example_inputs=(torch.randn(2, 5, 8),))
    x = torch.randn(2, 5, 8)
    qat.train()(x)
    qat.eval()(x)  # QAT state under eval: no dropout, on the grid
    assert integer_grid_report(qat)["attn"] == "float fake quant in 1 of 2 forwards since binding"


def test_lstm_cells_convert_refuses_are_reported_not_grid() -> None:
    torch.manual_seed(0)
    with march_scope("bernoulli2"):  # the cell state is qint16, which Bernoulli2 cannot output: refused at prepare
        with pytest.raises(UnconvertibleModelError, match=r"module 'cell0' \(LSTMCell\) keeps its cell state"):
            prepare_qat_fx(_Cells(), {"": get_default_qat_qconfig()}, example_inputs=(torch.randn(2, 3, 4),))
    with march_scope("bayes"):
        qat = prepare_qat_fx(_Cells(), {"": get_default_qat_qconfig()}, example_inputs=(torch.randn(2, 3, 4),)).train()
    bind_integer_grid(qat, "bernoulli2")  # bound for a march its cells cannot convert to: each call falls back
    with pytest.warns(RuntimeWarning, match="LSTMCell has no integer form this step"):
        qat(torch.randn(2, 3, 4))
        qat(torch.randn(2, 3, 4))
    fell = "float fake quant in 2 of 2 forwards since binding"
    assert integer_grid_report(qat) == {"cell0": fell, "cell1": fell}
    with march_scope("bayes"):
        qat = prepare_qat_fx(_Cells(), {"": get_default_qat_qconfig()}, example_inputs=(torch.randn(2, 3, 4),)).train()
    qat(torch.randn(2, 3, 4))
    assert integer_grid_report(qat) == {"cell0": "grid", "cell1": "grid"}
