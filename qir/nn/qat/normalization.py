"""QAT LayerNorm: ``fq(layer_norm(x))``, or on the integer grid the converted module's rule on the codes."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from qir.nn.qat._base import QATModule, make_activation_fq, resolve_qconfig
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.integer_grid_math import layer_norm_forward
from qir.quantization.qconfig import QConfig

__all__ = ["LayerNorm"]


class LayerNorm(QATModule):
    """``activation_post_process(layer_norm(x, normalized_shape, weight, bias, eps))``.

    The integer form normalizes exactly up to a ``2**-20`` fixed point and applies the affine
    weight and bias in its output requantization (docs/semantics.md, "LayerNorm"), so only
    the output is fake-quantized; weight and bias stay float parameters.
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.LayerNorm
    #: one grid input: trains on the integer grid when bound (qir.quantization.integer_grid_math)
    grid_inputs: ClassVar[int] = 1

    def __init__(
        self,
        normalized_shape: tuple[int, ...],
        eps: float,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        activation_post_process: FakeQuantize,
    ) -> None:
        super().__init__()
        self.normalized_shape = tuple(int(d) for d in normalized_shape)
        self.eps = float(eps)
        self.weight = nn.Parameter(weight.detach().clone()) if weight is not None else None
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None
        self.activation_post_process = activation_post_process

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.activation_post_process is not None
        on_grid = layer_norm_forward(self, x)
        if on_grid is not None:
            return on_grid
        return self.activation_post_process(F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps))

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> LayerNorm:
        if not isinstance(mod, nn.LayerNorm):
            raise TypeError(f"LayerNorm.from_float takes nn.LayerNorm, got {type(mod).__name__}")
        qc = resolve_qconfig(mod, qconfig, cls.__name__)
        fq = make_activation_fq(qc, cls.__name__, required=True)
        assert fq is not None
        new = cls(tuple(mod.normalized_shape), mod.eps, mod.weight, mod.bias, fq)
        for name in ("weight", "bias"):
            src, dst = getattr(mod, name), getattr(new, name)
            if src is not None and dst is not None:
                dst.requires_grad_(src.requires_grad)
        new.train(mod.training)
        return new

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, affine={self.weight is not None}"
