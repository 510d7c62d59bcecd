"""Training and evaluation loops of ``qir demo`` (fixed seeds: the same numbers every run)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qir.cli.progress import bar


def batches(n: int, size: int, seed: int | None) -> list[torch.Tensor]:
    """Index batches over ``n`` samples: shuffled with ``seed``, in order when it is None."""
    order = torch.arange(n) if seed is None else torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return [order[i : i + size] for i in range(0, n, size)]


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    lr: float,
    seed: int,
    desc: str,
    progress: bool | None,
    batch_size: int = 32,
) -> None:
    """Adam with a cosine learning-rate decay to 0 over all steps."""
    steps = [b for e in range(epochs) for b in batches(len(y), batch_size, seed + e)]
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, len(steps)))
    model.train()
    for idx in bar(steps, desc, progress, unit="step"):
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()


@torch.no_grad()
def outputs(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, desc: str, progress: bool | None, batch_size: int = 128
) -> torch.Tensor:
    """``fn`` over ``x`` in batches, outputs concatenated (the whole test set's logits)."""
    return torch.cat([fn(x[idx]) for idx in bar(batches(len(x), batch_size, None), desc, progress)])


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return 100.0 * float((logits.argmax(1) == y).float().mean())
