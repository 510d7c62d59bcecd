"""QAT Softmax: the float model of the integer algorithm, with a fake quant at the exp table's output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from backends.common.math_rules import SOFTMAX_EXP_DTYPE, SOFTMAX_EXP_SCALE
from qir.ir.types import DType
from qir.nn.qat._base import QATModule, make_activation_fq, resolve_qconfig
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.integer_grid_math import softmax_forward
from qir.quantization.qconfig import QConfig

__all__ = ["Softmax"]

#: The exp table's fixed scale and dtype (the integer rule's, backends.common.math_rules).
EXP_SCALE = SOFTMAX_EXP_SCALE
EXP_DTYPE = SOFTMAX_EXP_DTYPE.name


class Softmax(QATModule):
    """``fq_out(e / sum(e))`` with ``e = fq_exp(exp(x - max(x)))`` along ``dim``.

    ``exp_post_process`` has the fixed scale ``1/32767`` (qint16): the integer form's exp
    table holds exactly these codes. The row maximum is detached (softmax does not depend
    on it). With the exp fake quant disabled (calibration) the module is ``F.softmax``.
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.Softmax
    #: one grid input: trains on the integer grid when bound (qir.quantization.integer_grid_math)
    grid_inputs: ClassVar[int] = 1

    @staticmethod
    def grid_refusal(m: nn.Module, called: object, inputs: Sequence[FakeQuantize]) -> str | None:
        """Why the bound inputs cannot train on the grid: the integer form takes qint8 codes only."""
        if DType(inputs[0].dtype) is not DType.qint8:
            return f"Softmax of {DType(inputs[0].dtype).name} codes has no integer form (qint8 only)"
        return None

    def __init__(self, dim: int, exp_post_process: FakeQuantize, activation_post_process: FakeQuantize) -> None:
        super().__init__()
        self.dim = int(dim)
        self.exp_post_process = exp_post_process
        self.activation_post_process = activation_post_process

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.activation_post_process is not None
        on_grid = softmax_forward(self, x)
        if on_grid is not None:
            return on_grid
        if not self.exp_post_process.fake_quant_enabled:
            return self.activation_post_process(F.softmax(x, self.dim))
        e = self.exp_post_process(torch.exp(x - x.amax(dim=self.dim, keepdim=True).detach()))
        return self.activation_post_process(e / e.sum(dim=self.dim, keepdim=True))

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> Softmax:
        if not isinstance(mod, nn.Softmax):
            raise TypeError(f"Softmax.from_float takes nn.Softmax, got {type(mod).__name__}")
        if mod.dim is None:
            raise ValueError(
                "Softmax.from_float: the softmax has no dim (torch's implicit-dim legacy form); "
                "give it one, e.g. nn.Softmax(dim=1) or F.softmax(x, dim=1)"
            )
        qc = resolve_qconfig(mod, qconfig, cls.__name__)
        out = make_activation_fq(qc, cls.__name__, required=True)
        assert out is not None
        # same class as the qconfig's fake quants, so a calibration model starts observe-only
        exp_fq = type(out)(dtype=EXP_DTYPE, scale=EXP_SCALE)
        new = cls(mod.dim, exp_fq, out)
        new.train(mod.training)
        return new

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
