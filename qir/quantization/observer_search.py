"""Calibration observers that search the histogram of ``|x|`` for the best amax: MSE, KL, mix.

All three extend :class:`~qir.quantization.observer.HistogramObserver` (same histogram,
same exact range doubling, same DDP reduction) and differ only in how amax is chosen
from it. Candidates are bin edges; each is scored for all candidates at once with tensor
ops (a candidates x bins matrix), once per calibration batch. Rules in docs/semantics.md.
"""

from __future__ import annotations

import math

import torch

from backends.common.numerics import MIN_SCALE, DTypeLike, scale_denominator
from qir.quantization.observer import HistogramObserver, percentile_amax

__all__ = ["KLObserver", "MSEObserver", "MixObserver", "MIX_METHODS"]

#: At most this many candidate amax values are scored per update (MSE; KL is dearer per candidate).
MAX_CANDIDATES = 256
MAX_KL_CANDIDATES = 128
#: Methods a :class:`MixObserver` chooses among.
MIX_METHODS = ("min_max", "percentile", "mse", "kl")


def _candidate_edges(bins: int, first: int, most: int = MAX_CANDIDATES) -> torch.Tensor:
    """Bin indices k (amax = k * width), from ``first`` to ``bins`` (always included), at most ``most`` of them."""
    first = max(1, min(first, bins))
    step = max(1, math.ceil((bins - first + 1) / most))
    ks = torch.arange(bins, first - 1, -step, dtype=torch.float64).flip(0)
    return ks


def _quantized_centres(centres: torch.Tensor, scales: torch.Tensor, qmax: int) -> torch.Tensor:
    """``min(floor(c / s + 1/2), qmax) * s`` for every (candidate scale, bin centre): shape (C, B)."""
    codes = torch.floor(centres[None, :] / scales[:, None] + 0.5).clamp(max=qmax)
    return codes * scales[:, None]


def mse_amax(histogram: torch.Tensor, hist_range: float, dtype_den: float, qmax: int) -> torch.Tensor:
    """The candidate amax with the least expected squared quantization error over the histogram.

    Inside the range a value's rounding error is uniform (``s^2 / 12``); beyond ``qmax * s``
    it saturates, error ``(c - qmax * s)^2`` at the bin centre ``c``.
    """
    bins = histogram.numel()
    width = hist_range / bins
    centres = (torch.arange(bins, dtype=torch.float64, device=histogram.device) + 0.5) * width
    ks = _candidate_edges(bins, 1).to(histogram.device)
    scales = ks * width / dtype_den
    top = (scales * qmax)[:, None]
    clipped = centres[None, :] > top
    err = torch.where(clipped, (centres[None, :] - top) ** 2, (scales**2 / 12.0)[:, None])
    cost = (err * histogram[None, :]).sum(1)
    return (ks[int(torch.argmin(cost))] * width).reshape(1)


def kl_amax(histogram: torch.Tensor, hist_range: float, dtype_den: float, qmax: int) -> torch.Tensor:
    """The candidate amax whose quantized distribution is closest (KL) to the clipped one (TensorRT's rule).

    For a candidate keeping the first ``i`` bins: ``P`` is the histogram cut at ``i`` with the
    clipped mass added to bin ``i - 1``; ``Q`` spreads each quantization level's mass of the
    *unclipped* bins evenly over that level's non-empty bins, so clipping costs divergence.
    Candidates keep at least ``qmax + 1`` bins (one bin per level); with fewer bins than
    levels (qint16 with the default 2048 bins) the histogram cannot tell levels apart and the
    full range is returned.
    """
    bins = histogram.numel()
    levels = qmax + 1
    width = hist_range / bins
    if bins < 2 * levels:
        return torch.tensor([hist_range], dtype=torch.float64)
    # float32 is plenty for a divergence between histograms and halves the cost.
    dev, ft = histogram.device, torch.float32
    histogram = histogram.to(ft)
    centres = (torch.arange(bins, dtype=ft, device=dev) + 0.5) * width
    ks = _candidate_edges(bins, levels, MAX_KL_CANDIDATES).to(device=dev, dtype=ft)
    scales = ks * width / dtype_den
    j = torch.arange(bins, device=dev)
    kept = j[None, :] < ks[:, None]  # (C, B)
    zero = torch.zeros((), dtype=ft, device=dev)
    h = histogram[None, :]
    ref = torch.where(kept, h, zero)  # the unclipped bins
    p = ref.clone()
    p.scatter_add_(1, (ks.long() - 1)[:, None], torch.where(kept, zero, h).sum(1, keepdim=True))
    # Levels are monotone in the bin index, so each level is a run of bins: its mass and its
    # count of non-empty bins are differences of prefix sums at the run's ends, found with a
    # running max / min of the run-boundary positions.
    lvl = torch.floor(centres[None, :] / scales[:, None] + 0.5).clamp(max=qmax)
    lvl = torch.where(kept, lvl, torch.full_like(lvl, levels))  # dropped bins: a spare level
    new_run = torch.ones_like(kept)
    new_run[:, 1:] = lvl[:, 1:] != lvl[:, :-1]
    start = torch.where(new_run, j[None, :], torch.zeros_like(j)[None, :]).cummax(1).values
    run_ends = torch.ones_like(kept)
    run_ends[:, :-1] = new_run[:, 1:]
    big = torch.full_like(j, bins)[None, :]
    end = torch.where(run_ends, j[None, :] + 1, big).flip(1).cummin(1).values.flip(1)
    cum_h = torch.cat([zero.reshape(1), torch.cumsum(histogram, 0)])
    cum_n = torch.cat([zero.reshape(1), torch.cumsum((histogram > 0).to(ft), 0)])
    mass = cum_h[end] - cum_h[start]
    count = cum_n[end] - cum_n[start]
    q = torch.where(ref > 0, mass / count.clamp_min(1.0), zero)
    p = p / p.sum(1, keepdim=True)
    q = q / q.sum(1, keepdim=True).clamp_min(1e-30)
    # A clipped-mass bin that was empty has Q = 0: a tiny floor keeps the divergence finite but large.
    q = q.clamp_min(1e-12)
    kl = torch.where(p > 0, p * torch.log(p / q), torch.zeros_like(p)).sum(1)
    return (ks[int(torch.argmin(kl))].to(torch.float64) * width).reshape(1)


