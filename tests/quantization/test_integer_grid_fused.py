"""The single-node grid conv (qir.quantization.integer_grid_conv.ConvRequant) is the unfused chain of
autograd functions bit for bit: two copies of a prepared model, one with ``integer_grid.FUSED_CONV``
off, train side by side; every step's output, every gradient (input, weights, biases) and every
observer buffer stay identical, and the fused node really ran."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import qir.quantization.integer_grid as grid
from qir.march import march_scope
from qir.quantization import get_default_qat_qconfig, prepare_qat_fx
from qir.quantization.integer_grid_conv import ConvRequant

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from bitexact_models import Stubbed, randomize_bn


def _body(kind: str) -> nn.Module:
    if kind == "conv1d":
        return nn.Sequential(nn.Conv1d(3, 6, 3, padding=2, dilation=2), nn.ReLU(), nn.Conv1d(6, 4, 1, bias=False))
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
@pytest.mark.parametrize("kind", ["conv2d", "conv1d", "wide"])
def test_the_fused_conv_is_the_unfused_chain_bit_for_bit(
    kind: str, march: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fused, plain = _prepared(kind, march), _prepared(kind, march)
    calls = {"n": 0}
    apply = ConvRequant.apply

    def counting(*args: object) -> torch.Tensor:
        calls["n"] += 1
        out: torch.Tensor = apply(*args)
        return out

    monkeypatch.setattr(ConvRequant, "apply", counting)
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
    n_convs = sum(isinstance(m, nn.modules.conv._ConvNd) for m in fused.modules())
    assert calls["n"] == 3 * n_convs, (calls, n_convs)
