"""QAT activations: scale-preserving ReLU / ReLU6 and table-lookup unary ops (own output fake quant)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch
from torch import nn

from qir.nn.modules.unary import UnaryModule
from qir.nn.qat._base import QATModule, make_activation_fq, resolve_qconfig
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.integer_grid_functional import lut_forward
from qir.quantization.qconfig import QConfig

__all__ = ["LUT_FLOAT_CLASSES", "ReLU", "ReLU6", "UnaryLUT"]


class ReLU(QATModule, nn.ReLU):
    """ReLU on fake-quantized input; no own fake quant (the output keeps the input's scale)."""

    scale_preserving: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.activation_post_process = None

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> ReLU:
        new = cls()
        new.train(mod.training)
        return new


class ReLU6(QATModule, nn.ReLU6):
    """ReLU6 on fake-quantized input; no own fake quant. Quantized, the bound is ``round(6 / s_in)``."""

    scale_preserving: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.activation_post_process = None

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> ReLU6:
        new = cls()
        new.train(mod.training)
        return new


#: torch activations that are table lookups on the BPU (besides qir.nn's unary modules).
LUT_FLOAT_CLASSES: tuple[type[nn.Module], ...] = (
    nn.Sigmoid,
    nn.Tanh,
    nn.GELU,
    nn.SiLU,
    nn.Hardsigmoid,
    nn.Hardswish,
    nn.ELU,
    nn.LeakyReLU,
    nn.Softplus,
    nn.Mish,
    nn.SELU,
    nn.CELU,
)


class UnaryLUT(QATModule):
    """``fq(f(x))`` for an elementwise ``f`` given by a float module (``qir.nn.Exp()``, ``nn.Sigmoid()``, ...).

    The float module is kept as the function (not a child, so flows never swap it); it has
    no parameters. The quantized counterpart tabulates the same function.
    """

    #: trains on the integer grid (the converted table) when its input's scale is known
    grid_inputs: ClassVar[int] = 1

    def __init__(self, function: nn.Module, activation_post_process: FakeQuantize) -> None:
        super().__init__()
        if any(True for _ in function.parameters()):
            raise ValueError(
                f"UnaryLUT needs a parameter-free function module, {type(function).__name__} has parameters"
            )
        if getattr(function, "inplace", False):
            # torchvision's blocks build Hardswish(inplace=True): the QAT forward evaluates f(x) for the
            # output observer and then reads x's codes for the table, so f must leave x as it was
            function = copy.copy(function)
            cast(Any, function).inplace = False
        self.__dict__["_function_module"] = function  # not a submodule on purpose
        self.activation_post_process = activation_post_process

    @property
    def function_module(self) -> nn.Module:
        fn: nn.Module = self.__dict__["_function_module"]
        return fn

    @property
    def op_name(self) -> str:
        return type(self.function_module).__name__

    def function(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The elementwise function (evaluated in float64 by the quantized module's table)."""
        fm = self.function_module
        if isinstance(fm, UnaryModule):
            return fm.function()
        return fm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = lut_forward(self, x)
        if grid is not None:
            return grid
        assert self.activation_post_process is not None
        return self.activation_post_process(self.function()(x))

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> UnaryLUT:
        if not isinstance(mod, (UnaryModule, *LUT_FLOAT_CLASSES)):
            raise TypeError(
                f"UnaryLUT.from_float takes a qir.nn unary module or a torch activation, got {type(mod).__name__}"
            )
        qc = resolve_qconfig(mod, qconfig, f"UnaryLUT({type(mod).__name__})")
        fq = make_activation_fq(qc, f"UnaryLUT({type(mod).__name__})", required=True)
        assert fq is not None
        fn = copy.deepcopy(mod)
        fn.__dict__.pop("qconfig", None)
        new = cls(fn, fq)
        new.train(mod.training)
        return new

    def extra_repr(self) -> str:
        return f"op={self.op_name}"
