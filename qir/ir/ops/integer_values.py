"""Checks of the values an integer layer's kernel trusts: the state constants it reads.

Types say a conv's ``shift`` holds one integer per output channel; the kernel also assumes
what those integers are: a right shift in ``[0, 62]`` (int64 arithmetic: ``1 << 63`` is
negative and a shift by 64 or more is undefined), a multiplier within ``±(2**31 - 1)`` (so
``acc * multiplier`` stays inside int64), a ReLU6 bound inside the output's code range, a
softmax exp table whose row sums are positive. A constant bound to a graph is known before
it runs, so :func:`~qir.ir.verify` checks it (through :meth:`~qir.ir.op.Op.verify_values`) and
names the node, the state role, the first bad entry and the rule, instead of letting the run
compute a silently wrong result or fail mid-graph. The ranges are the datapath's
(docs/semantics.md): the same ones the integer ops check on their integer attributes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from qir.ir.numerics import abs_sums
from qir.ir.op import IRError
from qir.ir.types import DType, TensorType, Type

__all__ = [
    "MULTIPLIER_RANGE",
    "SHIFT_RANGE",
    "abs_max",
    "check_exp_table",
    "check_fits_int64",
    "check_int_values",
    "check_linear_state",
    "check_requant_fits_int64",
    "check_scale_values",
    "code_magnitude",
]

#: a requantization multiplier: ``acc * m`` in int64 for accumulators below 2**32
MULTIPLIER_RANGE = (-(2**31) + 1, 2**31 - 1)
#: a requantization right shift: ``1 << shift`` and ``x >> shift`` defined in int64
SHIFT_RANGE = (0, 62)
_INT32 = (-(2**31), 2**31 - 1)
_F32_MAX = float(torch.finfo(torch.float32).max)


#: integer dtypes read on the host through numpy (a few values per channel: numpy's per-call cost is a
#: fraction of torch's, and a converted network checks a dozen such tensors per layer)
_HOST_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)


def _host_ints(t: torch.Tensor) -> np.ndarray | None:
    """``t`` flattened as an int64 numpy array (a view where it already is one), or None where numpy
    cannot read it (another device or dtype): the caller's torch path decides."""
    if t.device.type != "cpu" or t.dtype not in _HOST_INTS:
        return None
    return t.detach().reshape(-1).numpy().astype(np.int64, copy=False)


