"""The integer-grid training step's gradients are the straight-through ones, checked against an
independent formulation: plain autograd over the float forward ``act((conv(x/s_in, w/s_w) + b/s_acc)
* s_acc)`` with each rounding made transparent (``v + (round(v) - v).detach()``) and the gradient
cut where a weight code or the output code saturated (or the activation cut it); for a conv fused with
an add, ``act(... + addend)`` with the addend's gradient cut where the output was."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends.common import numerics
from backends.common.integer_rules import fused_add_int, fused_add_params
from qir.ir.types import DType
from qir.march import march_scope
from qir.quantization import disable_observer, get_default_qat_qconfig, integer_grid_report, prepare_qat_fx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from bitexact_models import Residual, Stubbed, randomize_bn


def _net() -> nn.Module:
    body = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU6(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),
        nn.ReLU(),
        nn.Conv2d(8, 6, 1),
        nn.Flatten(),
        nn.Linear(6 * 36, 5),
    )
    return Stubbed(randomize_bn(body, 3))


def _transparent(v: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``codes`` in the forward, the gradient of ``v`` in the backward."""
    return v + (codes - v).detach()


def _reference(m: Any, x: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
    """The straight-through forward of the bound conv / linear ``m`` (scales frozen), in plain autograd ops
    (``addend``: the second input of a conv fused with an add)."""
    in_fq, wfq, ofq = m.integer_grid.inputs[0], m.weight_fake_quant, m.activation_post_process
    s_in = in_fq.scale.reshape(())
    xr = x * (1.0 / s_in)
    xq = _transparent(xr, torch.round(xr.detach()))
    shape = [1] * m.weight.dim()
    shape[0] = -1
    s_w = wfq.scale.reshape(shape)
    wr = m.weight / s_w
    w_codes = numerics.round_half_up(wr.detach())
    w_sat = w_codes.clamp(wfq.qmin, wfq.qmax)
    wq = _transparent(torch.where(w_sat == w_codes, wr, torch.zeros_like(wr)), w_sat)
    acc = F.linear(xq, wq) if isinstance(m, nn.Linear) else m._conv_forward(xq, wq, None)
    s_acc = numerics.accumulator_scale(float(s_in), wfq.scale.reshape(-1))
    b_codes = numerics.quantize_bias(m.bias, float(s_in), wfq.scale.reshape(-1)).to(torch.float64)
    bq = _transparent(m.bias.to(torch.float64) / s_acc, b_codes).to(torch.float32)
    ch = [1] * acc.dim()
    ch[1 if acc.dim() > 2 else -1] = -1
    y_lin = (acc + bq.reshape(ch)) * s_acc.to(torch.float32).reshape(ch)
    # the output codes: the converted module's integer requantization
    s_out = float(ofq.scale.reshape(-1)[0])
    a = acc.detach().to(torch.int64) + b_codes.to(torch.int64).reshape(ch)
    axis = 1 if acc.dim() > 2 else -1
    if addend is None:
        mult, shift = numerics.conv_requant_params(float(s_in), wfq.scale.reshape(-1), s_out, "bayes", "qint8")
        q = numerics.requantize(a, mult, shift, "qint32", axis=axis).to(torch.float32)
    else:  # the integer fused add, not saturated (qint32): the clamp below is the output's
        s_add = float(m.integer_grid.inputs[1].scale.reshape(-1)[0])
        p = fused_add_params(s_acc, s_add, s_out, "bayes", "qint8")
        add_codes = torch.round(addend.detach() / s_add).to(torch.int64)
        m1, s1 = p.acc_multiplier.expand(a.shape[axis]), p.acc_shift.expand(a.shape[axis])
        q = fused_add_int(a, add_codes, m1, s1, p.add_multiplier, p.add_shift, p.extra_bits, "qint32", axis)
        q = q.to(torch.float32)
        y_lin = y_lin + addend
    lo, hi = DType.qint8.qrange
    if m.act in ("relu", "relu6"):
        lo = 0
    if m.act == "relu6":
        hi = min(hi, int(numerics.quantize(torch.tensor([6.0]), s_out, "qint8")[0]))
    keep = (q >= lo) & (q <= hi)
    y = torch.where(keep, y_lin, torch.zeros_like(y_lin))
    return _transparent(y, q.clamp(lo, hi) * ofq.scale.reshape(()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grid_gradients_are_the_straight_through_ones(seed: int) -> None:
    torch.manual_seed(seed)
    with march_scope("bayes"):
        qat = prepare_qat_fx(_net(), {"": get_default_qat_qconfig()}).train()
    assert set(integer_grid_report(qat).values()) == {"grid"}
    inputs: dict[str, torch.Tensor] = {}
    bound = {name: m for name, m in qat.named_modules() if getattr(m, "integer_grid", None) is not None}
    for name, m in bound.items():
        m.register_forward_pre_hook(lambda mod, args, name=name: inputs.__setitem__(name, args[0].detach()))
    g = torch.Generator().manual_seed(seed)
    qat(torch.randn(6, 3, 6, 6, generator=g) * 2)  # observes: every scale is set
    disable_observer(qat)  # both formulations see the same scales
    kinds = set()
    for name, m in bound.items():
        x = inputs[name]
        grad = torch.randn(m(x).shape, generator=g)
        m.zero_grad()
        xa = x.clone().requires_grad_()
        y = m(xa)
        y.backward(grad)
        got = (xa.grad, m.weight.grad.clone(), m.bias.grad.clone())
        m.zero_grad()
        xb = x.clone().requires_grad_()
        y_ref = _reference(m, xb)
        assert torch.equal(y, y_ref), name  # the same forward
        y_ref.backward(grad)
        want = (xb.grad, m.weight.grad, m.bias.grad)
        for what, a, b in zip(("input", "weight", "bias"), got, want, strict=True):
            assert a is not None and b is not None
            # float32 sums of the same products scaled in another order: each element within a few
            # roundings of the largest term (a gradient scaled wrongly is off by s_in or s_w, >> 1e-6)
            tol = 1e-6 * float(b.abs().max())
            torch.testing.assert_close(a, b, rtol=1e-6, atol=tol, msg=f"{name}: {what} gradient")
            assert bool(a.abs().sum() > 0), (name, what)
        kinds.add(m.act)
    assert kinds == {None, "relu", "relu6"}


def test_fused_add_gradients_are_the_straight_through_ones() -> None:
    """The conv fused with an add (after a ReLU, and without activation as in mobilenet_v2): the input,
    addend, weight and bias gradients of one grid step against the reference."""
    torch.manual_seed(0)
    project = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
            self.res = Residual(8)
            self.project = project

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.res(self.stem(x))
            return self.project(x) + x

    with march_scope("bayes"):
        qat = prepare_qat_fx(Stubbed(randomize_bn(Body(), 1)), {"": get_default_qat_qconfig()}).train()
    assert set(integer_grid_report(qat).values()) == {"grid"}
    inputs: dict[str, tuple[torch.Tensor, ...]] = {}
    bound = {n: m for n, m in qat.named_modules() if getattr(m, "has_add", False) and m.integer_grid is not None}
    for name, m in bound.items():
        m.register_forward_pre_hook(lambda mod, args, name=name: inputs.__setitem__(name, args))
    g = torch.Generator().manual_seed(0)
    qat(torch.randn(4, 3, 6, 6, generator=g) * 2)
    disable_observer(qat)
    acts = set()
    for name, m in bound.items():
        x, addend = (t.detach() for t in inputs[name])
        grad = torch.randn(m(x, addend).shape, generator=g)
        results = []
        for ref in (False, True):
            m.zero_grad()
            xi, ai = x.clone().requires_grad_(), addend.clone().requires_grad_()
            y = _reference(m, xi, ai) if ref else m(xi, ai)
            y.backward(grad)
            results.append((y.detach(), xi.grad, ai.grad, m.weight.grad.clone(), m.bias.grad.clone()))
        (y, *got), (y_ref, *want) = results
        assert torch.equal(y, y_ref), name
        for what, a, b in zip(("input", "addend", "weight", "bias"), got, want, strict=True):
            assert a is not None and b is not None
            tol = 1e-6 * float(b.abs().max())
            torch.testing.assert_close(a, b, rtol=1e-6, atol=tol, msg=f"{name}: {what} gradient")
            assert bool(a.abs().sum() > 0), (name, what)
        acts.add(m.act)
    assert acts == {None, "relu"}, acts
