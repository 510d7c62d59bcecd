"""LSTMCell: QAT module (float checkpoints load, fake quants where the integer form quantizes)
and the integer module's agreement with it, stage by stage and end to end (docs/semantics.md
"LSTMCell")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backends.common import numerics
from qir.march import march_scope
from qir.nn import qat, quantized
from qir.nn.qat.lstm import LSTM_FQ_DTYPES
from qir.quantization import DeQuantStub, QuantStub, convert, get_default_qat_qconfig, prepare_qat, set_fake_quantize
from qir.quantization.fake_quantize import disable_fake_quant

QC = get_default_qat_qconfig()


def _deq(q: torch.Tensor, s: float) -> torch.Tensor:
    return numerics.dequantize(q, torch.tensor([s]))


def _qz(t: torch.Tensor, s: float, dtype: str) -> torch.Tensor:
    return numerics.quantize(t, torch.tensor([s]), dtype)


def _pair(
    seed: int, state: bool, hdt: str = "qint8", isz: int = 32, hsz: int = 64, n: int = 512
) -> tuple[qat.LSTMCell, quantized.LSTMCell, tuple[torch.Tensor, ...], tuple[float, ...]]:
    """A calibrated QAT cell, its integer form, and input codes (x, h, c) of realistic ranges."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    m = qat.LSTMCell.from_float(nn.LSTMCell(isz, hsz), get_default_qat_qconfig(dtype=hdt))

    def sample() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            torch.randn(n, isz, generator=g),
            0.8 * torch.tanh(torch.randn(n, hsz, generator=g)),
            1.5 * torch.randn(n, hsz, generator=g),
        )

    x, h, c = sample()
    scales = (float(x.abs().max() / 127.5), float(h.abs().max() / 127.5), float(c.abs().max() / 32767.5))
    sx, sh, sc = scales
    with torch.no_grad():
        for _ in range(3):
            xs, hs, cs = sample()
            hx = (_deq(_qz(hs, sh, "qint8"), sh), _deq(_qz(cs, sc, "qint16"), sc)) if state else None
            m(_deq(_qz(xs, sx, "qint8"), sx), hx)
    set_fake_quantize(m, "validation")
    m.eval()
    q = quantized.LSTMCell.from_qat(m, list(scales) if state else [sx], "bayes")
    codes = (_qz(x, sx, "qint8"), _qz(h, sh, "qint8"), _qz(c, sc, "qint16"))
    return m, q, codes, scales


def _lsb(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.to(torch.int64) - b.to(torch.int64)).abs()


def test_float_checkpoint_loads_and_keys_match() -> None:
    f = nn.LSTMCell(5, 7)
    m = qat.LSTMCell.from_float(f, QC)
    keys = set(m.state_dict())
    assert set(f.state_dict()) <= keys
    fresh = qat.LSTMCell(5, 7, qconfig=QC)
    missing, unexpected = fresh.load_state_dict(f.state_dict(), strict=False)
    assert not unexpected and all("post_process" in k or "fake_quant" in k or "cell_tanh_input" in k for k in missing)
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        assert torch.equal(getattr(fresh, name), getattr(f, name))
    assert {n: str(getattr(m, n).dtype.name) for n in LSTM_FQ_DTYPES}["cell_post_process"] == "qint16"


def test_qat_without_fake_quant_is_the_float_cell() -> None:
    f = nn.LSTMCell(5, 7)
    m = qat.LSTMCell.from_float(f, QC)
    disable_fake_quant(m)
    x, h, c = torch.randn(3, 5), torch.randn(3, 7), torch.randn(3, 7)
    for hx in ((h, c), None):
        want = f(x, hx)
        got = m(x, hx)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_refuses_non_2d_input_and_the_other_call_form() -> None:
    m, q, (x, _, _), _ = _pair(0, state=True, isz=4, hsz=4, n=8)
    with pytest.raises(ValueError, match="2-dimensional"):
        m(torch.randn(1, 2, 4))
    with pytest.raises(ValueError, match=r"converted for calls with \(h, c\).*one module instance per call form"):
        q(x)


@pytest.mark.parametrize("state", [True, False], ids=["state", "zeros"])
def test_each_stage_within_one_lsb(state: bool) -> None:
    """Same input codes: the gates within 1 LSB; from the same gate codes, c' within 3 LSB (two
    requantized products and the add) and 2 LSB without a state (one product)."""
    for seed in range(3):
        m, q, (x, h, c), (sx, sh, sc) = _pair(seed, state)
        hx_f = (_deq(h, sh), _deq(c, sc)) if state else None
        with torch.no_grad():
            gf = m.gates(_deq(x, sx), hx_f)
            gq = numerics.quantize(gf, m.gates_post_process.scale, "qint8")
            assert int(_lsb(q.gates(x, (h, c) if state else None), gq).max()) <= 1
            _, c_int = q.state_from_gates(gq, c if state else None)
            _, c_qat = m.state_from_gates(gf, hx_f[1] if hx_f is not None else None)
        c_want = numerics.quantize(c_qat, m.cell_post_process.scale, "qint16")
        assert int(_lsb(c_int, c_want).max()) <= (3 if state else 2)


#: measured maxima (docs/semantics.md "LSTMCell"): h' in qint8 LSB, c' in qint16 LSB
END_TO_END = {True: (4, 187), False: (3, 575)}


@pytest.mark.parametrize("state", [True, False], ids=["state", "zeros"])
def test_converted_within_measured_bound_of_qat(state: bool) -> None:
    bh, bc = END_TO_END[state]
    for seed in range(4):
        m, q, (x, h, c), (sx, sh, sc) = _pair(seed, state)
        with torch.no_grad():
            h_int, c_int = q(x, (h, c) if state else None)
            h_qat, c_qat = m(_deq(x, sx), (_deq(h, sh), _deq(c, sc)) if state else None)
        assert h_int.dtype == torch.int8 and c_int.dtype == torch.int16
        assert int(_lsb(h_int, numerics.quantize(h_qat, m.activation_post_process.scale, "qint8")).max()) <= bh
        assert int(_lsb(c_int, numerics.quantize(c_qat, m.cell_post_process.scale, "qint16")).max()) <= bc


class _EagerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qx, self.qh, self.qc = QuantStub(), QuantStub(), QuantStub()
        self.cell = nn.LSTMCell(6, 5)
        self.dh, self.dc = DeQuantStub(), DeQuantStub()

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h2, c2 = self.cell(self.qx(x), (self.qh(h), self.qc(c)))
        return self.dh(h2), self.dc(c2)


def test_eager_flow_converts_the_cell() -> None:
    net = _EagerNet()
    net.qconfig = QC
    ins = (torch.randn(4, 6), 0.8 * torch.tanh(torch.randn(4, 5)), torch.randn(4, 5))
    with march_scope("bayes"):
        prepared = prepare_qat(net)
        prepared(*ins)
        set_fake_quantize(prepared, "validation")
        converted = convert(prepared.eval())
    assert isinstance(converted.cell, quantized.LSTMCell)
    with torch.no_grad():
        h_qat, c_qat = prepared(*ins)
        h_int, c_int = converted(*ins)
    # the end-to-end bound of the state call (qint8 h', qint16 c'), in values
    s_h = float(prepared.cell.activation_post_process.scale[0])
    s_c = float(prepared.cell.cell_post_process.scale[0])
    assert float((h_qat - h_int).abs().max()) <= END_TO_END[True][0] * s_h * 1.001
    assert float((c_qat - c_int).abs().max()) <= END_TO_END[True][1] * s_c * 1.001
