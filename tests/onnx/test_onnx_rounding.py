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

from onnx_testing import load, quantize_nodes, run_ort, ties

from qir.quantization import FakeQuantize, MovingAveragePerChannelMinMaxObserver
from qir.utils.onnx_helper import export_to_onnx

SCALE = 2.0**-3
RANGES = {"qint8": (-128, 127), "qint16": (-32768, 32767)}


def tie_codes(qmin: int, qmax: int) -> torch.Tensor:
    """k for x / scale = k + 1/2 across the whole range and a little beyond."""
    return torch.cat([torch.arange(qmin - 3, qmin + 300), torch.arange(-300, 300), torch.arange(qmax - 300, qmax + 3)])


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

    def forward(self, x8: torch.Tensor, x16: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fq8(x8), self.fq16(x16), self.off(x8), self.wfq(self.w)


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
    assert len(quantize_nodes(load(path))) == 3  # fq8, fq16, wfq; the disabled one left no pair


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
