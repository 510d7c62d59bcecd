"""FakeQuantize: exactness against the integer rules, half-up ties, the STE gradient, switches and modes."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from backends.common import numerics as nx
from qir.quantization import (
    CalibFakeQuantize,
    FakeQuantize,
    FakeQuantState,
    MinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
    disable_fake_quant,
    disable_observer,
    enable_fake_quant,
    enable_observer,
    fake_quantize,
    set_fake_quantize,
)


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
def test_forward_is_bit_identical_to_quantize_then_dequantize(dtype: str) -> None:
    torch.manual_seed(0)
    fq = FakeQuantize(observer=MovingAveragePerTensorMinMaxObserver, dtype=dtype, averaging_constant=1)
    x = torch.randn(8, 16, 5, 5) * 3
    y = fq(x)
    s = fq.scale
    assert torch.equal(y, nx.dequantize(nx.quantize(x, s, dtype), s))


def test_per_channel_forward_is_bit_identical() -> None:
    torch.manual_seed(1)
    fq = FakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, ch_axis=0, averaging_constant=1)
    w = torch.randn(6, 3, 3, 3) * torch.arange(1, 7).reshape(6, 1, 1, 1)
    y = fq(w)
    assert fq.scale.shape == (6,) and fq.zero_point.shape == (6,)
    assert torch.equal(y, nx.dequantize(nx.quantize(w, fq.scale, "qint8", axis=0), fq.scale, axis=0))


def test_ties_round_half_up() -> None:
    s = torch.tensor([0.25])
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5]) * 0.25
    y = fake_quantize(x, s)
    assert (y / 0.25).tolist() == [1.0, 2.0, 3.0, 0.0, -1.0, -2.0]


def test_saturates_at_the_dtype_range() -> None:
    y = fake_quantize(torch.tensor([1000.0, -1000.0]), torch.tensor([1.0]), "qint8")
    assert y.tolist() == [127.0, -128.0]
    y16 = fake_quantize(torch.tensor([1e6, -1e6]), torch.tensor([1.0]), "qint16")
    assert y16.tolist() == [32767.0, -32768.0]


def test_straight_through_gradient_is_zero_where_clipped() -> None:
    s = torch.tensor([1.0])
    x = torch.tensor([-129.0, -128.4, -5.2, 0.0, 126.6, 127.4, 127.5, 300.0], requires_grad=True)
    y = fake_quantize(x, s)
    (y * torch.arange(1.0, 9.0)).sum().backward()
    # -128.4 -> -128 (in range); 127.5 -> 128 (clipped): the output is flat there, so no gradient.
    assert x.grad is not None
    assert x.grad.tolist() == [0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0]


def test_scale_gets_no_gradient_and_buffers_are_not_parameters() -> None:
    fq = FakeQuantize()
    assert list(fq.parameters()) == []
    assert {"scale", "zero_point"} <= set(dict(fq.named_buffers()))
    x = torch.randn(10, requires_grad=True)
    fq(x).sum().backward()
    assert fq.scale.grad is None


def test_gradcheck_free_path_keeps_dtype() -> None:
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = fake_quantize(x, torch.tensor([0.1]))
    assert y.dtype == torch.float64


def test_switches_per_module() -> None:
    fq = FakeQuantize(averaging_constant=1)
    x = torch.tensor([-2.0, 0.3, 1.0])
    fq.disable_fake_quant()
    assert fq(x) is x and float(fq.scale) == pytest.approx(2.0 / 127.5)
    fq.enable_fake_quant().disable_observer()
    before = fq.scale.clone()
    fq(x * 10)
    assert torch.equal(fq.scale, before)


def test_mode_setter_and_model_helpers() -> None:
    model = nn.Sequential(nn.Linear(3, 3), FakeQuantize(), nn.Sequential(FakeQuantize(dtype="qint16")))
    fqs = [m for m in model.modules() if isinstance(m, FakeQuantize)]
    assert set_fake_quantize(model, FakeQuantState.CALIBRATION) is model
    assert all(f.observer_enabled and not f.fake_quant_enabled for f in fqs)
    set_fake_quantize(model, "validation")
    assert all(not f.observer_enabled and f.fake_quant_enabled for f in fqs)
    set_fake_quantize(model, "QAT")
    assert all(f.observer_enabled and f.fake_quant_enabled for f in fqs)
    disable_observer(model)
    disable_fake_quant(model)
    assert not any(f.observer_enabled or f.fake_quant_enabled for f in fqs)
    enable_observer(model)
    enable_fake_quant(model)
    assert all(f.observer_enabled and f.fake_quant_enabled for f in fqs)
    with pytest.raises(ValueError, match="valid: QAT, CALIBRATION, VALIDATION"):
        set_fake_quantize(model, "train")


def test_calibration_mode_computes_float_and_validation_freezes() -> None:
    fq = FakeQuantize(averaging_constant=1)
    set_fake_quantize(fq, FakeQuantState.CALIBRATION)
    x = torch.randn(100)
    assert torch.equal(fq(x), x)
    calibrated = fq.scale.clone()
    set_fake_quantize(fq, FakeQuantState.VALIDATION)
    y = fq(x * 100)
    assert torch.equal(fq.scale, calibrated)
    assert torch.equal(y, nx.dequantize(nx.quantize(x * 100, calibrated, "qint8"), calibrated))


def test_calib_fake_quantize_starts_observe_only() -> None:
    fq = CalibFakeQuantize(observer=MinMaxObserver)
    assert fq.observer_enabled and not fq.fake_quant_enabled and fq.kind == "calibration"


def test_fixed_scale_fake_quant_ignores_observer_kwargs_and_keeps_user_edits() -> None:
    fq = FakeQuantize(observer=MovingAveragePerTensorMinMaxObserver, averaging_constant=0.01, scale=1 / 128)
    assert fq.has_fixed_scale
    fq(torch.randn(10) * 100)
    assert fq.scale.tolist() == [1 / 128]
    fq.scale.fill_(1.0)
    assert fq(torch.tensor([2.4])).tolist() == [2.0]


def test_per_channel_fake_quant_state_dict_into_fresh_module() -> None:
    factory = FakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, ch_axis=0)
    src = factory()
    src(torch.randn(5, 2))
    dst = factory()
    dst.load_state_dict(src.state_dict())
    dst.disable_observer()
    x = torch.randn(5, 2)
    assert torch.equal(dst(x), src.disable_observer()(x))


def test_per_channel_without_scale_says_what_to_do() -> None:
    fq = FakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, ch_axis=0)
    fq.disable_observer()
    with pytest.raises(RuntimeError, match="observe a batch first"):
        fq(torch.randn(3, 3))


def test_with_args_chains_and_merges() -> None:
    f1 = FakeQuantize.with_args(observer=MovingAveragePerTensorMinMaxObserver, dtype="qint8")
    f2 = f1.with_args(dtype="qint16", averaging_constant=0.5)
    assert f1.keywords["dtype"] == "qint8"  # the first factory is unchanged
    m = f2()
    assert m.dtype.name == "qint16" and m.observer.averaging_constant == 0.5  # type: ignore[union-attr]
    assert "averaging_constant=0.5" in repr(f2)


def test_with_args_checks_observer_arguments_early() -> None:
    with pytest.raises(TypeError, match="MinMaxObserver got unknown argument"):
        FakeQuantize.with_args(observer=MinMaxObserver, averaging_constant=0)
    with pytest.raises(TypeError, match="not an instance"):
        FakeQuantize.with_args(observer=MinMaxObserver())
    with pytest.raises(ValueError, match="'qint8' or 'qint16'"):
        FakeQuantize.with_args(dtype="qint32")


def test_no_host_sync_ops_in_the_hot_path() -> None:
    # A host sync would go through Tensor.item / __float__ / __bool__; count them during a step.
    # The path off the CPU: on the CPU the observer's fast update reads two numbers on the host
    # (no device to wait for), and declines any other device before reading anything.
    fq = FakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, ch_axis=0)
    fq(torch.randn(4, 3))
    assert not fq.observer._fast_update(torch.empty(4, 3, device="meta"))
    fq.observer._fast_update = lambda x: False  # type: ignore[method-assign]
    calls: list[str] = []

    def counting(name: str) -> Callable[..., Any]:
        orig = getattr(torch.Tensor, name)

        def wrapped(self: torch.Tensor, *args: Any) -> Any:
            calls.append(name)
            return orig(self, *args)

        return wrapped

    with ExitStack() as stack:
        for name in ("item", "__float__", "__bool__"):
            stack.enter_context(mock.patch.object(torch.Tensor, name, counting(name)))
        fq(torch.randn(4, 3, requires_grad=True)).sum().backward()
    assert calls == []


def test_init_from_carries_a_calibrated_scale_into_qat() -> None:
    calib = CalibFakeQuantize(observer=MinMaxObserver)
    calib(torch.tensor([-0.5, 3.0]))
    qat = FakeQuantize(averaging_constant=0.01)
    assert qat.init_from(calib) is qat
    assert torch.equal(qat.scale, calib.scale)
    qat.disable_observer()
    x = torch.randn(10)
    assert torch.equal(qat(x), nx.dequantize(nx.quantize(x, calib.scale, "qint8"), calib.scale))
    qat.enable_observer()
    qat(torch.tensor([-1.0, 1.0]))  # the moving average continues from the calibrated range
    assert float(qat.observer.max_val) == pytest.approx(3.0 + 0.01 * (1.0 - 3.0))


def test_init_from_per_channel_and_mismatches() -> None:
    src = FakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, ch_axis=0)
    src(torch.randn(4, 3))
    dst = FakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, ch_axis=0).init_from(src)
    assert torch.equal(dst.scale, src.scale) and dst.zero_point.shape == (4,)
    with pytest.raises(ValueError, match="dtype and ch_axis must match"):
        FakeQuantize(dtype="qint16").init_from(FakeQuantize())
    fixed = FakeQuantize(scale=0.5).init_from(FakeQuantize())
    assert fixed.scale.tolist() == [0.5]


def test_half_and_double_keep_scales_float32() -> None:
    model = nn.Sequential(nn.Linear(2, 2), FakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, ch_axis=0))
    model(torch.randn(3, 2))
    for cast in (model.half, model.double):
        cast()
        fq = model[1]
        assert isinstance(fq, FakeQuantize)
        assert fq.scale.dtype == torch.float32 and fq.observer.min_val.dtype == torch.float32
        assert fq.zero_point.dtype == torch.int32
    assert model[0].weight.dtype == torch.float64
    out = model(torch.randn(3, 2, dtype=torch.float64))
    assert out.dtype == torch.float64
