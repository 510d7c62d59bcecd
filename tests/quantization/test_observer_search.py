"""MSE, KL and mix observers: each picks the amax its criterion says, from the shared |x| histogram."""

from __future__ import annotations

import pytest
import torch

from qir.quantization import (
    HistogramObserver,
    KLObserver,
    MinMaxObserver,
    MixObserver,
    MSEObserver,
    PercentileObserver,
)
from qir.quantization.observer_search import MIX_METHODS, histogram_cosine


def _heavy_tailed(n: int = 50_000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[:20] *= 25.0  # a few large outliers: min-max wastes most of the int8 grid on them
    return x


def _quant_mse(x: torch.Tensor, scale: float, qmax: int = 127) -> float:
    q = torch.floor(x / scale + 0.5).clamp(-qmax - 1, qmax) * scale
    return float(((q - x) ** 2).mean())


def _amax(obs: HistogramObserver | MinMaxObserver) -> float:
    return float(obs.scale) * 127.5


def test_mse_observer_is_near_the_brute_force_optimum() -> None:
    x = _heavy_tailed()
    obs = MSEObserver()
    obs(x)
    grid = torch.linspace(0.5, float(x.abs().max()), 400)
    best = min(_quant_mse(x, float(a) / 127.5) for a in grid)
    got = _quant_mse(x, float(obs.scale))
    assert got <= 1.05 * best
    mm = MinMaxObserver()
    mm(x)
    assert got < 0.8 * _quant_mse(x, float(mm.scale))  # clipping the outliers pays


def test_kl_clips_outliers_but_keeps_a_uniform_range() -> None:
    x = _heavy_tailed()
    kl = KLObserver()
    kl(x)
    assert 2.0 < _amax(kl) < 0.5 * float(x.abs().max())
    u = torch.rand(50_000, generator=torch.Generator().manual_seed(1)) * 2 - 1
    kl_u = KLObserver()
    kl_u(u)
    assert _amax(kl_u) >= 0.9 * float(u.abs().max())


def test_kl_for_qint16_keeps_the_full_range() -> None:
    x = _heavy_tailed()
    kl, mm = KLObserver(dtype="qint16"), MinMaxObserver(dtype="qint16")
    kl(x)
    mm(x)
    assert torch.equal(kl.scale, mm.scale)


def test_mix_picks_the_most_similar_candidate_and_reports_it() -> None:
    x = _heavy_tailed()
    mix = MixObserver()
    mix(x)
    assert mix.choice in MIX_METHODS
    rng = float(mix.hist_range)
    scores = {m: histogram_cosine(mix.histogram, rng, a, 127.5, 127) for m, a in mix.candidates().items()}
    assert scores[mix.choice] == max(scores.values())
    assert torch.allclose(mix.scale.double() * 127.5, mix.candidates()[mix.choice], rtol=1e-6)
    only = MixObserver(methods=("min_max",))
    only(x)
    mm = MinMaxObserver()
    mm(x)
    assert only.choice == "min_max" and torch.equal(only.scale, mm.scale)


def test_mix_choice_differs_per_tensor() -> None:
    # Heavy tails, a Gaussian and a uniform tensor want different ranges; on the uniform one
    # every method finds the full range and the tie goes to the first method, min_max.
    g = torch.Generator().manual_seed(2)
    tensors = [_heavy_tailed(), torch.randn(50_000, generator=g), torch.linspace(-1.0, 1.0, 10_001)]
    choices = []
    for x in tensors:
        mix = MixObserver()
        mix(x)
        choices.append(mix.choice)
    assert choices[2] == "min_max"
    assert len(set(choices)) >= 2, choices


@pytest.mark.parametrize("cls", [MSEObserver, KLObserver, MixObserver])
def test_search_observers_accumulate_batches_and_skip_empty_ones(cls: type[HistogramObserver]) -> None:
    x = _heavy_tailed()
    one, two = cls(), cls()
    one(x)
    two(x[:25_000])
    two(torch.empty(0))
    two(x[25_000:])
    assert torch.equal(one.histogram, two.histogram) or float(two.hist_range) >= float(one.hist_range)
    assert float(two.scale) > 0 and float(two.scale) * 127.5 <= float(x.abs().max()) + 1e-6


def test_search_observers_state_dict_round_trip() -> None:
    x = _heavy_tailed()
    obs = KLObserver()
    obs(x)
    fresh = KLObserver()
    fresh.load_state_dict(obs.state_dict())
    assert torch.equal(fresh.scale, obs.scale) and torch.equal(fresh.histogram, obs.histogram)


def test_bad_mix_settings_are_named() -> None:
    with pytest.raises(ValueError, match="subset of"):
        MixObserver(methods=("min_max", "entropy"))
    with pytest.raises(ValueError, match="percentile must be in"):
        MixObserver(percentile=0)
    with pytest.raises(ValueError, match="bins must be an even number"):
        MSEObserver(bins=3)


def test_percentile_still_a_histogram_observer() -> None:
    assert issubclass(PercentileObserver, HistogramObserver)
