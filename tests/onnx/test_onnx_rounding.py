"""Ties: qir fake quant rounds half up, ONNX QuantizeLinear half to even (docs/onnx.md).

One export serves every test here (exports cost seconds): a module whose outputs are an int8
and an int16 fake quant of exact ties, a disabled fake quant, and an observed per-channel weight.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from onnx_testing import initializer, load, quantize_nodes, run_ort, ties

from qir.quantization import FakeQuantize, MovingAveragePerChannelMinMaxObserver
from qir.utils.onnx_helper import export_to_onnx

SCALE = 2.0**-3
RANGES = {"qint8": (-128, 127), "qint16": (-32768, 32767)}


def tie_codes(qmin: int, qmax: int) -> torch.Tensor:
    """k for x / scale = k + 1/2 across the whole range and a little beyond."""
    return torch.cat([torch.arange(qmin - 3, qmin + 300), torch.arange(-300, 300), torch.arange(qmax - 300, qmax + 3)])


class QatWeight(nn.Module):
    """The QAT modules' convention: ``weight_fake_quant`` applied to ``weight`` (scaled first when ``fold``)."""

    def __init__(self, seed: int, fold: float | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 8, 3, 3, generator=torch.Generator().manual_seed(seed)))
        self.weight_fake_quant = FakeQuantize(MovingAveragePerChannelMinMaxObserver, ch_axis=0)
        self.fold = fold
        self.weight_fake_quant(self.effective_weight().detach())
        self.weight_fake_quant.disable_observer()

    def effective_weight(self) -> torch.Tensor:
        return self.weight if self.fold is None else self.weight * self.fold

    def forward(self) -> torch.Tensor:
        return self.weight_fake_quant(self.effective_weight())


class TieProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fq8 = FakeQuantize(dtype="qint8")
        self.fq16 = FakeQuantize(dtype="qint16")
        self.off = FakeQuantize()
        for fq in (self.fq8, self.fq16, self.off):
            fq.scale.fill_(SCALE)
        self.off.disable_fake_quant()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(16, 8, 3, 3))
        self.wfq = FakeQuantize(MovingAveragePerChannelMinMaxObserver, ch_axis=0)
        self.wfq(self.w.detach())  # observed: scale = amax / 127.5 per channel
        for fq in (self.fq8, self.fq16, self.off, self.wfq):
            fq.disable_observer()
        self.direct = QatWeight(seed=1)
        self.folded = QatWeight(seed=2, fold=0.75)  # like a BN-folded weight: not the parameter itself

    def forward(self, x8: torch.Tensor, x16: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fq8(x8), self.fq16(x16), self.off(x8), self.wfq(self.w), self.direct(), self.folded()


#: (model, inputs, onnxruntime outputs, path)
Probe = tuple[TieProbe, tuple[torch.Tensor, ...], list[np.ndarray], Path]


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Probe:
    model = TieProbe().eval()
    xs = tuple(((tie_codes(*RANGES[d]).double() + 0.5) * SCALE).float().reshape(1, -1) for d in ("qint8", "qint16"))
    path = tmp_path_factory.mktemp("ties") / "ties.onnx"
    export_to_onnx(model, xs, path)
    return model, xs, run_ort(path, *xs), path


@pytest.mark.parametrize(("index", "dtype"), [(0, "qint8"), (1, "qint16")])
def test_ties_differ_by_one_lsb_where_the_lower_code_is_even(probe: Probe, index: int, dtype: str) -> None:
    model, xs, got, _ = probe
    qmin, qmax = RANGES[dtype]
    k = tie_codes(qmin, qmax)
    assert ties(xs[index], torch.tensor(SCALE)).all()
    with torch.no_grad():
        want = model(*xs)[index].numpy()
    diff = (want.astype(np.float64) - got[index].astype(np.float64)) / SCALE  # exact: SCALE is a power of two
    # half up takes k + 1, half to even takes k when k is even; saturation hides the edge ties
    even = (k % 2 == 0) & (k >= qmin) & (k + 1 <= qmax)
    np.testing.assert_array_equal(diff.reshape(-1), even.numpy().astype(np.float64))


def test_disabled_fake_quant_is_identity(probe: Probe) -> None:
    _, xs, got, path = probe
    np.testing.assert_array_equal(got[2], xs[0].numpy())
    assert len(quantize_nodes(load(path))) == 5  # fq8, fq16, wfq and two weights; the disabled one left no pair


def test_observed_weight_extremes_are_ties(probe: Probe) -> None:
    """scale = amax / 127.5, so a channel whose extreme is negative holds x / scale = -127.5:
    qir gives -127, ONNX -128. Nothing else in the weight differs."""
    model, xs, got, _ = probe
    lsb = model.wfq.scale.reshape(-1, 1, 1, 1).numpy()
    with torch.no_grad():
        want = model(*xs)[3].numpy()
    diff = np.rint(want / lsb) - np.rint(got[3] / lsb)  # in codes
    tie = ties(model.w.detach(), model.wfq.scale, axis=0).numpy()
    assert np.all(diff[~tie] == 0)
    assert set(np.unique(diff[tie]).tolist()) <= {0.0, 1.0}  # -127 (qir) against -128 (ONNX)
    assert (diff == 1).any()  # plain randn weights do hit it


def codes(x: np.ndarray | torch.Tensor, fq: FakeQuantize) -> np.ndarray:
    return np.rint(np.asarray(x) / fq.scale.reshape(-1, 1, 1, 1).numpy())


def test_qat_weights_are_exported_pre_rounded(probe: Probe) -> None:
    """``m.weight_fake_quant(m.weight)``: the initializer holds qir's fake-quantized weight, so
    onnxruntime's codes equal qir's even at the ties; a fake quant fed anything else keeps the
    float weight (and the tie behaviour of the test above)."""
    model, xs, got, path = probe
    onnx_model = load(path)
    with torch.no_grad():
        want = model(*xs)
    direct, folded = model.direct, model.folded
    assert ties(direct.weight.detach(), direct.weight_fake_quant.scale, axis=0).any()
    np.testing.assert_array_equal(got[4], want[4].numpy())
    np.testing.assert_array_equal(initializer(onnx_model, "direct.weight"), want[4].numpy())
    np.testing.assert_array_equal(initializer(onnx_model, "direct.weight"), got[4])
    assert not direct.weight.detach().equal(want[4])  # the model's own weight is untouched
    # folded: the fake quant's input is the float folded weight, as the model computes it (the
    # optimizer folds weight * 0.75 into an initializer)
    (node,) = [
        n
        for n in quantize_nodes(onnx_model)
        if np.array_equal(initializer(onnx_model, n.input[1]), folded.weight_fake_quant.scale.numpy())
    ]
    np.testing.assert_array_equal(initializer(onnx_model, node.input[0]), folded.effective_weight().detach().numpy())
    diff = codes(want[5], folded.weight_fake_quant) - codes(got[5], folded.weight_fake_quant)
    assert set(np.unique(diff).tolist()) <= {0.0, 1.0}
