"""The native requantization's parameters as ``native_requant.h`` reads them (``qir_rqblock``).

The rule (``qir.ir.numerics.requantize``, docs/semantics.md "Requantization") per channel:
``clamp(((acc + b) * M + 2**(s-1)) >> s, lo, hi)`` in int64 with an arithmetic (floor) shift.
The kernels compute it as ``(acc * M + off) >> s`` with ``off = b * M + 2**(s-1)``, the same
int64 value (modulo 2**64 where it wraps, as the reference's int64 arithmetic does), in one of
two modes chosen for the whole layer:

* fast: ``mul = M << t``, ``off << t`` and a last shift of ``s + t - 32`` with ``t = max(0, 32 - s)``:
  ``floor(v / 2**s) == floor(floor(v * 2**t / 2**32) / 2**(s + t - 32))``, so the codes come out of
  the high halves of the 64-bit sums and one 32-bit shift. Needs, per channel, ``mul < 2**31``
  (a signed 32-bit multiplier) and ``2**31 * mul + |off << t| < 2**63`` (no overflow for any int32
  accumulator); both hold on Bayes and Bernoulli2 (``M <= 32767``, ``s <= 31``) whenever
  ``M / 2**s < 1/2``.
* general: ``mul = M``, ``off``, a shift of ``s`` on the int64 sum, the clamp in 64 bits.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK_INT64", "pack_requant"]

#: int64 words per block of 16 channels: mul, sh, lo, hi (16 int32 each), then off (16 int64)
BLOCK_INT64 = 48
_I64_MAX = 2**63 - 1


def pack_requant(
    mult: torch.Tensor, shift: torch.Tensor, bias: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> tuple[torch.Tensor, bool]:
    """``(blocks, fast)``: the per-channel ``mult`` (0 <= M < 2**31), ``shift`` (0..62), int32-range
    ``bias`` and the clamp ``lo <= hi`` (int32 range), all int64 of one length n, packed into
    ``ceil(n / 16) * 48`` int64 (channels past n zero), and whether the fast mode applies."""
    n = int(mult.numel())
    if not all(t.dtype == torch.int64 and t.numel() == n for t in (shift, bias, lo, hi)) or mult.dtype != torch.int64:
        raise ValueError("pack_requant: mult, shift, bias, lo, hi must be int64 tensors of one length")
    ms, ss, bs, los, his = (t.reshape(-1).tolist() for t in (mult, shift, bias, lo, hi))
    if n and not (0 <= min(ms) and max(ms) < 2**31 and 0 <= min(ss) and max(ss) <= 62):
        raise ValueError("pack_requant: multipliers must lie in [0, 2**31) and shifts in [0, 62]")
    if n and not all(-(2**31) <= b < 2**31 for b in bs):
        raise ValueError("pack_requant: biases must lie in the int32 range")
    if n and not (-(2**31) <= min(los) and max(his) < 2**31 and all(a <= b for a, b in zip(los, his, strict=True))):
        raise ValueError("pack_requant: the clamp bounds must be int32 with lo <= hi")
    offs = [b * m + ((1 << s) >> 1) for m, s, b in zip(ms, ss, bs, strict=True)]
    fast_mul, fast_off, fast_sh = [], [], []
    fast = True
    for m, s, off in zip(ms, ss, offs, strict=True):
        t = max(0, 32 - s)
        mp, op = m << t, off << t
        if mp >= 2**31 or (mp << 31) + abs(op) > _I64_MAX:
            fast = False
            break
        fast_mul.append(mp)
        fast_off.append(op)
        fast_sh.append(s + t - 32)
    mul, off, sh = (fast_mul, fast_off, fast_sh) if fast else (ms, offs, ss)
    nb = -(-n // 16)
    fields = torch.zeros(4, nb * 16, dtype=torch.int32)
    fields[:, :n] = torch.tensor([mul, sh, los, his], dtype=torch.int32).reshape(4, n)
    words = fields.view(4, nb, 16).permute(1, 0, 2).reshape(nb, 64)
    # the C side's off[16]: the block's even channels, then its odd ones (the 64-bit lanes of vpmuldq)
    flat = torch.zeros(nb * 16, dtype=torch.int64)
    flat[:n] = torch.tensor(off, dtype=torch.int64)
    offsets = flat.view(nb, 8, 2).transpose(1, 2).reshape(nb, 16)
    packed = torch.cat([words.view(torch.int64), offsets], dim=1).contiguous().view(-1)
    assert packed.numel() == nb * BLOCK_INT64
    return packed, fast