def histogram_cosine(
    histogram: torch.Tensor, hist_range: float, amax: torch.Tensor, dtype_den: float, qmax: int
) -> float:
    """Cosine similarity of ``|x|`` with its fake-quantized value at ``amax``, estimated at the bin centres."""
    bins = histogram.numel()
    width = hist_range / bins
    centres = (torch.arange(bins, dtype=torch.float64, device=histogram.device) + 0.5) * width
    s = (amax.to(torch.float64).reshape(1) / dtype_den).clamp_min(MIN_SCALE)
    q = _quantized_centres(centres, s, qmax)[0]
    num = (histogram * centres * q).sum()
    den = torch.sqrt((histogram * centres**2).sum() * (histogram * q**2).sum())
    return float(num / den) if float(den) > 0 else 0.0


class MSEObserver(HistogramObserver):
    """Calibration observer: amax minimises the expected squared quantization error of ``|x|``.

    Uses the histogram of every batch seen (see :class:`HistogramObserver`); up to 256
    candidate amax values (bin edges) are scored per batch.
    """

    def _amax_from_histogram(self) -> torch.Tensor:
        return mse_amax(self.histogram, float(self.hist_range), scale_denominator(self.dtype), self.qmax)


class KLObserver(HistogramObserver):
    """Calibration observer: amax minimises the KL divergence between the clipped and quantized histograms.

    TensorRT's entropy calibration on the histogram of ``|x|`` (:func:`kl_amax`). Meant for
    qint8; for qint16 the default 2048 bins are fewer than the levels and the observer keeps
    the full range (as :class:`~qir.quantization.observer.MinMaxObserver` would).
    """

    def _amax_from_histogram(self) -> torch.Tensor:
        return kl_amax(self.histogram, float(self.hist_range), scale_denominator(self.dtype), self.qmax)


class MixObserver(HistogramObserver):
    """Calibration observer that picks, per tensor, the method whose amax keeps ``x`` most similar.

    Each of ``methods`` (from ``"min_max"``, ``"percentile"``, ``"mse"``, ``"kl"``) proposes an
    amax from the same histogram; the one whose fake-quantized ``|x|`` has the highest cosine
    similarity with ``|x|`` (estimated at the bin centres) wins. ``choice`` names the winner
    after each batch (a plain attribute: it is not part of the state dict).
    """

    def __init__(
        self,
        methods: tuple[str, ...] = MIX_METHODS,
        percentile: float = 99.99,
        bins: int = 2048,
        dtype: DTypeLike = "qint8",
        ch_axis: int | None = None,
        eps: float = MIN_SCALE,
        sync_ranks: bool = True,
        nonfinite: str = "skip",
    ) -> None:
        methods = tuple(methods)
        bad = [m for m in methods if m not in MIX_METHODS]
        if bad or not methods:
            raise ValueError(f"MixObserver methods must be a non-empty subset of {MIX_METHODS}, got {methods}")
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        super().__init__(bins=bins, dtype=dtype, ch_axis=ch_axis, eps=eps, sync_ranks=sync_ranks, nonfinite=nonfinite)
        self.methods = methods
        self.percentile = float(percentile)
        self.choice: str | None = None

    def candidates(self) -> dict[str, torch.Tensor]:
        """Each method's amax (float64, shape (1,)) from the current histogram, capped at the true amax."""
        rng = float(self.hist_range)
        den, qmax = scale_denominator(self.dtype), self.qmax
        true_amax = torch.maximum(-self.min_val, self.max_val).to(torch.float64)
        found = {
            "min_max": lambda: true_amax,
            "percentile": lambda: percentile_amax(self.histogram, self.hist_range, self.percentile),
            "mse": lambda: mse_amax(self.histogram, rng, den, qmax),
            "kl": lambda: kl_amax(self.histogram, rng, den, qmax),
        }
        return {m: torch.minimum(found[m]().to(torch.float64).reshape(1), true_amax) for m in self.methods}

    def _amax_from_histogram(self) -> torch.Tensor:
        rng, den = float(self.hist_range), scale_denominator(self.dtype)
        amaxes = self.candidates()
        scored = {m: histogram_cosine(self.histogram, rng, a, den, self.qmax) for m, a in amaxes.items()}
        best = max(self.methods, key=lambda m: scored[m])  # ties: the earlier method in `methods`
        self.choice = best
        return amaxes[best]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, methods={self.methods}, choice={self.choice}"
