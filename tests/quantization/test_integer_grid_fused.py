"""The single-node grid convs (qir.quantization.integer_grid_conv.ConvRequant, and ConvAddRequant for
the fused conv + add) are the unfused chain of autograd functions bit for bit: two copies of a prepared
model, one with ``integer_grid.FUSED_CONV`` off, train side by side; every step's output, every
gradient (input, weights, biases) and every observer buffer stay identical, and the fused nodes really
ran."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import qir.quantization.integer_grid as grid
from qir.march import march_scope
from qir.quantization import blockwise, get_default_qat_qconfig, prepare_qat_fx
from qir.quantization.integer_grid_conv import ConvAddRequant, ConvRequant

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from bitexact_models import Residual, Stubbed, randomize_bn


class _Bottleneck(nn.Module):
    """mobilenet_v2's residual: ``x + bn(conv1x1(relu6(bn(conv1x1(x)))))``, no activation after the add."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(c, 2 * c, 1), nn.BatchNorm2d(2 * c), nn.ReLU6())
        self.project = nn.Sequential(nn.Conv2d(2 * c, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.expand(x))


def _body(kind: str) -> nn.Module:
    if kind == "conv1d":
        return nn.Sequential(nn.Conv1d(3, 6, 3, padding=2, dilation=2), nn.ReLU(), nn.Conv1d(6, 4, 1, bias=False))
    if kind in ("residual", "residual_int64"):
        body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), Residual(8), _Bottleneck(8))
        return randomize_bn(body, 3)
    if kind == "wide":  # 3x3 over 160 channels: past the quick float32 bound, exact without chunks
        return nn.Sequential(nn.Conv2d(3, 160, 1), nn.Conv2d(160, 8, 3, padding=1), nn.ReLU())
    layers: list[nn.Module] = [
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU6(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 6, 1, bias=False),
        nn.Conv2d(6, 6, (1, 3), stride=(1, 2), padding=(0, 1)),
        nn.BatchNorm2d(6),
    ]
    return randomize_bn(nn.Sequential(*layers), 3)


def _prepared(kind: str, march: str) -> nn.Module:
    torch.manual_seed(0)
    example = torch.randn(2, 3, 10) if kind == "conv1d" else torch.randn(2, 3, 9, 11)
    with march_scope(march):
        return prepare_qat_fx(Stubbed(_body(kind)), {"": get_default_qat_qconfig()}, example_inputs=(example,)).train()


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize(
    "kind", ["conv2d", "conv1d", "wide", "residual", "residual_int64", "conv2d_blocks", "residual_blocks"]
)
def test_the_fused_conv_is_the_unfused_chain_bit_for_bit(
    kind: str, march: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kind.endswith("_blocks"):  # many blocks per tensor, the results written over the accumulator, two-stage extremes
        kind = kind.removesuffix("_blocks")
        monkeypatch.setattr(blockwise, "BLOCK", 40)
        monkeypatch.setattr(grid, "_TWO_STAGE", 1)
    fused, plain = _prepared(kind, march), _prepared(kind, march)
    calls = {"n": 0, "add": 0}
    apply, apply_add = ConvRequant.apply, ConvAddRequant.apply

    def counting(*args: object) -> torch.Tensor:
        calls["n"] += 1
        out: torch.Tensor = apply(*args)
        return out

    def counting_add(*args: object) -> torch.Tensor:
        calls["add"] += 1
        out: torch.Tensor = apply_add(*args)
        return out

    monkeypatch.setattr(ConvRequant, "apply", counting)
    monkeypatch.setattr(ConvAddRequant, "apply", counting_add)
    if kind == "residual_int64":  # the int64 rule where the float64 bounds fail, in both models
        monkeypatch.setattr(grid, "_fused_add_float64", lambda *args: None)
        monkeypatch.setattr(grid, "_fused_add_np", lambda *args: None)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (fused, plain)]
    g = torch.Generator().manual_seed(1)
    shape = (3, 3, 10) if kind == "conv1d" else (3, 3, 9, 11)
    for step in range(3):
        x = torch.randn(*shape, generator=g) * (1 + step)
        outs, grads = [], []
        for m, opt, on in ((fused, opts[0], True), (plain, opts[1], False)):
            monkeypatch.setattr(grid, "FUSED_CONV", on)
            xi = x.clone().requires_grad_()
            out = m(xi)
            opt.zero_grad()
            (out * torch.linspace(-1, 2, out.numel()).reshape(out.shape)).sum().backward()
            outs.append(out)
            grads.append([xi.grad] + [p.grad for p in m.parameters()])
            opt.step()
        assert _same(outs[0], outs[1]), (kind, step)
        for i, (a, b) in enumerate(zip(grads[0], grads[1], strict=True)):
            assert _same(a, b), (kind, step, i)
        for (name, a), (_, b) in zip(fused.state_dict().items(), plain.state_dict().items(), strict=True):
            assert _same(a, b) if a.dtype == torch.float32 else torch.equal(a, b), (kind, step, name)
    convs = [m for m in fused.modules() if isinstance(m, nn.modules.conv._ConvNd)]
    n_add = sum(bool(getattr(m, "has_add", False)) for m in convs)
    assert n_add == (2 if kind.startswith("residual") else 0), n_add
    assert calls == {"n": 3 * (len(convs) - n_add), "add": 3 * n_add}, (calls, len(convs), n_add)


