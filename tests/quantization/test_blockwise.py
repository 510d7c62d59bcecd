"""Block-by-block evaluation (qir.quantization.blockwise) gives the results and gradients of one
block, whatever the blocking: fake quant, requantization and the fused add, on a whole QAT model."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from qir.march import march_scope
from qir.quantization import blockwise, get_default_qat_qconfig, prepare_qat_fx, set_integer_grid
from qir.quantization.blockwise import blocks, part

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from bitexact_models import chain, randomize_bn


@pytest.mark.parametrize("shape", [(5, 7, 3, 4), (2, 40, 3), (3, 200), (1000,), ()])
@pytest.mark.parametrize("block", [1, 13, 100, 10**6])
def test_blocks_cover_every_element_once(shape: tuple[int, ...], block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blockwise, "BLOCK", block)
    seen = torch.zeros(shape, dtype=torch.int64)
    per_channel = torch.arange(shape[1]).reshape(1, -1, *([1] * (len(shape) - 2))) if len(shape) > 1 else None
    for idx in blocks(torch.Size(shape)):
        seen[idx] += 1
        if per_channel is not None:  # a parameter broadcast along the channels follows the block
            assert torch.equal(part(per_channel, idx, len(shape)).expand_as(seen[idx]), per_channel.expand(shape)[idx])
    assert bool((seen == 1).all())


@pytest.mark.parametrize("grid", [True, False])
def test_training_steps_do_not_depend_on_the_blocking(grid: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    spec = [("convbnrelu", 8, 3, 1), ("residual", 8, 3, 1), ("avgpool", 8, 3, 2), ("convbn", 6, 3, 1)]
    with march_scope("bayes"):
        qat = prepare_qat_fx(randomize_bn(chain(spec, 3, "linear"), 0), {"": get_default_qat_qconfig()}).train()
    set_integer_grid(qat, grid)
    results = []
    for block in (10**9, 50, 7):  # one block; blocks of rows; blocks of channels
        monkeypatch.setattr(blockwise, "BLOCK", block)
        model = copy.deepcopy(qat)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        outs = []
        for _ in range(2):
            y = model(torch.randn(3, 3, 10, 10, generator=g))
            opt.zero_grad()
            y.square().mean().backward()
            outs += [y.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
            opt.step()
        results.append(outs)
    for other in results[1:]:
        assert len(other) == len(results[0])
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))
