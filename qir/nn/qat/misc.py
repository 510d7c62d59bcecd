"""QAT pass-through modules (Identity, Dropout) and the binary Div."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from qir.nn.modules.binary import Div as FloatDiv
from qir.nn.qat._base import QATModule, make_activation_fq, resolve_qconfig
from qir.quantization.qconfig import QConfig

__all__ = ["Div", "Dropout", "Identity"]


class Identity(QATModule, nn.Identity):
    """Pass-through (removed at deployment)."""

    scale_preserving: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.activation_post_process = None

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> Identity:
        new = cls()
        new.train(mod.training)
        return new


_DROPOUTS: dict[type[nn.Module], Callable[..., torch.Tensor]] = {
    nn.Dropout: F.dropout,
    nn.Dropout1d: F.dropout1d,
    nn.Dropout2d: F.dropout2d,
    nn.Dropout3d: F.dropout3d,
}


class Dropout(QATModule):
    """Dropout in training with the float module's kind (element or channel dropout); identity in
    eval and when quantized. Dropping keeps values on the grid only up to the ``1/(1-p)`` rescale,
    which the next fake quant absorbs."""

    scale_preserving: ClassVar[bool] = True

    def __init__(self, p: float = 0.5, kind: type[nn.Module] = nn.Dropout) -> None:
        super().__init__()
        if kind not in _DROPOUTS:
            raise ValueError(f"Dropout kind must be one of {', '.join(k.__name__ for k in _DROPOUTS)}")
        self.p, self.kind = float(p), kind
        self.activation_post_process = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DROPOUTS[self.kind](x, self.p, self.training)

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> Dropout:
        if type(mod) not in _DROPOUTS:
            raise TypeError(f"Dropout.from_float takes one of torch's dropout modules, got {type(mod).__name__}")
        new = cls(float(getattr(mod, "p", 0.5)), type(mod))
        new.train(mod.training)
        return new

    def extra_repr(self) -> str:
        return f"p={self.p}, kind={self.kind.__name__}"


class Div(QATModule):
    """``fq(x / y)``."""

    def __init__(self) -> None:
        super().__init__()
        self.activation_post_process = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert self.activation_post_process is not None
        return self.activation_post_process(torch.div(x, y))

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> Div:
        if not isinstance(mod, FloatDiv):
            raise TypeError(f"Div.from_float takes qir.nn.Div, got {type(mod).__name__}")
        qc = resolve_qconfig(mod, qconfig, cls.__name__)
        new = cls()
        new.activation_post_process = make_activation_fq(qc, cls.__name__, required=True)
        new.train(mod.training)
        return new
