"""Observers: the scale formula, moving-average semantics, per-channel, percentile, fixed scale, state dicts."""

from __future__ import annotations

import math

import pytest
import torch

from backends.common.numerics import MIN_SCALE
from qir.ir.types import DType
from qir.quantization import (
    FixedScaleObserver,
    MinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
    PercentileObserver,
)


def _f(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


@pytest.mark.parametrize(("dtype", "denom"), [("qint8", 127.5), ("qint16", 32767.5), (DType.qint16, 32767.5)])
def test_scale_is_amax_over_half_the_range(dtype: object, denom: float) -> None:
    obs = MinMaxObserver(dtype=dtype)  # type: ignore[arg-type]
    obs(torch.tensor([-3.0, 1.0, 2.0]))
    scale, zp = obs.calculate_qparams()
    assert scale.shape == (1,) and zp.tolist() == [0] and zp.dtype == torch.int32
    assert float(scale) == _f(3.0 / denom)
    assert obs.min_val.tolist() == [-3.0] and obs.max_val.tolist() == [2.0]


def test_all_zero_input_clamps_to_eps() -> None:
    obs = MinMaxObserver()
    obs(torch.zeros(10))
    assert float(obs.scale) == _f(MIN_SCALE)
    custom = MinMaxObserver(eps=1e-3)
    custom(torch.zeros(3))
    assert float(custom.scale) == _f(1e-3)


def test_unobserved_observer_has_unit_scale_and_returns_input() -> None:
    obs = MovingAveragePerTensorMinMaxObserver()
    assert obs.scale.tolist() == [1.0]
    x = torch.randn(5)
    assert obs(x) is x


def test_averaging_constant_zero_keeps_first_batch() -> None:
    obs = MovingAveragePerTensorMinMaxObserver(averaging_constant=0)
    obs(torch.tensor([-1.0, 2.0]))
    obs(torch.tensor([-10.0, 20.0]))
    assert obs.min_val.tolist() == [-1.0] and obs.max_val.tolist() == [2.0]


def test_averaging_constant_one_uses_current_batch_exactly() -> None:
    obs = MovingAveragePerTensorMinMaxObserver(averaging_constant=1)
    obs(torch.tensor([-1e-8, 1e-8]))
    obs(torch.tensor([-0.3, 0.7]))
    assert obs.min_val.tolist() == [_f(-0.3)] and obs.max_val.tolist() == [_f(0.7)]


def test_averaging_constant_default_is_exponential_moving_average() -> None:
    obs = MovingAveragePerTensorMinMaxObserver()
    assert obs.averaging_constant == 0.01
    obs(torch.tensor([-1.0, 1.0]))
    obs(torch.tensor([-2.0, 3.0]))
    assert obs.max_val.item() == pytest.approx(1.0 + 0.01 * (3.0 - 1.0))
    assert obs.min_val.item() == pytest.approx(-1.0 + 0.01 * (-2.0 + 1.0))
    assert obs.scale.item() == pytest.approx(1.02 / 127.5)


def test_averaging_constant_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"averaging_constant must be in \[0, 1\]"):
        MovingAveragePerTensorMinMaxObserver(averaging_constant=1.5)


def test_per_tensor_observer_ignores_ch_axis_as_the_seeds_pass_it() -> None:
    obs = MovingAveragePerTensorMinMaxObserver(ch_axis=0, averaging_constant=0)
    obs(torch.randn(4, 3))
    assert obs.scale.shape == (1,) and not obs.is_per_channel


def test_per_channel_moving_average() -> None:
    obs = MovingAveragePerChannelMinMaxObserver(ch_axis=1, averaging_constant=1)
    x = torch.tensor([[[-1.0, 2.0], [0.5, -4.0], [0.0, 0.0]]])  # (1, 3, 2): channels along axis 1
    obs(x)
    assert obs.min_val.tolist() == [-1.0, -4.0, 0.0] and obs.max_val.tolist() == [2.0, 0.5, 0.0]
    expected = [_f(2.0 / 127.5), _f(4.0 / 127.5), _f(MIN_SCALE)]
    assert obs.scale.tolist() == expected
    with pytest.raises(ValueError, match="tracked 3 channels"):
        obs(torch.randn(1, 4, 2))


def test_minmax_per_channel_is_running_extreme() -> None:
    obs = MinMaxObserver(ch_axis=0)
    obs(torch.tensor([[1.0, -1.0], [2.0, 0.0]]))
    obs(torch.tensor([[0.5, 0.5], [-3.0, 1.0]]))
    assert obs.min_val.tolist() == [-1.0, -3.0] and obs.max_val.tolist() == [1.0, 2.0]


