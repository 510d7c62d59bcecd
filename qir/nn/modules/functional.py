"""``FloatFunctional``: tensor functions as a module, so each call site can carry its own quantization.

Users put one instance per call site in the float model (``self.add = FloatFunctional()``;
``self.add.add(x, y)``), like ``torch.ao.nn.quantized.FloatFunctional``. Every method
computes in float and passes its result through ``activation_post_process``: an
``Identity`` here, the output fake quant in :class:`qir.nn.qat.FloatFunctional`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["FLOAT_FUNCTIONAL_METHODS", "FloatFunctional", "FunctionalBase"]

Dims = int | Sequence[int] | None

#: The methods every functional class (float, QAT, quantized) provides.
FLOAT_FUNCTIONAL_METHODS = (
    "add",
    "add_relu",
    "add_scalar",
    "cat",
    "ceil",
    "concat",
    "concatenate",
    "div",
    "exp",
    "floor",
    "matmul",
    "maximum",
    "mean",
    "minimum",
    "mul",
    "mul_scalar",
    "stack",
    "sub",
    "sum",
)


def _dims(dim: Dims) -> list[int] | None:
    if dim is None:
        return None
    return [int(dim)] if isinstance(dim, int) else [int(d) for d in dim]


class FunctionalBase(nn.Module):
    """Float implementations of the functional methods, each followed by ``activation_post_process``."""

    activation_post_process: Any

    def _post(self, y: torch.Tensor) -> torch.Tensor:
        app = self.activation_post_process
        out: torch.Tensor = y if app is None else app(y)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            f"{type(self).__name__} is not called directly; call one of its methods "
            f"({', '.join(FLOAT_FUNCTIONAL_METHODS)})"
        )

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._post(torch.add(x, y))

    def add_relu(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._post(torch.relu(torch.add(x, y)))

    def add_scalar(self, x: torch.Tensor, y: float) -> torch.Tensor:
        return self._post(torch.add(x, y))

    def sub(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._post(torch.sub(x, y))

    def mul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._post(torch.mul(x, y))

    def mul_scalar(self, x: torch.Tensor, y: float) -> torch.Tensor:
        return self._post(torch.mul(x, y))

    def div(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._post(torch.div(x, y))

    def cat(self, x: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return self._post(torch.cat(list(x), dim=dim))

    def concat(self, x: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return self.cat(x, dim)

    def concatenate(self, x: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return self.cat(x, dim)

    def stack(self, x: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return self._post(torch.stack(list(x), dim=dim))

    def matmul(self, x: torch.Tensor, y: torch.Tensor, x_trans: bool = False, y_trans: bool = False) -> torch.Tensor:
        """``x @ y``; ``x_trans`` / ``y_trans`` transpose the last two dims of an operand first (the plugin's form)."""
        return self._post(torch.matmul(x.transpose(-2, -1) if x_trans else x, y.transpose(-2, -1) if y_trans else y))

    def mean(self, x: torch.Tensor, dim: Dims = None, keepdim: bool = False) -> torch.Tensor:
        d = _dims(dim)
        return self._post(x.mean() if d is None else x.mean(dim=d, keepdim=keepdim))

    def sum(self, x: torch.Tensor, dim: Dims = None, keepdim: bool = False) -> torch.Tensor:
        d = _dims(dim)
        return self._post(x.sum() if d is None else x.sum(dim=d, keepdim=keepdim))

    def maximum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._post(torch.maximum(x, y))

    def minimum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._post(torch.minimum(x, y))

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return self._post(torch.exp(x))

    def ceil(self, x: torch.Tensor) -> torch.Tensor:
        return self._post(torch.ceil(x))

    def floor(self, x: torch.Tensor) -> torch.Tensor:
        return self._post(torch.floor(x))


class FloatFunctional(FunctionalBase):
    """The float functional wrapper (``qir.nn.quantized.FloatFunctional``); ``activation_post_process`` is Identity."""

    def __init__(self) -> None:
        super().__init__()
        self.activation_post_process = nn.Identity()
