"""MultiheadAttention: QAT module (float checkpoints load, unsupported configurations refused)
and the integer module's agreement with it (docs/semantics.md "MultiheadAttention")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backends.common import numerics
from qir.nn import qat, quantized
from qir.quantization import get_default_qat_qconfig, set_fake_quantize
from qir.quantization.fake_quantize import disable_fake_quant

QC = get_default_qat_qconfig()


def _qz(t: torch.Tensor, s: float) -> torch.Tensor:
    return numerics.quantize(t, torch.tensor([s]), "qint8")


def _dq(q: torch.Tensor, s: float) -> torch.Tensor:
    return numerics.dequantize(q, torch.tensor([s]))


def test_float_checkpoint_loads_and_keys_match() -> None:
    f = nn.MultiheadAttention(16, 4)
    m = qat.MultiheadAttention.from_float(f, QC)
    assert set(f.state_dict()) <= set(m.state_dict())
    for k, v in f.state_dict().items():
        assert torch.equal(m.state_dict()[k], v)


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("batch_first", [True, False])
def test_qat_without_fake_quant_is_the_float_attention(batch_first: bool) -> None:
    f = nn.MultiheadAttention(16, 4, batch_first=batch_first).eval()
    m = qat.MultiheadAttention.from_float(f, QC).eval()
    disable_fake_quant(m)
    shape = (2, 5, 16) if batch_first else (5, 2, 16)
    q, k, v = (torch.randn(*shape) for _ in range(3))
    for avg in (True, False):
        want = f(q, k, v, need_weights=True, average_attn_weights=avg)
        got = m(q, k, v, need_weights=True, average_attn_weights=avg)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert m(q, q, q, need_weights=False)[1] is None
    bool_mask = torch.rand(5, 5) > 0.6
    bool_mask[:, 0] = False
    float_mask = torch.randn(5, 5).masked_fill(bool_mask, float("-inf"))
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1, 3:] = True
    for kw in ({"attn_mask": bool_mask}, {"key_padding_mask": kpm}, {"attn_mask": float_mask, "key_padding_mask": kpm}):
        for a, b in zip(m(q, k, v, **kw), f(q, k, v, **kw), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_unsupported_configurations_raise() -> None:
    for kwargs in ({"add_bias_kv": True}, {"add_zero_attn": True}, {"kdim": 8, "vdim": 8}):
        with pytest.raises(NotImplementedError, match="add_bias_kv, add_zero_attn and kdim / vdim"):
            qat.MultiheadAttention.from_float(nn.MultiheadAttention(16, 4, **kwargs), QC)
    m = qat.MultiheadAttention.from_float(nn.MultiheadAttention(16, 4), QC)
    x = torch.randn(5, 2, 16)
    with pytest.raises(NotImplementedError, match="is_causal is not implemented; pass the causal mask"):
        m(x, x, x, attn_mask=torch.ones(5, 5, dtype=torch.bool).triu(1), is_causal=True)


def _pair(
    seed: int, dtype: str, masks: str = "none"
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(integer outputs, QAT outputs as codes) on the same input codes; embed 32, 4 heads, 8 x 20 tokens."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    m = qat.MultiheadAttention.from_float(
        nn.MultiheadAttention(32, 4, batch_first=True), get_default_qat_qconfig(dtype=dtype)
    )

    def sample() -> list[torch.Tensor]:
        return [torch.randn(8, 20, 32, generator=g) for _ in range(3)]

    mask = torch.randn(20, 20, generator=g) * 0.5
    mask[torch.rand(20, 20, generator=g) > 0.7] = float("-inf")
    mask[:, 0] = 0.0
    kw: dict[str, torch.Tensor] = {}
    if masks == "float":
        kw = {"attn_mask": mask}
    elif masks == "bool":
        kw = {"attn_mask": torch.isneginf(mask), "key_padding_mask": torch.rand(8, 20, generator=g) > 0.8}
    xs = sample()
    sc = [float(t.abs().max() / 127.5) for t in xs]
    with torch.no_grad():
        for _ in range(3):
            m(*(_dq(_qz(t, s), s) for t, s in zip(sample(), sc, strict=True)), **kw)
        set_fake_quantize(m, "validation")
        m.eval()
        q = quantized.MultiheadAttention.from_qat(m, sc, "bayes")
        codes = [_qz(t, s) for t, s in zip(xs, sc, strict=True)]
        o_i, w_i = q(*codes, **kw)
        o_f, w_f = m(*(_dq(c, s) for c, s in zip(codes, sc, strict=True)), **kw)
    assert w_i is not None and w_f is not None
    ow = numerics.quantize(o_f, m.activation_post_process.scale, m.activation_post_process.dtype)
    ww = numerics.quantize(w_f, m.weights_post_process.scale, m.weights_post_process.dtype)
    return (o_i, w_i), (ow, ww)


#: measured maxima (docs/semantics.md "MultiheadAttention"), output and weights, in their own LSB
BOUND = {"qint8": (2, 1), "qint16": (325, 365)}


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
def test_converted_within_measured_bound_of_qat(dtype: str) -> None:
    for seed in range(3):
        (o_i, w_i), (ow, ww) = _pair(seed, dtype)
        assert o_i.dtype == ow.dtype and w_i.dtype == ww.dtype
        assert int((o_i.long() - ow.long()).abs().max()) <= BOUND[dtype][0]
        assert int((w_i.long() - ww.long()).abs().max()) <= BOUND[dtype][1]


@pytest.mark.parametrize("masks", ["float", "bool"])
def test_masked_within_the_same_bound(masks: str) -> None:
    """Float masks (finite entries added as codes, -inf excluded) and bool masks (attn_mask and
    key_padding_mask) keep the unmasked bound; excluded entries get weight 0 exactly, as in QAT."""
    for seed in range(3):
        (o_i, w_i), (ow, ww) = _pair(seed, "qint8", masks)
        assert int((o_i.long() - ow.long()).abs().max()) <= BOUND["qint8"][0]
        assert int((w_i.long() - ww.long()).abs().max()) <= BOUND["qint8"][1]


def test_fully_masked_row_is_zero() -> None:
    m = qat.MultiheadAttention.from_float(nn.MultiheadAttention(16, 4, batch_first=True), QC).eval()
    x = torch.randn(2, 5, 16)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1] = True
    with torch.no_grad():
        m(x, x, x, key_padding_mask=kpm)
        set_fake_quantize(m, "validation")
        q = quantized.MultiheadAttention.from_qat(m, [float(x.abs().max() / 127.5)] * 3, "bayes")
        c = _qz(x, float(x.abs().max() / 127.5))
        _, w_i = q(c, c, c, key_padding_mask=kpm)
        _, w_f = m(
            _dq(c, float(x.abs().max() / 127.5)),
            _dq(c, float(x.abs().max() / 127.5)),
            _dq(c, float(x.abs().max() / 127.5)),
            key_padding_mask=kpm,
        )
    assert w_i is not None and w_f is not None
    assert bool((w_i[1] == 0).all()) and bool((w_f[1] == 0).all())
