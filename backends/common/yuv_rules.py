"""The integer rule of centered YUV444 -> normalised RGB codes (``qir.functional.centered_yuv2rgb``
and ``centered_yuv2bgr`` on codes; docs/semantics.md, "Centered YUV to RGB").

On the BPU the conversion is a 1x1 convolution of the raw YUV codes (input scale 1): BT.601's
inverse matrix and the ``(rgb - mean) / std`` normalisation folded into one int8 weight per
output channel and an int32 bias, requantized to qint8 at ``q_scale``, then clamped per channel
to the codes of RGB 0 and 255. The converted model (:func:`yuv2rgb_codes`) and the compiled
program (a ``conv2d`` plus ``maximum`` / ``minimum`` instructions built from the same
:func:`yuv2rgb_params`) compute it bit for bit alike.

The requantization uses Bernoulli2's 8-bit multiplier, which Bayes's datapath also runs, so one
converted model means the same on both marches. Against the float64 formula it is within one
code (every centered YUV input, both swings, ImageNet-style and default normalisation).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import torch

from backends.common import numerics

__all__ = ["RGB2YUV", "SWINGS", "Yuv2RgbParams", "yuv2rgb_codes", "yuv2rgb_params"]

SWINGS = ("studio", "full")

#: BT.601 RGB (0..255) -> YUV per swing: (matrix rows Y, U, V over columns R, G, B; offsets added
#: after the matrix; each sample's range before centering).
RGB2YUV: dict[str, tuple[tuple[tuple[float, ...], ...], tuple[float, ...], tuple[tuple[float, float], ...]]] = {
    "studio": (
        (
            (65.481 / 255, 128.553 / 255, 24.966 / 255),
            (-37.797 / 255, -74.203 / 255, 112.0 / 255),
            (112.0 / 255, -93.786 / 255, -18.214 / 255),
        ),
        (16.0, 128.0, 128.0),
        ((16.0, 235.0), (16.0, 240.0), (16.0, 240.0)),
    ),
    "full": (
        ((0.299, 0.587, 0.114), (-0.168736, -0.331264, 0.5), (0.5, -0.418688, -0.081312)),
        (0.0, 128.0, 128.0),
        ((0.0, 255.0), (0.0, 255.0), (0.0, 255.0)),
    ),
}

#: The march whose requantization limits the rule uses (the narrower of the two: 8-bit multiplier).
_DATAPATH = "bernoulli2"


class Yuv2RgbParams(NamedTuple):
    """A 1x1 conv from 3 YUV codes to 3 RGB codes, and the per-channel code clamp after it."""

    weight: torch.Tensor  # int8 (3, 3, 1, 1), rows in output order (R, G, B or B, G, R)
    bias: torch.Tensor  # int32 (3,), at the accumulator scale (input scale 1 x weight scale)
    multiplier: torch.Tensor  # int64 (3,)
    shift: torch.Tensor  # int64 (3,)
    lo: torch.Tensor  # int8 (3,): the code of RGB 0 per output channel
    hi: torch.Tensor  # int8 (3,): the code of RGB 255


def _three(v: Sequence[float] | torch.Tensor | float, what: str) -> tuple[float, float, float]:
    t = torch.as_tensor(v, dtype=torch.float64).detach().reshape(-1)
    if t.numel() not in (1, 3):
        raise ValueError(f"{what} needs 1 or 3 values (per RGB channel), got {t.numel()}")
    a, b, c = (float(x) for x in t.expand(3))
    return a, b, c


def yuv2rgb_params(
    swing: str,
    mean: Sequence[float] | torch.Tensor | float,
    std: Sequence[float] | torch.Tensor | float,
    q_scale: float | torch.Tensor,
    bgr: bool = False,
) -> Yuv2RgbParams:
    """The integer parameters of the conversion (``mean`` / ``std`` in output channel order)."""
    if swing not in SWINGS:
        raise ValueError(f"swing must be 'studio' or 'full', got {swing!r}")
    s = torch.as_tensor(q_scale, dtype=torch.float32).detach().reshape(-1)
    if s.numel() != 1:
        raise ValueError(f"q_scale must be one number, got {s.numel()} values")
    return _params(swing, _three(mean, "mean"), _three(std, "std"), float(s[0]), bgr)


@lru_cache(maxsize=64)
def _params(
    swing: str, mean: tuple[float, float, float], std: tuple[float, float, float], q: float, bgr: bool
) -> Yuv2RgbParams:
    if not all(x > 0 for x in std):
        raise ValueError(f"std must be positive, got {std}")
    if not q > 0:
        raise ValueError(f"q_scale must be positive, got {q}")
    m, off, _ = RGB2YUV[swing]
    inv = torch.linalg.inv(torch.tensor(m, dtype=torch.float64))  # RGB = inv @ (YUV - offsets)
    rgb_bias = inv @ (128.0 - torch.tensor(off, dtype=torch.float64))  # centered codes: YUV = code + 128
    if bgr:
        inv, rgb_bias = inv.flip(0), rgb_bias.flip(0)
    mean_t, std_t = torch.tensor(mean, dtype=torch.float64), torch.tensor(std, dtype=torch.float64)
    w = inv / std_t[:, None]
    b = (rgb_bias - mean_t) / std_t
    w_scale = (w.abs().amax(dim=1) / 127).to(torch.float32)  # per output channel, as a quantized conv's
    weight = numerics.quantize(w, w_scale, "qint8", axis=0).reshape(3, 3, 1, 1)
    acc_scale = numerics.accumulator_scale(1.0, w_scale)
    bias = numerics.bias_codes(b, acc_scale)
    try:
        multiplier, shift = numerics.acc_requant_params(acc_scale, q, _DATAPATH, "qint8")
    except ValueError as e:
        raise ValueError(f"centered_yuv2rgb: q_scale {q:.6g} is too small for these mean / std: {e}") from None
    lo = numerics.quantize((torch.zeros(3, dtype=torch.float64) - mean_t) / std_t, q, "qint8")
    hi = numerics.quantize((torch.full((3,), 255.0, dtype=torch.float64) - mean_t) / std_t, q, "qint8")
    return Yuv2RgbParams(weight, bias, multiplier.reshape(3), shift.reshape(3), lo, hi)


def yuv2rgb_codes(codes: torch.Tensor, p: Yuv2RgbParams) -> torch.Tensor:
    """qint8 RGB codes of integer YUV ``codes`` (channels on dim -3), in int64 arithmetic."""
    if codes.is_floating_point():
        raise TypeError("yuv2rgb_codes takes integer codes; quantize float input at scale 1 first")
    x = codes.to(torch.int64)
    acc = torch.einsum("oi,...ihw->...ohw", p.weight.reshape(3, 3).to(torch.int64), x)
    acc = acc + p.bias.to(torch.int64).reshape(3, 1, 1)
    out = numerics.requantize(acc, p.multiplier, p.shift, "qint8", axis=x.dim() - 3).to(torch.int64)
    out = torch.minimum(
        torch.maximum(out, p.lo.to(torch.int64).reshape(3, 1, 1)), p.hi.to(torch.int64).reshape(3, 1, 1)
    )
    return out.to(torch.int8)
