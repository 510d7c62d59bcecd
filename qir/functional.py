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
-112..107, U/V -112..112; full -128..127. The inverse (:func:`centered_yuv2rgb`) is the
BPU's integer rule built from the exact inverse matrices (``backends.common.yuv_rules``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backends.common import numerics
from backends.common.yuv_rules import RGB2YUV, SWINGS, yuv2rgb_codes, yuv2rgb_params

__all__ = ["bgr2centered_yuv", "centered_yuv2bgr", "centered_yuv2rgb", "rgb2centered_yuv"]

_SWINGS = SWINGS
_RGB2YUV = RGB2YUV


def _swing(swing: str) -> str:
    if swing not in _SWINGS:
        raise ValueError(f"swing must be 'studio' or 'full', got {swing!r}")
    return swing


def _channels(x: torch.Tensor, what: str) -> None:
    if x.dim() < 3 or x.shape[-3] != 3:
        raise ValueError(f"{what} takes (..., 3, H, W) images, got shape {tuple(x.shape)}")


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


def _yuv2normalised(
    input: torch.Tensor,
    swing: str,
    mean: Sequence[float] | torch.Tensor,
    std: Sequence[float] | torch.Tensor,
    q_scale: float | torch.Tensor,
    bgr: bool,
) -> torch.Tensor:
    _channels(input, "centered_yuv2bgr" if bgr else "centered_yuv2rgb")
    params = yuv2rgb_params(_swing(swing), mean, std, q_scale, bgr)
    if not input.is_floating_point():
        return yuv2rgb_codes(input, params)
    # float input: the codes a QuantStub at scale 1 gives it, then the same integer rule
    codes = yuv2rgb_codes(numerics.quantize(input, 1.0, "qint8"), params)
    return numerics.dequantize(codes, float(torch.as_tensor(q_scale, dtype=torch.float32).reshape(-1)[0]))


def centered_yuv2rgb(
    input: torch.Tensor,
    swing: str = "studio",
    mean: Sequence[float] | torch.Tensor = (128.0,),
    std: Sequence[float] | torch.Tensor = (128.0,),
    q_scale: float | torch.Tensor = 1.0 / 128.0,
) -> torch.Tensor:
    """Centered YUV444 to normalised RGB, quantized at ``q_scale`` (for deployment).

    What the BPU computes (``backends.common.yuv_rules``, docs/semantics.md "Centered YUV to
    RGB"): a 1x1 convolution of the YUV codes with ``swing``'s inverse BT.601 matrix and the
    ``(rgb - mean) / std`` normalisation folded into int8 weights and an int32 bias, requantized
    to qint8 at ``q_scale``, clamped per channel to the codes of RGB 0 and 255. Within one code
    of the float64 formula.

    * Integer input (the int8 codes of a QuantStub whose scale was set to 1, i.e. raw
      centered YUV): returns the qint8 codes.
    * Float input (raw centered YUV values, for checking): rounded half up to int8 codes as a
      scale-1 QuantStub would, then the same codes, returned as ``codes * q_scale`` in float32.

    Pass as ``q_scale`` the scale the converted model's first layer expects (the QAT
    QuantStub's scale). Traceable with ``torch.jit.trace`` and insertable into an fx graph
    with ``graph.call_function(centered_yuv2rgb, (node,), {"swing": "full"})``; ``check_model``
    and ``compile_model`` know the call (docs/tutorial.md, "Deploying on YUV camera input").
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
