"""QAT pass-through modules (Identity, Dropout) and the binary Div."""

from __future__ import annotations

from typing import ClassVar

import torch
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


class Dropout(QATModule, nn.Dropout):
    """Dropout in training (any of torch's dropout classes), identity in eval and when quantized."""

    scale_preserving: ClassVar[bool] = True

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> Dropout:
        p = float(getattr(mod, "p", 0.5))
        new = cls(p=p)
        new.activation_post_process = None
        new.train(mod.training)
        return new


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