def test_per_channel_state_dict_loads_into_a_fresh_observer() -> None:
    src = MovingAveragePerChannelMinMaxObserver(ch_axis=0, dtype="qint16")
    src(torch.randn(6, 3, 3, 3))
    dst = MovingAveragePerChannelMinMaxObserver(ch_axis=0, dtype="qint16")
    assert dst.scale.numel() == 0
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.scale, src.scale) and torch.equal(dst.calculate_qparams()[0], src.scale)


def test_per_channel_qparams_before_data_raise() -> None:
    with pytest.raises(RuntimeError, match="has not observed any data"):
        MovingAveragePerChannelMinMaxObserver().calculate_qparams()


def test_with_args_rejects_unknown_arguments_naming_valid_ones() -> None:
    with pytest.raises(TypeError, match=r"unknown argument\(s\) averaging.*valid: dtype, ch_axis"):
        MinMaxObserver.with_args(averaging=0.1)


def test_bad_dtype_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="'qint8' or 'qint16'"):
        MinMaxObserver(dtype="qint32")
    with pytest.raises(ValueError, match="unknown"):
        MinMaxObserver(dtype="int4")


def test_percentile_100_is_the_true_amax() -> None:
    obs = PercentileObserver(percentile=100.0)
    obs(torch.tensor([-0.25, 0.5, 3.0]))
    assert float(obs.scale) == _f(3.0 / 127.5)


def test_percentile_cuts_outliers_within_one_bin() -> None:
    torch.manual_seed(0)
    obs = PercentileObserver(percentile=99.0, bins=1024)
    x = torch.randn(100_000)
    obs(x)
    q = torch.quantile(x.abs(), 0.99).item()
    amax = float(obs.scale) * 127.5
    assert q <= amax <= q + float(obs.hist_range) / 1024 + 1e-6


def test_percentile_range_grows_by_exact_doubling() -> None:
    obs = PercentileObserver(percentile=100.0, bins=8)
    obs(torch.full((4,), 1.0))
    obs(torch.full((4,), 3.5))  # range 1 -> 2 -> 4
    assert float(obs.hist_range) == 4.0
    assert obs.histogram.sum().item() == 8.0
    # The 1.0s sat in the last bin over [0, 1]; two pair-merges move them to bin 1 of [0, 4].
    assert obs.histogram[1].item() == 4.0
    assert float(obs.scale) == _f(3.5 / 127.5)


def test_percentile_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="percentile must be in"):
        PercentileObserver(percentile=0)
    with pytest.raises(ValueError, match="bins must be an even number"):
        PercentileObserver(bins=7)


def test_fixed_scale_observer_never_moves() -> None:
    obs = FixedScaleObserver(scale=1 / 128)
    obs(torch.randn(100) * 50)
    assert obs.scale.tolist() == [1 / 128]
    assert obs.min_val.tolist() == [-1.0] and obs.max_val.tolist() == [127 / 128]
    with pytest.raises(ValueError, match="positive and finite"):
        FixedScaleObserver(scale=-1.0)
    with pytest.raises(ValueError, match="positive and finite"):
        FixedScaleObserver(scale=math.inf)


def test_observing_does_not_touch_the_input() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    before = x.detach().clone()
    for obs in (MinMaxObserver(), MovingAveragePerChannelMinMaxObserver(), PercentileObserver()):
        out = obs(x)
        assert out is x
    assert torch.equal(x.detach(), before)


def test_empty_batches_change_nothing() -> None:
    for obs in (
        MovingAveragePerTensorMinMaxObserver(averaging_constant=0.5),
        MovingAveragePerChannelMinMaxObserver(ch_axis=1, averaging_constant=0.5),
        MinMaxObserver(),
        PercentileObserver(),
    ):
        obs(torch.empty(0, 3))  # before any data: still unobserved
        assert bool((obs.min_val > obs.max_val).all()) or obs.min_val.numel() == 0
        obs(torch.tensor([[-1.0, 2.0, 0.5]]))
        before = (obs.min_val.clone(), obs.max_val.clone(), obs.scale.clone())
        obs(torch.empty(0, 3))
        assert all(torch.equal(a, b) for a, b in zip(before, (obs.min_val, obs.max_val, obs.scale), strict=True))
