"""fuse: a 2-d batch norm no conv feeds alone becomes a depthwise 1x1 conv (passes/standalone_bn.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from passes import run_pipeline
from qir.frontend import trace
from qir.ir import Graph, run_graph
from qir.ir.ops.nn import BatchNorm, Conv2d


class CatNorm(nn.Module):
    """densenet's pre-activation layer: a batch norm after a cat, then relu and a conv."""

    def __init__(self, affine: bool = True) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 2, 1)
        self.norm = nn.BatchNorm2d(6, affine=affine, eps=1e-3)
        self.conv = nn.Conv2d(6, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.relu(self.norm(torch.cat([self.a(x), self.b(x)], 1))))


def _randomize(bn: nn.BatchNorm2d, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    c = bn.num_features
    bn.running_mean.copy_(torch.randn(c, generator=g))
    bn.running_var.copy_(torch.rand(c, generator=g) * 2 + 0.1)
    if bn.affine:
        bn.weight.data.copy_(torch.randn(c, generator=g))
        bn.bias.data.copy_(torch.randn(c, generator=g))


def _ops(g: Graph) -> list[str]:
    return [n.op.name for n in g.nodes if n.op.name != "constant"]


@pytest.mark.parametrize("affine", [True, False])
def test_a_batch_norm_after_a_cat_becomes_a_depthwise_conv_with_the_relu_fused(affine: bool) -> None:
    torch.manual_seed(0)
    m = CatNorm(affine).eval()
    _randomize(m.norm, 1)
    x = torch.randn(2, 3, 5, 5)
    g = trace(m, (x,))
    after = run_pipeline(g, "fuse").graph
    assert "batch_norm" not in _ops(after)
    (conv,) = [n for n in after.nodes if isinstance(n.op, Conv2d) and n.scope == "norm"]
    assert conv.op.groups == 6 and conv.op.act == "relu" and conv.op.bias
    assert after.constants["norm.weight"].shape == (6, 1, 1, 1) and after.constants["norm.bias"].shape == (6,)
    assert not any(k.startswith("norm.running") or k == "norm.num_batches_tracked" for k in after.constants)
    assert isinstance(after.constants["norm.weight"], nn.Parameter)
    with torch.no_grad():
        torch.testing.assert_close(run_graph(after, x), m(x), rtol=1e-5, atol=1e-5)
    # the float64 fold, rounded once: scale = gamma / sqrt(var + eps), shift = beta - mean * scale
    var, mean = m.norm.running_var.double(), m.norm.running_mean.double()
    gamma = m.norm.weight.double() if affine else torch.ones(6, dtype=torch.float64)
    beta = m.norm.bias.double() if affine else torch.zeros(6, dtype=torch.float64)
    scale = gamma / torch.sqrt(var + 1e-3)
    assert torch.equal(after.constants["norm.weight"].detach().flatten(), scale.float())
    assert torch.equal(after.constants["norm.bias"].detach(), (beta - mean * scale).float())


def test_a_batch_norm_a_conv_feeds_alone_still_folds_into_it() -> None:
    m = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).eval()
    after = run_pipeline(trace(m, (torch.randn(1, 3, 4, 4),)), "fuse").graph
    assert _ops(after) == ["conv2d"]
    (conv,) = [n for n in after.nodes if isinstance(n.op, Conv2d)]
    assert conv.op.groups == 1 and conv.scope == "0"


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + self.norm(x * 2)


class ConvReadTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.norm = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.norm(y) + y


class Norm1d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


@pytest.mark.parametrize(
    ("model", "shape", "pipeline"),
    [
        (Norm1d(), (2, 3), "fuse"),  # no 2-d conv computes a 1-d batch norm
        (Shared(), (1, 3, 4, 4), "fuse"),  # one module at two places: its statistics are read twice
        (ConvReadTwice(), (1, 3, 4, 4), "fuse"),  # after a conv absorb-bn declined: prepare names that case
        (nn.Sequential(nn.BatchNorm2d(3)), (1, 3, 4, 4), "fuse{standalone_bn=false}"),
    ],
)
def test_the_batch_norms_it_leaves(model: nn.Module, shape: tuple[int, ...], pipeline: str) -> None:
    after = run_pipeline(trace(model.eval(), (torch.randn(shape),)), pipeline).graph
    assert any(isinstance(n.op, BatchNorm) for n in after.nodes)


def test_a_graph_traced_in_training_mode_keeps_it_unless_forced() -> None:
    m = nn.Sequential(nn.ReLU(), nn.BatchNorm2d(3)).train()
    g = trace(m, (torch.randn(2, 3, 4, 4),))
    assert "batch_norm" in _ops(run_pipeline(g, "fuse").graph)
    assert "batch_norm" not in _ops(run_pipeline(g, "fuse{force_bn=true}").graph)


def test_a_batch_norm_after_one_that_became_a_conv_folds_into_that_conv() -> None:
    m = nn.Sequential(nn.ReLU(), nn.BatchNorm2d(3), nn.BatchNorm2d(3)).eval()
    for i, bn in enumerate(m[1:]):
        _randomize(bn, i)
    x = torch.randn(1, 3, 4, 4)
    after = run_pipeline(trace(m, (x,)), "fuse").graph
    assert _ops(after) == ["relu", "conv2d"]
    with torch.no_grad():
        torch.testing.assert_close(run_graph(after, x), m(x), rtol=1e-5, atol=1e-5)
