"""Colour-space functions for camera input: RGB/BGR <-> centered YUV444 (BT.601).

The BPU's image pyramid delivers centered YUV444: ``code - 128`` of each 8-bit YUV
sample, in ``[-128, 127]``. Train on that format with :func:`rgb2centered_yuv`; or, for a
model trained on normalised RGB, insert :func:`centered_yuv2rgb` after the converted
model's QuantStub (whose scale is then set to 1) so the deployed model accepts YUV.

Formulas (BT.601, RGB in 0..255; docs/modules.md, "Colour conversion"):

studio swing (Y 16..235, U/V 16..240)::

    Y = 16  + ( 65.481 R + 128.553 G +  24.966 B) / 255
    U = 128 + (-37.797 R -  74.203 G + 112.0   B) / 255
    V = 128 + (112.0   R -  93.786 G -  18.214 B) / 255

full swing (Y, U, V 0..255)::

    Y =       0.299    R + 0.587    G + 0.114    B
    U = 128 - 0.168736 R - 0.331264 G + 0.5      B
    V = 128 + 0.5      R - 0.418688 G - 0.081312 B

Centered values are the rounded (half up), range-clamped samples minus 128: studio Y
-112..107, U/V -112..112; full -128..127. The inverse uses the exact inverse matrices.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backends.common import numerics

__all__ = ["bgr2centered_yuv", "centered_yuv2bgr", "centered_yuv2rgb", "rgb2centered_yuv"]

_SWINGS = ("studio", "full")

# Rows: Y, U, V; columns: R, G, B. Offsets are added after the matrix.
_RGB2YUV = {
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


def _swing(swing: str) -> str:
    if swing not in _SWINGS:
        raise ValueError(f"swing must be 'studio' or 'full', got {swing!r}")
    return swing


def _channels(x: torch.Tensor, what: str) -> None:
    if x.dim() < 3 or x.shape[-3] != 3:
        raise ValueError(f"{what} takes (..., 3, H, W) images, got shape {tuple(x.shape)}")


def _per_channel(v: Sequence[float] | torch.Tensor | float, what: str, like: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(v, dtype=like.dtype, device=like.device).reshape(-1)
    if t.numel() not in (1, 3):
        raise ValueError(f"{what} needs 1 or 3 values (per RGB channel), got {t.numel()}")
    return t.expand(3).reshape(3, 1, 1)


def _mix(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``matrix @ pixel`` for every pixel of a (..., 3, H, W) tensor."""
    return torch.einsum("ij,...jhw->...ihw", matrix, x)


def rgb2centered_yuv(input: torch.Tensor, swing: str = "studio") -> torch.Tensor:
    """RGB (0..255, channels on dim -3) to centered YUV444 BT.601, as float integer values.

    ``swing="studio"``: Y -112..107, U/V -112..112; ``"full"`` (what the BPU's pyramid
    delivers): -128..127. Samples are rounded half up and clamped to the swing's range.
    """
    _channels(input, "rgb2centered_yuv")
    m, off, rng = _RGB2YUV[_swing(swing)]
    x = input.to(torch.float64)
    yuv = _mix(x, torch.tensor(m, dtype=torch.float64, device=x.device))
    yuv = yuv + torch.tensor(off, dtype=torch.float64, device=x.device).reshape(3, 1, 1)
    lo = torch.tensor([r[0] for r in rng], dtype=torch.float64, device=x.device).reshape(3, 1, 1)
    hi = torch.tensor([r[1] for r in rng], dtype=torch.float64, device=x.device).reshape(3, 1, 1)
    yuv = torch.minimum(torch.maximum(numerics.round_half_up(yuv), lo), hi) - 128.0
    return yuv.to(input.dtype if input.is_floating_point() else torch.float32)


def bgr2centered_yuv(input: torch.Tensor, swing: str = "studio") -> torch.Tensor:
    """Like :func:`rgb2centered_yuv` for BGR channel order."""
    _channels(input, "bgr2centered_yuv")
    return rgb2centered_yuv(input.flip(-3), swing)


def _yuv2rgb_float(yuv_centered: torch.Tensor, swing: str) -> torch.Tensor:
    """Centered YUV (float64) to RGB in 0..255 (float64, clamped), by the exact inverse matrix."""
    m, off, _ = _RGB2YUV[_swing(swing)]
    inv = torch.linalg.inv(torch.tensor(m, dtype=torch.float64))
    yuv = yuv_centered + 128.0 - torch.tensor(off, dtype=torch.float64).reshape(3, 1, 1)
    return _mix(yuv, inv.to(yuv.device)).clamp(0.0, 255.0)


def _yuv2normalised(
    input: torch.Tensor,
    swing: str,
    mean: Sequence[float] | torch.Tensor,
    std: Sequence[float] | torch.Tensor,
    q_scale: float | torch.Tensor,
    bgr: bool,
) -> torch.Tensor:
    _channels(input, "centered_yuv2bgr" if bgr else "centered_yuv2rgb")
    rgb = _yuv2rgb_float(input.to(torch.float64), swing)
    if bgr:
        rgb = rgb.flip(-3)
    norm = (rgb - _per_channel(mean, "mean", rgb)) / _per_channel(std, "std", rgb)
    s = q_scale.detach().reshape(-1)[0] if isinstance(q_scale, torch.Tensor) else float(q_scale)
    codes = numerics.quantize(norm, s, "qint8")
    return numerics.dequantize(codes, s) if input.is_floating_point() else codes


def centered_yuv2rgb(
    input: torch.Tensor,
    swing: str = "studio",
    mean: Sequence[float] | torch.Tensor = (128.0,),
    std: Sequence[float] | torch.Tensor = (128.0,),
    q_scale: float | torch.Tensor = 1.0 / 128.0,
) -> torch.Tensor:
    """Centered YUV444 to normalised RGB, quantized at ``q_scale`` (for deployment).

    Steps: YUV -> RGB by ``swing``'s inverse BT.601 matrix, clamped to 0..255;
    ``(rgb - mean) / std`` per channel; quantize at ``q_scale``.

    * Integer input (the int8 codes of a QuantStub whose scale was set to 1, i.e. raw
      centered YUV): returns qint8 codes, ``numerics.quantize(norm, q_scale, "qint8")``
      (half up, saturating), with every step before it in float64.
    * Float input (raw centered YUV values, for checking): returns the values those codes
      represent, ``codes * q_scale`` in float32.

    Pass as ``q_scale`` the scale the converted model's first layer expects (the QAT
    QuantStub's scale). Traceable with ``torch.jit.trace`` and insertable into an fx graph
    with ``graph.call_function(centered_yuv2rgb, (node,), {"swing": "full"})``.
    """
    return _yuv2normalised(input, swing, mean, std, q_scale, bgr=False)


def centered_yuv2bgr(
    input: torch.Tensor,
    swing: str = "studio",
    mean: Sequence[float] | torch.Tensor = (128.0,),
    std: Sequence[float] | torch.Tensor = (128.0,),
    q_scale: float | torch.Tensor = 1.0 / 128.0,
) -> torch.Tensor:
    """Like :func:`centered_yuv2rgb` with BGR output order (``mean``/``std`` in BGR order)."""
    return _yuv2normalised(input, swing, mean, std, q_scale, bgr=True)
