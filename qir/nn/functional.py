"""``qir.nn.functional``: the plugin's ``horizon_plugin_pytorch.nn.functional`` functions users call.

The data-movement helpers (``window_partition``, ``window_reverse``, ``channel_shuffle``) are
reshapes and permutes, so they trace into ordinary ops and run exactly on quantized codes in
QAT, conversion and the compiled program. The plugin's detection and point-cloud helpers
(``nms``, ``decode``, ``get_top_n``, ``point_pillars_scatter``, ...) are CPU post-processing
with no BPU form in qir: importing one raises an ``ImportError`` that says what to use
instead (docs/migration.md).
"""

from __future__ import annotations

import torch

__all__ = ["channel_shuffle", "window_partition", "window_reverse"]


def window_partition(x: torch.Tensor, window_size: int) -> torch.Tensor:
    """``(B, H, W, C)`` -> ``(B * H/ws * W/ws, ws, ws, C)``: non-overlapping ``ws x ws`` windows (Swin's)."""
    b, h, w, c = x.shape
    ws = int(window_size)
    x = x.reshape(b, h // ws, ws, w // ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, ws, ws, c)


def window_reverse(windows: torch.Tensor, window_size: int, h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`window_partition`: ``(B * nW, ws, ws, C)`` -> ``(B, H, W, C)``."""
    ws = int(window_size)
    c = windows.shape[-1]
    x = windows.reshape(-1, h // ws, w // ws, ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, h, w, c)


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    """ShuffleNet's channel shuffle of ``(N, C, H, W)`` with ``C = groups * k``: channel ``g * k + i`` moves
    to ``i * groups + g``."""
    n, c, h, w = x.shape
    g = int(groups)
    return x.reshape(n, g, c // g, h, w).transpose(1, 2).reshape(n, c, h, w)


_NOT_PROVIDED = {
    "nms": "non-maximum suppression is CPU post-processing: call torchvision.ops.nms (or your own) in a "
    "qir.utils.fx_helper.wrap'ed method after the DeQuantStub",
    "decode": "box decoding is CPU post-processing: write it in float in a qir.utils.fx_helper.wrap'ed method",
    "get_top_n": "top-n selection is CPU post-processing: use torch.topk in a qir.utils.fx_helper.wrap'ed method",
    "point_pillars_scatter": "the point-pillars ops have no integer rules in qir",
    "point_pillars_preprocess": "the point-pillars ops have no integer rules in qir",
    "bgr_to_yuv444": "use qir.functional.bgr2centered_yuv / rgb2centered_yuv (the seeds' conversions)",
}


def __getattr__(name: str) -> object:
    if name in _NOT_PROVIDED:
        # ImportError: `from qir.nn.functional import nms` would turn an AttributeError into a
        # bare "cannot import name" and lose the reason
        raise ImportError(f"qir.nn.functional.{name} is not supported by qir: {_NOT_PROVIDED[name]}")
    raise AttributeError(f"module 'qir.nn.functional' has no attribute {name!r}")
