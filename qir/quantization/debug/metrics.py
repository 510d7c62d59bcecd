"""Similarity of two tensors: cosine, relative L2, max abs error, error in output LSBs, SQNR."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["METRICS", "Metric", "cosine", "max_abs", "relative_l2", "sqnr_db"]


def _flat(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return a.detach().reshape(-1).to(torch.float64), b.detach().reshape(-1).to(torch.float64)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors; 1.0 when both are all zeros, 0.0 when only one is."""
    x, y = _flat(a, b)
    nx, ny = float(x.norm()), float(y.norm())
    if nx == 0.0 or ny == 0.0:
        return 1.0 if nx == ny else 0.0
    return float(torch.dot(x, y)) / (nx * ny)


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||b - a|| / ||a||`` (``a`` is the reference); 0 for equal tensors, inf when only ``a`` is all zeros."""
    x, y = _flat(a, b)
    num, den = float((y - x).norm()), float(x.norm())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    x, y = _flat(a, b)
    return float((y - x).abs().max()) if x.numel() else 0.0


def sqnr_db(a: torch.Tensor, b: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10 log10(||a||^2 / ||b - a||^2)`` in dB (inf when equal)."""
    rel = relative_l2(a, b)
    if rel == 0.0:
        return math.inf
    return -20.0 * math.log10(rel) if math.isfinite(rel) else -math.inf


@dataclass(frozen=True)
class Metric:
    """A named tensor comparison and whether a higher value means more similar."""

    name: str
    fn: Callable[[torch.Tensor, torch.Tensor], float]
    higher_is_better: bool

    def worse(self, x: float, y: float) -> bool:
        """True when ``x`` is less similar than ``y``."""
        return x < y if self.higher_is_better else x > y


METRICS: dict[str, Metric] = {
    "cosine": Metric("cosine", cosine, True),
    "relative_l2": Metric("relative_l2", relative_l2, False),
    "max_abs": Metric("max_abs", max_abs, False),
    "sqnr": Metric("sqnr", sqnr_db, True),
}


def metric(name: str | Metric) -> Metric:
    """A :class:`Metric` by name (``cosine``, ``relative_l2``, ``max_abs``, ``sqnr``) or as given."""
    if isinstance(name, Metric):
        return name
    key = str(name).lower()
    if key not in METRICS:
        raise ValueError(f"unknown similarity metric {name!r}; valid: {', '.join(METRICS)}")
    return METRICS[key]