@pytest.mark.parametrize("seed", range(4))
def test_the_numpy_fused_add_constants_are_the_torch_ones(seed: int) -> None:
    """``_fused_add_np`` (the single node's constants) against ``fused_add_params`` and
    ``_fused_add_float64`` (the unfused chain's), over scales spanning the float64 bound."""
    from qir.ir.types import DType
    from qir.quantization.fake_quantize import FakeQuantize
    from qir.quantization.integer_grid import _fused_add_float64, _fused_add_np, fused_add_params

    g = torch.Generator().manual_seed(seed)
    c = 7
    add_fq = FakeQuantize()
    seen = {"float64": 0, "declined": 0}
    for _ in range(40):
        s_acc = (torch.rand(c, generator=g, dtype=torch.float64) * 2 + 0.1) * 10.0 ** float(torch.randint(-9, -3, ()))
        s_acc = s_acc.to(torch.float32).to(torch.float64)  # products of float32 scales, as the conv forms them
        s_add = float((torch.rand((), generator=g) * 0.05 + 1e-4).to(torch.float32))
        s_out = float((torch.rand((), generator=g) * 0.1 + 1e-3).to(torch.float32))
        b = torch.randint(-(2**20), 2**20, (c,), generator=g).to(torch.float64)
        got = _fused_add_np(b.numpy(), s_acc.numpy(), s_add, s_out, 128, DType.qint8, "bayes")
        p = fused_add_params(s_acc, s_add, s_out, "bayes", DType.qint8)
        p = p._replace(acc_multiplier=p.acc_multiplier.expand(c), acc_shift=p.acc_shift.expand(c))
        acc = torch.zeros(2, c, 3, 3)
        bq = b.view(1, c, 1, 1)
        want = _fused_add_float64(acc, bq, acc, torch.ones(()), p, DType.qint8, add_fq, s_acc, s_add, s_out, 1)
        assert (got is None) == (want is None)
        if got is None or want is None:
            seen["declined"] += 1
            continue
        seen["float64"] += 1
        acc_lo, acc_hi, r1, r2 = want
        for a, w in ((got[0], acc_lo), (got[1], acc_hi), (got[2], r1), (got[3], bq * r1 + 0.5)):
            assert torch.equal(torch.from_numpy(a).view(w.shape), w)
        assert got[4] == float(r2.reshape(-1)[0]) and got[5] == p.extra_bits
    assert seen["float64"] > 0 and seen["declined"] > 0, seen