def _first_outside(t: torch.Tensor, lo: int, hi: int) -> tuple[int, int] | None:
    """(flat index, value) of the first entry of integer ``t`` outside ``[lo, hi]``, or None."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return None
    a = _host_ints(flat) if -(2**63) <= lo and hi < 2**63 else None
    if a is not None:
        out = (a < lo) | (a > hi)
        if not out.any():
            return None
        i = int(out.argmax())
        return i, int(a[i])
    bad = (flat < lo) | (flat > hi)
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0, 0])
    return i, int(flat[i])


def check_int_values(op: str, role: str, t: torch.Tensor, lo: int, hi: int, why: str = "") -> None:
    """Every entry of the integer state tensor ``role`` lies in ``[lo, hi]``."""
    if t.is_floating_point() or t.is_complex():
        raise IRError(f"op {op!r}: {role} must hold integers, got a {t.dtype} tensor")
    bad = _first_outside(t, lo, hi)
    if bad is not None:
        i, v = bad
        at = f" at index {i}" if t.numel() > 1 else ""
        raise IRError(f"op {op!r}: {role} must hold integers in [{lo}, {hi}]{why}, got {v}{at}")


def check_scale_values(op: str, role: str, t: torch.Tensor) -> None:
    """Every entry of the scale tensor ``role`` is a positive finite float32 value."""
    flat = t.detach().reshape(-1).to(torch.float64)
    if flat.numel() == 0:
        raise IRError(f"op {op!r}: {role} holds no scale")
    as_f32 = flat.to(torch.float32).to(torch.float64)
    bad = ~(torch.isfinite(flat) & (flat > 0) & (flat < _F32_MAX) & (as_f32 > 0))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        at = f" at index {i}" if flat.numel() > 1 else ""
        raise IRError(f"op {op!r}: {role} must hold positive finite float32 scales, got {float(flat[i])!r}{at}")


def abs_max(t: torch.Tensor) -> int:
    """The largest ``|entry|`` of an integer tensor (0 when empty), exact."""
    if t.numel() == 0:
        return 0
    flat = t.reshape(-1).to(torch.int64)
    return max(abs(int(flat.min())), abs(int(flat.max())))


def code_magnitude(t: Type) -> int:
    """The largest ``|code|`` a tensor of type ``t`` holds (its quantized or integer dtype's range)."""
    if not isinstance(t, TensorType):
        return 2**31
    d = t.dtype
    if d in (DType.qint8, DType.int8):
        return 128
    if d in (DType.qint16, DType.int16):
        return 2**15
    if d in (DType.uint8,):
        return 255
    if d in (DType.qint32, DType.int32):
        return 2**31
    return 2**63


def check_fits_int64(op: str, what: str, *factors: int) -> None:
    """The product of magnitude bounds ``factors`` stays below 2**63 (int64 arithmetic does not wrap)."""
    if math.prod(factors) >= 2**63:
        raise IRError(f"op {op!r}: {what} can reach {math.prod(factors):.3g}, beyond int64 (2**63)")


def check_exp_table(op: str, role: str, table: torch.Tensor, n: int, multiplier: int, shift: int) -> None:
    """A softmax exp table as the kernel divides by it (``e = table[q - max(q) + 255]``, the
    row sum ``S``, ``round(e * M / (S << shift))``): entries >= 0, entry 255 (exp(0), read for
    each row's maximum) > 0 so no row sums to 0, and ``S << shift`` for rows of ``n`` entries
    and ``2 * e * M`` inside int64. The artifact's softmax kernel checks the same at load."""
    t = table.reshape(-1).to(torch.int64)
    check_int_values(op, role, t, 0, 2**31 - 1, " (exp values: a row's sum must be positive)")
    if t.numel() < 256 or int(t[255]) <= 0:
        got = int(t[255]) if t.numel() >= 256 else "no entry"
        raise IRError(
            f"op {op!r}: {role} entry 255 (exp(0), read for each row's maximum) must be > 0, got {got}: "
            "a row of equal codes would sum to 0"
        )
    top = abs_max(t)
    check_fits_int64(op, f"a row sum ({n} entries of at most {top}) shifted by {shift}", top * n * 4, 2**shift)
    check_fits_int64(op, f"twice an entry ({top}) times the multiplier {multiplier}", 4 * top, max(abs(multiplier), 1))


def _out_code_max(out: DType) -> int:
    return out.qrange[1] if out.is_quantized else _INT32[1]


def check_linear_state(
    op: str,
    state: Mapping[str, torch.Tensor],
    x: Type,
    out: DType,
    *,
    prefix: str = "",
    out_axis: int = 0,
    groups: int = 1,
    relu6: bool = False,
) -> None:
    """A conv / linear's integer state, as :func:`~qir.ir.numerics.requantize` uses it.

    ``multiplier`` / ``shift`` in the requantization ranges (unused, and not checked, for a
    qint32 output), ``bias`` an int32, ``relu6_bound`` inside the output's code range when the
    layer clamps with it, and the requantization of each output channel inside int64
    (:func:`check_requant_fits_int64`). ``out_axis`` is the weight's output-channel axis (1 for
    a transposed conv, whose ``groups`` then split both of its first two axes).
    """
    m, s, b, w = (state.get(prefix + r) for r in ("multiplier", "shift", "bias", "weight"))
    if out is not DType.qint32:
        if m is not None:
            check_int_values(op, prefix + "multiplier", m, *MULTIPLIER_RANGE)
        if s is not None:
            check_int_values(op, prefix + "shift", s, *SHIFT_RANGE)
    if b is not None:
        check_int_values(op, prefix + "bias", b, *_INT32, " (an int32 at the accumulator's scale)")
    bound = state.get(prefix + "relu6_bound")
    if relu6 and bound is not None:
        check_int_values(op, prefix + "relu6_bound", bound, 0, _out_code_max(out), f" (the {out.name} code range)")
    if w is not None and w.dim() >= 1 and m is not None and out is not DType.qint32:
        check_requant_fits_int64(op, prefix, _channel_l1(w, out_axis, groups), code_magnitude(x), b, m, s)


def _channel_l1(w: torch.Tensor, out_axis: int, groups: int) -> torch.Tensor:
    """``sum |w|`` over the weights that feed each output channel, in output-channel order."""
    if out_axis == 0:
        return abs_sums(w, 0)
    # a transposed conv's weight is (in, out / groups, ...): output channel g * (out / groups) + j
    # reads the in / groups input channels of group g through column j
    g = groups if groups >= 1 and w.shape[0] % groups == 0 else 1
    rows = w.reshape(g, w.shape[0] // g, w.shape[out_axis], -1).transpose(1, 2)
    return abs_sums(rows.reshape(g * w.shape[out_axis], -1), 0)


def _per_channel(t: torch.Tensor | None, c: int) -> np.ndarray | None:
    """``|t|`` as ``c`` int64 entries (a single entry broadcast), None if it is neither."""
    if t is None:
        return np.zeros(c, dtype=np.int64)
    a = _host_ints(t)
    flat = np.abs(a) if a is not None else t.reshape(-1).to(torch.int64).abs().numpy()
    if flat.size == c:
        return flat
    return np.broadcast_to(flat, (c,)) if flat.size == 1 else None


def check_requant_fits_int64(
    op: str,
    prefix: str,
    l1: torch.Tensor,
    x_max: int,
    bias: torch.Tensor | None,
    multiplier: torch.Tensor,
    shift: torch.Tensor | None,
) -> None:
    """``acc * multiplier + 2**(shift - 1)`` inside int64 for every output channel and every input.

    ``acc[c]`` is at most ``l1[c] * x_max + |bias[c]|`` (``l1``: the channel's ``sum |w|``,
    ``x_max``: the largest ``|code|`` of the input's dtype), reached by an input of extreme codes
    with the weights' signs: each channel's bound is multiplied by its own multiplier, plus its
    own rounding half, so a layer is refused only when some input really overflows. Entries that
    do not line up per channel are bounded by their largest magnitude instead.
    """
    c = l1.numel()
    b, m = _per_channel(bias, c), _per_channel(multiplier, c)
    sh = _per_channel(shift, c) if shift is not None else np.zeros(c, dtype=np.int64)
    if b is None or m is None or sh is None:  # not one per channel: the worst channel of each
        b = np.full(c, abs_max(bias) if bias is not None else 0, dtype=np.int64)
        m = np.full(c, abs_max(multiplier), dtype=np.int64)
        sh = np.full(c, abs_max(shift) if shift is not None else 0, dtype=np.int64)
    if c == 0:
        return
    l1 = l1.reshape(-1).to(torch.int64)
    # in numpy: a dozen float64 operations on c values, each a fraction of a torch call's cost
    with np.errstate(over="ignore"):  # a shift of thousands: 2**shift is inf, and so is the bound
        top_f = (l1.numpy().astype(np.float64) * float(x_max) + b.astype(np.float64)) * m.astype(np.float64) + (
            np.exp2(sh.astype(np.float64)) / 2
        )
    # float64 picks the channels that come near 2**63 (its rounding is far below 2**62);
    # the verdict on those is exact, in Python integers
    for ch in np.flatnonzero(top_f >= 2.0**62).tolist():
        ll, bb, mm, ss = int(l1[ch]), int(b[ch]), int(m[ch]), int(sh[ch])
        acc = ll * x_max + bb
        top = acc * mm + ((1 << ss) >> 1)
        if top >= 2**63:
            raise IRError(
                f"op {op!r}: output channel {ch}: the accumulator (<= {acc}: sum |w| {ll} x |code| {x_max} "
                f"+ |bias| {bb}) times the {prefix}multiplier {mm} plus the rounding half "
                f"can reach {top:.3g}, beyond int64 (2**63)"
            )
