"""The grid conv's scale constants, kept per module while the scales stay (``integer_grid_scales``), and its
mode check, kept per switch setting (``integer_grid._conv_mode_on``), never go stale: after every way a
scale or a switch can change, the model computes what a fresh deep copy of it (no kept constants) computes,
outputs and gradients bit for bit; and with frozen observers the constants really are reused."""

from __future__ import annotations

import copy
import io
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from backends.common import numerics
from qir.march import march_scope
from qir.quantization import (
    FakeQuantize,
    disable_fake_quant,
    disable_observer,
    enable_fake_quant,
    enable_observer,
    get_default_qat_qconfig,
    integer_grid_report,
    prepare_qat_fx,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from bitexact_models import Residual, Stubbed, randomize_bn


def _body() -> nn.Module:
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(), Residual(8)]
    layers += [nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1)]
    return randomize_bn(nn.Sequential(*layers), 3)


def _prepared(march: str) -> nn.Module:
    torch.manual_seed(0)
    with march_scope(march):
        return prepare_qat_fx(Stubbed(_body()), {"": get_default_qat_qconfig()}).train()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32)


def _same_as_fresh(model: nn.Module, x: torch.Tensor) -> None:
    """One forward + backward of ``model`` equals that of a deep copy made just before (no kept constants)."""
    fresh = copy.deepcopy(model)
    outs = []
    for m in (model, fresh):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.square().sum().backward()
        grads = [p.grad.clone() for p in m.parameters() if p.grad is not None]
        m.zero_grad()
        outs.append((y, xi.grad, grads, {k: v.clone() for k, v in m.state_dict().items()}))
    (y1, gx1, g1, sd1), (y2, gx2, g2, sd2) = outs
    assert torch.equal(_bits(y1), _bits(y2))
    assert gx1 is not None and gx2 is not None and torch.equal(_bits(gx1), _bits(gx2))
    assert len(g1) == len(g2) > 0 and all(torch.equal(_bits(a), _bits(b)) for a, b in zip(g1, g2, strict=True))
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)


def _weight_fqs(model: nn.Module) -> list[FakeQuantize]:
    fqs = [getattr(m, "weight_fake_quant", None) for m in model.modules()]
    return [fq for fq in fqs if isinstance(fq, FakeQuantize)]


def _scaled(model: nn.Module, how: str) -> None:
    """Write every weight fake quant's scale in place, the way ``how`` says."""
    for fq in _weight_fqs(model):
        if how == "in place":
            fq.scale.mul_(1.5)
        elif how == "data":
            fq.scale.data.mul_(0.75)
        else:  # through numpy: no version counter moves
            fq.scale.numpy()[:] *= 1.25


def _round_trip(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded: nn.Module = torch.load(buf, weights_only=False)
    return loaded


def _other_state(march: str) -> dict[str, torch.Tensor]:
    other = _prepared(march)
    x = torch.randn(2, 3, 9, 11, generator=torch.Generator().manual_seed(9)) * 3
    for _ in range(2):
        other(x).sum().backward()
    return other.state_dict()


CHANGES: dict[str, Callable[[nn.Module, str], nn.Module | None]] = {
    "nothing": lambda m, march: None,
    "scale written in place": lambda m, march: _scaled(m, "in place"),
    "scale written through .data": lambda m, march: _scaled(m, "data"),
    "scale written through numpy": lambda m, march: _scaled(m, "numpy"),
    "load_state_dict": lambda m, march: m.load_state_dict(_other_state(march)) and None,
    "torch.save / torch.load": lambda m, march: _round_trip(m),
    ".to()": lambda m, march: m.to(torch.float64).to(torch.float32),
    "observers on again": lambda m, march: enable_observer(m) and None,
    "torch.ao disable_observer": lambda m, march: m.apply(torch.ao.quantization.disable_observer) and None,
    "fake quant off and on": lambda m, march: enable_fake_quant(disable_fake_quant(m)) and None,
    "fake quant off": lambda m, march: disable_fake_quant(m) and None,
}


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_kept_constants_follow_every_change(change: str, march: str) -> None:
    model = _prepared(march)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # observers training: the scales move every step
        _same_as_fresh(model, torch.randn(2, 3, 9, 11, generator=g))
    disable_observer(model)  # frozen scales: the kept constants are used from now on
    for _ in range(2):
        _same_as_fresh(model, torch.randn(2, 3, 9, 11, generator=g))
    replaced = CHANGES[change](model, march)
    model = replaced if replaced is not None else model
    for _ in range(2):
        _same_as_fresh(model, torch.randn(2, 3, 9, 11, generator=g))
    report = integer_grid_report(model)
    assert report and all(v == "grid" for v in report.values()), report


def test_frozen_scales_reuse_the_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the observers off the multipliers and shifts are computed once per conv, not every step; a
    scale written in place is picked up at the next step."""
    model = _prepared("bayes")
    x = torch.randn(2, 3, 9, 11, generator=torch.Generator().manual_seed(4))
    model(x)
    calls: list[int] = []
    real = numerics.multiplier_shift_np

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(numerics, "multiplier_shift_np", counted)
    model(x * 2)  # the observers moved the scales: computed again
    per_step = len(calls)
    assert per_step > 0
    disable_observer(model)
    for _ in range(3):
        model(x).sum().backward()
    assert len(calls) == per_step  # the scales stayed: nothing computed
    _scaled(model, "numpy")
    model(x)
    assert len(calls) == 2 * per_step
