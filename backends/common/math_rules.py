"""Integer rules of PReLU, Softmax and LayerNorm (docs/semantics.md, "PReLU", "Softmax", "LayerNorm").

Each rule is built from numerics' primitives (``multiplier_shift``, ``requantize``,
``round_half_up``, ``saturate``) and the module library's division rule (``div_int``);
parameters are derived in float64 from float32 scales. The quantized modules call these
functions; the compiled kernels (``backends/common/kernels/{prelu,softmax,layer_norm}.py``)
are a second, independent implementation that the bit-exact tests compare against them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from backends.common.integer_rules import check_out_dtype, div_int, f32
from backends.common.numerics import (
    DTypeLike,
    multiplier_shift,
    qdtype,
    quantize,
    requant_limits,
    requant_params,
    requantize,
    round_half_up,
)
from qir.ir.types import DType

__all__ = [
    "LN_EPS_MAX_BITS",
    "LN_EXTRA_BITS",
    "LN_MAX_ELEMENTS",
    "LN_MAX_SUM",
    "LN_Z_BITS",
    "LayerNormParams",
    "PReLUParams",
    "SOFTMAX_EXP_DTYPE",
    "SOFTMAX_EXP_MAX",
    "SOFTMAX_EXP_SCALE",
    "SOFTMAX_MAX_LENGTH",
    "SOFTMAX_RECIP_MAX_MULTIPLIER",
    "SOFTMAX_RECIP_MAX_SHIFT",
    "bit_length",
    "isqrt",
    "layer_norm_eps_bits",
    "layer_norm_eps_term",
    "layer_norm_int",
    "layer_norm_params",
    "prelu_int",
    "prelu_params",
    "softmax_exp_table",
    "softmax_int",
    "softmax_params",
]


# ---------------------------------------------------------------------------------------------
# PReLU
# ---------------------------------------------------------------------------------------------


class PReLUParams(NamedTuple):
    """``q >= 0``: ``(pos_multiplier, pos_shift)`` for ``s_in / s_out``; ``q < 0``: signed per-slope
    ``(neg_multiplier[c], neg_shift[c])`` for ``slope[c] * s_in / s_out`` (0 for a zero slope)."""

    pos_multiplier: int
    pos_shift: int
    neg_multiplier: torch.Tensor  # int64, one per slope
    neg_shift: torch.Tensor  # int64, one per slope


def prelu_params(
    in_scale: float, out_scale: float, slope: torch.Tensor, march: object, dtype: DTypeLike
) -> PReLUParams:
    """The two requantizations of PReLU on ``march``'s datapath.

    The negative side folds the slope into the multiplier: ``r[c] = |f32(slope[c])| * s_in / s_out``
    through ``multiplier_shift`` with the march's limits, negated for a negative slope.
    """
    check_out_dtype(march, dtype, "PReLU")
    pm, ps = requant_params(in_scale, out_scale, march, dtype)
    lim = requant_limits(march)
    a = slope.detach().to(torch.float32).reshape(-1).to(torch.float64)
    r = a.abs() * f32(in_scale) / f32(out_scale)
    zero = r == 0
    try:
        m, s = multiplier_shift(torch.where(zero, torch.ones_like(r), r), lim.max_multiplier, lim.max_shift)
    except ValueError as e:
        raise ValueError(f"PReLU: slope * input scale / output scale is too large for the multiplier: {e}") from None
    m = torch.where(zero, torch.zeros_like(m), m * torch.where(a < 0, -1, 1))
    s = torch.where(zero, torch.zeros_like(s), s)
    return PReLUParams(int(pm), int(ps), m, s)


def prelu_int(q: torch.Tensor, p: PReLUParams, out_dtype: DTypeLike) -> torch.Tensor:
    """``sat((q * M + 2**(s-1)) >> s)`` with the positive or the (per-channel, axis 1) negative parameters."""
    pos = requantize(q, p.pos_multiplier, p.pos_shift, out_dtype)
    if p.neg_multiplier.numel() == 1:
        neg = requantize(q, p.neg_multiplier.reshape(()), p.neg_shift.reshape(()), out_dtype)
    else:
        neg = requantize(q, p.neg_multiplier, p.neg_shift, out_dtype, axis=1)
    return torch.where(q >= 0, pos, neg)


# ---------------------------------------------------------------------------------------------
# Softmax
# ---------------------------------------------------------------------------------------------

#: The exp table's codes: ``exp(d * s_in)`` at this scale, qint16 (the QAT module's ``exp_post_process``).
#: ``1/32767`` (not ``2**-15``) keeps ``exp(0) = 1`` inside the range, so the row maximum never
#: saturates (and keeps its QAT gradient).
SOFTMAX_EXP_SCALE = float(torch.tensor(1.0 / 32767.0, dtype=torch.float32))
SOFTMAX_EXP_DTYPE = DType.parse("qint16")
SOFTMAX_EXP_MAX = 32767
#: The sum of a row must stay below 2**31 (int32): at most 65536 entries of 32767.
SOFTMAX_MAX_LENGTH = 65536
#: The reciprocal of the output scale is a 31-bit multiplier: a qint16 output at scale ~2**-15 needs
#: ``1 / s_out ~ 32768``, beyond the 15-bit requantization multipliers.
SOFTMAX_RECIP_MAX_MULTIPLIER = 2**31 - 1
SOFTMAX_RECIP_MAX_SHIFT = 31


def softmax_exp_table(in_scale: float) -> torch.Tensor:
    """256 int16 entries: entry ``i`` is ``sat(round(exp(d * s_in) / s_e))`` for ``d = i - 255``.

    ``d = q - max(q)`` lies in ``[-255, 0]`` for qint8 codes; ``exp`` runs in float64 on
    the exact float64 product ``d * s_in``.
    """
    d = torch.arange(-255, 1, dtype=torch.float64)
    y = torch.exp(d * f32(in_scale))
    return quantize(y, SOFTMAX_EXP_SCALE, SOFTMAX_EXP_DTYPE)


def softmax_params(out_scale: float, dtype: DTypeLike, march: object) -> tuple[int, int]:
    """``(M, k)`` with ``M / 2**k ~ 1 / s_out`` (31-bit multiplier, ``k <= 31``)."""
    check_out_dtype(march, dtype, "Softmax")
    r = torch.tensor(1.0 / f32(out_scale), dtype=torch.float64)
    try:
        m, k = multiplier_shift(r, SOFTMAX_RECIP_MAX_MULTIPLIER, SOFTMAX_RECIP_MAX_SHIFT)
    except ValueError:
        raise ValueError(
            f"Softmax: output scale {f32(out_scale):.6g} is below 2**-31; the output fake quant must observe "
            "the softmax output (values in [0, 1])"
        ) from None
    return int(m), int(k)


def softmax_int(
    q: torch.Tensor, table: torch.Tensor, multiplier: int, shift: int, dim: int, out_dtype: DTypeLike
) -> torch.Tensor:
    """``sat(round_half_up(e * M / (S * 2**k)))`` with ``e = table[q - max(q) + 255]``, ``S = sum(e)``
    along ``dim``: the row maximum on codes, the exp table, an exact int64 sum, one exact division."""
    x = q.to(torch.int64)
    e = table.to(torch.int64)[x - x.amax(dim=dim, keepdim=True) + 255]
    total = e.sum(dim=dim, keepdim=True)
    return div_int(e, total, multiplier, shift, out_dtype)


# ---------------------------------------------------------------------------------------------
# LayerNorm
# ---------------------------------------------------------------------------------------------

#: Fraction bits of the normalized value ``Z ~ z * 2**G``.
LN_Z_BITS = 20
#: Extra fraction bits of the affine intermediate (scale ``s_out / 2**p``), as in the fused add.
LN_EXTRA_BITS = 8
#: At most this many fraction bits ``f`` for the variance sum (``T = V * 4**f + E``): eps is then
#: represented to ``4**-f`` of one code**2, which matters for short, nearly constant rows.
LN_EPS_MAX_BITS = 8
#: Elements normalized together: keeps ``|D| * 2**(f + k + G)`` and ``Z * M`` inside int64.
LN_MAX_ELEMENTS = 2**20
#: ``T`` stays below this, so ``T << 2k`` fits 60 bits and its root 30.
LN_MAX_SUM = 2**60
_LN_MID_MAX_MULTIPLIER = 2**31 - 1
_LN_MID_MAX_SHIFT = 62
_POW2 = torch.tensor([1 << j for j in range(63)], dtype=torch.int64)
#: The input code dtypes LayerNorm takes, with their largest magnitude.
_LN_AMAX = {torch.int8: 128, torch.int16: 32768}


def bit_length(n: torch.Tensor) -> torch.Tensor:
    """``int.bit_length`` of each non-negative int64 entry (exact: compares with every power of two)."""
    return (n.unsqueeze(-1) >= _POW2.to(n.device)).sum(-1)


def isqrt(n: torch.Tensor) -> torch.Tensor:
    """``floor(sqrt(n))`` of non-negative int64 ``n < 2**62`` by integer Newton steps.

    Starts at ``2**ceil(bits/2) >= sqrt(n)`` and takes ``x <- min(x, (x + n // x) // 2)`` a fixed
    number of times: from above, Newton decreases monotonically to ``floor(sqrt(n))`` with
    quadratic convergence (relative error <= 1 at the start, below 2**-60 after 7 steps),
    and the ``min`` holds it there.
    """
    x = torch.ones_like(n) << ((bit_length(n) + 1) // 2)
    for _ in range(8):
        x = torch.minimum(x, (x + n // x.clamp(min=1)) // 2)
    return x


def layer_norm_eps_bits(n: int, in_dtype: torch.dtype) -> int:
    """``f = min(8, (59 - bits(N**2 * amax**2)) // 2)``: the variance's fraction bits for ``n`` elements of
    ``in_dtype`` codes (``V * 4**f < 2**59``). Raises when even ``f = 0`` does not fit."""
    if in_dtype not in _LN_AMAX:
        raise NotImplementedError(f"LayerNorm takes qint8 or qint16 codes, got {in_dtype}")
    b = (n * n * _LN_AMAX[in_dtype] ** 2).bit_length()
    if b > 59:
        raise ValueError(
            f"LayerNorm: {n} normalized elements of {in_dtype} codes exceed the integer rule's range "
            "(N**2 * amax**2 must stay below 2**59); use qint8 input or normalize fewer elements"
        )
    return min(LN_EPS_MAX_BITS, (59 - b) // 2)


class LayerNormParams(NamedTuple):
    """Integer parameters of :func:`layer_norm_int` (see :func:`layer_norm_params`)."""

    #: per input code dtype (torch.int8, torch.int16): ``(f, E = round(eps * N**2 * 4**f / s_in**2))``;
    #: ``E = -1`` where eps does not fit (``E >= 2**59``) or the dtype's codes exceed the range
    eps_terms: dict[torch.dtype, tuple[int, int]]
    multiplier: torch.Tensor  # signed, int64, one per normalized element
    shift: torch.Tensor  # int64, one per normalized element
    bias: torch.Tensor  # int64 (int32 range), one per normalized element, at s_out / 2**p


def layer_norm_params(
    in_scale: float,
    out_scale: float,
    normalized_shape: tuple[int, ...],
    eps: float,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    march: object,
    dtype: DTypeLike,
) -> LayerNormParams:
    """``(f, E)`` per input dtype, the affine multipliers ``M[j] / 2**sh[j] ~ w[j] * 2**(p - G) / s_out``
    (31-bit, signed) and the bias ``sat_int32(round(b[j] * 2**p / s_out))``, over the flattened
    ``normalized_shape``."""
    check_out_dtype(march, dtype, "LayerNorm")
    n = 1
    for d in normalized_shape:
        n *= int(d)
    if n > LN_MAX_ELEMENTS:
        raise ValueError(
            f"LayerNorm: normalized_shape {tuple(normalized_shape)} has {n} elements; the integer rule "
            f"takes at most {LN_MAX_ELEMENTS}"
        )
    s_in, s_out = f32(in_scale), f32(out_scale)
    eps_terms: dict[torch.dtype, tuple[int, int]] = {}
    for in_dtype in _LN_AMAX:
        try:
            f = layer_norm_eps_bits(n, in_dtype)
        except ValueError:
            eps_terms[in_dtype] = (0, -1)
            continue
        e = float(round_half_up(torch.tensor(float(eps) * n * n * 4.0**f / (s_in * s_in), dtype=torch.float64)))
        eps_terms[in_dtype] = (f, int(e) if e < LN_MAX_SUM / 2 else -1)
    w = (
        torch.ones(n, dtype=torch.float64)
        if weight is None
        else weight.detach().to(torch.float32).reshape(-1).to(torch.float64)
    )
    b = (
        torch.zeros(n, dtype=torch.float64)
        if bias is None
        else bias.detach().to(torch.float32).reshape(-1).to(torch.float64)
    )
    if w.numel() != n or b.numel() != n:
        raise ValueError(
            f"LayerNorm: weight / bias must have {n} elements (normalized_shape "
            f"{tuple(normalized_shape)}), got {w.numel()} / {b.numel()}"
        )
    r = w.abs() * 2.0 ** (LN_EXTRA_BITS - LN_Z_BITS) / s_out
    zero = r == 0
    try:
        m, sh = multiplier_shift(torch.where(zero, torch.ones_like(r), r), _LN_MID_MAX_MULTIPLIER, _LN_MID_MAX_SHIFT)
    except ValueError:
        raise ValueError(
            f"LayerNorm: weight / output scale = {float((w.abs() / s_out).max()):.6g} is too large "
            "(above 2**43); the output fake quant must observe the layer's output"
        ) from None
    m = torch.where(zero, torch.zeros_like(m), m * torch.where(w < 0, -1, 1))
    sh = torch.where(zero, torch.zeros_like(sh), sh)
    bq = quantize(b, s_out * 2.0**-LN_EXTRA_BITS, "qint32").to(torch.int64)
    return LayerNormParams(eps_terms, m, sh, bq)


def layer_norm_eps_term(p: LayerNormParams, in_dtype: torch.dtype, where: str) -> tuple[int, int]:
    """``(f, E)`` for ``in_dtype`` codes; raises naming ``where`` and the fix when the rule cannot take them."""
    if in_dtype not in p.eps_terms:
        raise NotImplementedError(f"{where}: LayerNorm takes qint8 or qint16 codes, got {in_dtype}")
    f, e = p.eps_terms[in_dtype]
    if e < 0:
        n = p.multiplier.numel()
        layer_norm_eps_bits(n, in_dtype)  # raises when N is the reason
        raise ValueError(
            f"{where}: eps is too large for the input scale (eps * N**2 / s_in**2 >= 2**59): the output would be "
            "the bias alone; lower eps or widen the input range"
        )
    return f, e


def layer_norm_int(q: torch.Tensor, ndims: int, p: LayerNormParams, out_dtype: DTypeLike) -> torch.Tensor:
    """LayerNorm on codes over the last ``ndims`` dims (docs/semantics.md, "LayerNorm").

    ``S1 = sum q``, ``S2 = sum q**2``, ``D = (N q - S1) << f``, ``T = (N S2 - S1**2) << 2f + E`` (exact
    int64); ``k = max(0, (60 - bits(T)) // 2)``, ``Q = isqrt(T << 2k)``; ``Z = round(D * 2**(k+G) / Q)``
    (exact division); ``mid = sat_int32(requant(Z, M, sh)) + bias``; ``out = sat((mid + 2**(p-1)) >> p)``.
    """
    qd = qdtype(out_dtype)
    f, e = layer_norm_eps_term(p, q.dtype, "LayerNorm")
    lead = q.shape[: q.dim() - ndims]
    n = 1
    for size in q.shape[q.dim() - ndims :]:
        n *= int(size)
    x = q.to(torch.int64).reshape(*lead, n)
    s1 = x.sum(-1, keepdim=True)
    t = ((n * (x * x).sum(-1, keepdim=True) - s1 * s1) << (2 * f)) + e
    k = (60 - bit_length(t)).clamp(min=0) // 2
    root = isqrt(t << (2 * k)).clamp(min=1)  # T = 0 only for a constant row with E = 0: then D = 0 too
    z = _round_div((n * x - s1) << (f + k + LN_Z_BITS), root)
    mid = requantize(z, p.multiplier, p.shift, "qint32", axis=-1).to(torch.int64) + p.bias
    out = requantize(mid, 1, LN_EXTRA_BITS, qd)
    return out.reshape(q.shape)


def _round_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``round_half_up(num / den)`` exactly for ``den > 0`` (int64)."""
    return torch.div(2 * num + den, 2 * den, rounding_mode="floor")
