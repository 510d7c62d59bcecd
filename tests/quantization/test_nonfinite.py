"""Non-finite data: an observer skips (and counts) or refuses a batch holding NaN or Inf,
so a NaN or Inf during calibration or QAT never reaches a scale (docs/qconfig.md)."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from qir.examples import DeployableDigitsNet
from qir.ir.numerics import quantize
from qir.march import march_scope
from qir.quantization import (
    FakeQuantize,
    KLObserver,
    MinMaxObserver,
    MixObserver,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
    MSEObserver,
    ObserverBase,
    PercentileObserver,
    convert_fx,
    fake_quantize,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    get_default_qconfig,
    nonfinite_report,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.debug import check_qconfig

KINDS: dict[str, Callable[..., ObserverBase]] = {
    "moving_average": lambda **kw: MovingAveragePerTensorMinMaxObserver(averaging_constant=0.5, **kw),
    "per_channel": lambda **kw: MovingAveragePerChannelMinMaxObserver(ch_axis=1, **kw),
    "min_max": lambda **kw: MinMaxObserver(**kw),
    "min_max_per_channel": lambda **kw: MinMaxObserver(ch_axis=0, **kw),
    "percentile": lambda **kw: PercentileObserver(percentile=99.0, bins=64, **kw),
    "mse": lambda **kw: MSEObserver(bins=64, **kw),
    "kl": lambda **kw: KLObserver(bins=512, **kw),
    "mix": lambda **kw: MixObserver(bins=512, **kw),
}


def _batches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randn(4, 3, 5, generator=g) * k for k in (1.0, 3.0, 2.0))
    nan = torch.randn(4, 3, 5, generator=g) * 50
    nan[1, 2, 3] = math.nan
    inf = torch.randn(4, 3, 5, generator=g) * 50
    inf[0, 0, 0] = -math.inf
    return [a, b, c], [a, nan, b, inf, c]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_observer_skips_and_counts_non_finite_batches(kind: str) -> None:
    clean, dirty = _batches()
    ref, obs = KINDS[kind](), KINDS[kind]()
    for x in clean:
        ref(x)
    with pytest.warns(RuntimeWarning, match="skipped") as caught:
        for x in dirty:
            assert obs(x) is x
        # Histogram observers read the host every batch and warn at once; min-max ones only count on the
        # device (no sync in a QAT step) and warn when the model changes state.
        set_fake_quantize(nn.Sequential(obs), "validation")
        set_fake_quantize(nn.Sequential(obs), "validation")
    assert len([w for w in caught if "skipped" in str(w.message)]) == 1  # warned once, not per batch
    assert int(obs.nonfinite_batches) == 2 and int(ref.nonfinite_batches) == 0
    assert obs.state_dict().keys() == ref.state_dict().keys()  # the counter is not saved
    assert "nonfinite_batches" not in obs.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.equal(obs.state_dict()[key], value), key
    assert torch.isfinite(obs.scale).all()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_raise_mode_stops_at_the_batch(kind: str) -> None:
    clean, dirty = _batches()
    obs = KINDS[kind](nonfinite="raise")
    obs(clean[0])
    before = obs.scale.clone()
    with pytest.raises(ValueError, match=r"saw a batch of shape \(4, 3, 5\) with 1 NaN and 0 Inf.*nonfinite='skip'"):
        obs(dirty[1])
    assert torch.equal(obs.scale, before)


def test_mode_is_checked_and_reaches_the_observer_through_a_qconfig() -> None:
    with pytest.raises(ValueError, match="nonfinite='ignore' is not a mode; valid: 'skip'"):
        MinMaxObserver(nonfinite="ignore")
    qc = get_default_qconfig(activation_qkwargs={"nonfinite": "raise"}, weight_qkwargs={"nonfinite": "raise"})
    act, w = qc.activation(), qc.weight()
    assert act.observer.nonfinite == "raise" and w.observer.nonfinite == "raise"
    with pytest.raises(ValueError, match="nonfinite='raise'"):
        act(torch.tensor([1.0, math.inf]))
    calib = get_default_calib_qconfig(calib_qkwargs={"nonfinite": "raise"})
    assert calib.activation().observer.nonfinite == "raise"


def test_an_empty_batch_is_not_non_finite() -> None:
    obs = MinMaxObserver()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        obs(torch.empty(0, 3))
    assert int(obs.nonfinite_batches) == 0


def test_fake_quant_forward_on_non_finite_input() -> None:
    x = torch.tensor([math.nan, math.inf, -math.inf, 0.26], requires_grad=True)
    y = fake_quantize(x, torch.tensor([0.1]))
    y.sum().backward()
    y = y.detach()
    assert math.isnan(float(y[0]))  # NaN stays NaN: the loss shows it
    assert y[1:].tolist() == pytest.approx([12.7, -12.8, 0.3])  # +-Inf saturate
    assert x.grad is not None and x.grad.tolist() == [0.0, 0.0, 0.0, 1.0]  # no gradient through them
    # The integer model has no NaN: its quantize maps NaN to code 0 and saturates +-Inf.
    assert quantize(x.detach(), 0.1, "qint8").tolist() == [0, 127, -128, 3]
    assert quantize(x.detach(), 0.1, "qint16").tolist() == [0, 32767, -32768, 3]
    # A FakeQuantize skips the batch for its scale and still fake-quantizes it.
    fq = FakeQuantize()
    fq(torch.tensor([-1.0, 2.0]))
    scale = fq.scale.clone()
    out = fq(torch.tensor([math.nan, 100.0]))
    assert (
        torch.equal(fq.scale, scale)
        and math.isnan(float(out[0]))
        and torch.equal(out[1:], fake_quantize(torch.tensor([100.0]), scale))
    )


def _data() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    batches = [torch.rand(16, 1, 8, 8, generator=g) - 0.5 for _ in range(4)]
    labels = torch.randint(0, 10, (16,), generator=g)
    test = torch.rand(32, 1, 8, 8, generator=g) - 0.5
    return batches, labels, test


def _flow(model: nn.Module, bad: list[torch.Tensor], bad_qat: list[torch.Tensor | None]) -> tuple[nn.Module, nn.Module]:
    """Calibrate, then two QAT steps, with the ``bad`` / ``bad_qat`` batches fed among the good ones."""
    batches, labels, _ = _data()
    with march_scope("bayes"):
        calib = prepare_qat_fx(model, {"": get_default_calib_qconfig()})
        set_fake_quantize(calib, "calibration")
        calib.eval()
        with torch.no_grad():
            for i, x in enumerate(batches):
                calib(x)
                if i < len(bad):
                    calib(bad[i])
        qat = prepare_qat_fx(
            calib, {"": get_default_qat_qconfig(), "module_name": {"classifier": get_default_qat_out_qconfig()}}
        )
        qat.train()
        opt = torch.optim.SGD(qat.parameters(), lr=0.01)
        for i, x in enumerate(batches[:2]):
            opt.zero_grad()
            nn.functional.cross_entropy(qat(x), labels).backward()
            opt.step()
            extra = bad_qat[i] if i < len(bad_qat) else None
            if extra is not None:
                # A trainer that drops a non-finite loss (as AMP's GradScaler does) still ran the forward,
                # so the observers saw the batch (an Inf input saturates at the fixed-scale QuantStub).
                qat(extra)
        set_fake_quantize(qat, "validation")
        qat.eval()
        return qat, convert_fx(qat)


def test_nan_and_inf_batches_in_calibration_and_qat_leave_the_converted_model_unchanged() -> None:
    torch.manual_seed(0)
    model = DeployableDigitsNet().eval()
    batches, _, test = _data()
    nan, inf = batches[0].clone(), batches[1].clone()
    nan[3, 0, 4, 4] = math.nan
    inf[5, 0, 2, 2] = math.inf
    # In QAT the fixed-scale QuantStub saturates an Inf input to 127/128 before any observer sees it, so
    # there an Inf batch is the same finite batch as one clamped to a large value; calibration computes
    # in float, so there the Inf reaches the observers. A NaN stays NaN everywhere.
    ref_qat, ref = _flow(copy.deepcopy(model), [], [None, inf.clamp(max=1e6)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qat, conv = _flow(copy.deepcopy(model), [nan, inf], [nan, inf])
    assert any("skipped a batch" in str(w.message) for w in caught)  # the calibration's percentile observers
    assert any("observer(s) skipped batches" in str(w.message) for w in caught)  # QAT's, at set_fake_quantize
    assert conv.state_dict().keys() == ref.state_dict().keys()
    for key, value in ref.state_dict().items():
        assert torch.equal(conv.state_dict()[key], value), key
    with torch.no_grad():
        assert torch.equal(conv(test), ref(test))
        assert torch.equal(qat(test), conv(test))
    # The QAT model's own observers (prepare made new ones) saw the NaN; the report and check_qconfig name them.
    report = nonfinite_report(qat)
    assert report and all(n >= 1 for n in report.values())
    assert not nonfinite_report(ref_qat)
    with march_scope("bayes"):
        found = check_qconfig(qat, (test[:2],), march="bayes").of_kind("non-finite")
    assert {f.where for f in found} == set(report) and "skipped" in found[0].message
