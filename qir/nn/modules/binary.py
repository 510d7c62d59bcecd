"""``Div``: ``torch.div`` as a module (the eager replacement; quantized with an exact integer division)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Div"]


class Div(nn.Module):
    """``x / y`` (true division)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.div(x, y)
