"""Spatial ops of vision models: resize, pad, grid sampling, stochastic depth."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from qir.ir.op import IRError, Trait, Transparent, register_op
from qir.ir.ops.core import EvalContext
from qir.ir.ops.torchop import TorchModuleOp, TorchOp
from qir.ir.types import Type


def _tup(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


_UPSAMPLE_MODES = {nn.UpsamplingNearest2d: "nearest", nn.UpsamplingBilinear2d: "bilinear"}


@register_op
@attrs.frozen
class Interpolate(TorchModuleOp):
    """``F.interpolate`` / ``nn.Upsample`` (and ``UpsamplingNearest2d`` / ``UpsamplingBilinear2d``)."""

    name: ClassVar[str] = "interpolate"
    arity: ClassVar[tuple[int, int | None]] = (1, None)
    module_types: ClassVar[tuple[type, ...]] = (nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.interpolate, F.upsample)
    signature: ClassVar[tuple[str, ...]] = (
        "input",
        "size",
        "scale_factor",
        "mode",
        "align_corners",
        "recompute_scale_factor",
        "antialias",
    )

    size: Any = attrs.field(default=None, converter=_tup)
    scale_factor: Any = attrs.field(default=None, converter=_tup)
    mode: str = "nearest"
    align_corners: bool | None = None
    recompute_scale_factor: bool | None = None
    antialias: bool = False

    def verify_(self, operand_types: Sequence[Type]) -> None:
        if (self.size is None) == (self.scale_factor is None):
            raise IRError("op 'interpolate': give exactly one of size / scale_factor")

    @classmethod
    def from_module(cls, m: Any) -> Interpolate:
        mode = _UPSAMPLE_MODES.get(type(m), m.mode)
        align = True if type(m) is nn.UpsamplingBilinear2d else m.align_corners
        return cls(
            size=m.size,
            scale_factor=m.scale_factor,
            mode=mode,
            align_corners=align,
            recompute_scale_factor=m.recompute_scale_factor,
        )

    def to_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        if self.antialias:
            raise IRError("op 'interpolate': antialias=True has no nn.Upsample form")
        return nn.Upsample(self.size, self.scale_factor, self.mode, self.align_corners, self.recompute_scale_factor)


_PAD_MODULES: dict[tuple[str, int], type[nn.Module]] = {
    ("zeros", 1): nn.ZeroPad1d,
    ("zeros", 2): nn.ZeroPad2d,
    ("zeros", 3): nn.ZeroPad3d,
    ("constant", 1): nn.ConstantPad1d,
    ("constant", 2): nn.ConstantPad2d,
    ("constant", 3): nn.ConstantPad3d,
    ("reflect", 1): nn.ReflectionPad1d,
    ("reflect", 2): nn.ReflectionPad2d,
    ("reflect", 3): nn.ReflectionPad3d,
    ("replicate", 1): nn.ReplicationPad1d,
    ("replicate", 2): nn.ReplicationPad2d,
    ("replicate", 3): nn.ReplicationPad3d,
    ("circular", 1): nn.CircularPad1d,
    ("circular", 2): nn.CircularPad2d,
    ("circular", 3): nn.CircularPad3d,
}
_PAD_KIND = {cls: kind for (kind, _), cls in _PAD_MODULES.items()}


@register_op
@attrs.frozen
class Pad(TorchModuleOp):
    """``F.pad`` and the pad modules (``ZeroPad2d``, ``ConstantPad2d``, ``ReflectionPad2d``, ...).

    ``pad`` is F.pad's flat list (last dimension first); ``value`` only for constant mode.
    """

    name: ClassVar[str] = "pad"
    arity: ClassVar[tuple[int, int | None]] = (1, None)
    module_types: ClassVar[tuple[type, ...]] = tuple(_PAD_MODULES.values())
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.pad,)
    signature: ClassVar[tuple[str, ...]] = ("input", "pad", "mode", "value")
    positional: ClassVar[tuple[str, ...]] = ("pad",)
    omit_none: ClassVar[tuple[str, ...]] = ("value",)

    pad: Any = attrs.field(default=(), converter=_tup)
    mode: str = "constant"
    value: float | None = None

    @classmethod
    def from_module(cls, m: Any) -> Pad:
        kind = _PAD_KIND[type(m)]
        if kind in ("zeros", "constant"):
            return cls(pad=m.padding, mode="constant", value=float(getattr(m, "value", 0.0)))
        return cls(pad=m.padding, mode=kind)

    def to_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        if not isinstance(self.pad, tuple) or len(self.pad) % 2:
            raise IRError(f"op 'pad': pad {self.pad!r} has no module form")
        dims = len(self.pad) // 2
        if self.mode == "constant":
            value = self.value or 0.0
            if value == 0.0 and ("zeros", dims) in _PAD_MODULES:
                return _PAD_MODULES[("zeros", dims)](self.pad)
            return _PAD_MODULES[("constant", dims)](self.pad, value)
        if (self.mode, dims) not in _PAD_MODULES:
            raise IRError(f"op 'pad': mode {self.mode!r} over {dims} dims has no module form")
        return _PAD_MODULES[(self.mode, dims)](self.pad)


@register_op
@attrs.frozen
class GridSample(TorchOp):
    """``F.grid_sample(input, grid)``."""

    name: ClassVar[str] = "grid_sample"
    arity: ClassVar[tuple[int, int | None]] = (2, 2)
    operand_names: ClassVar[tuple[str, ...]] = ("input", "grid")
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.grid_sample,)
    signature: ClassVar[tuple[str, ...]] = ("input", "grid", "mode", "padding_mode", "align_corners")
    inputs: ClassVar[tuple[str, ...]] = ("input", "grid")

    mode: str = "bilinear"
    padding_mode: str = "zeros"
    align_corners: bool | None = None


def stochastic_depth(input: torch.Tensor, p: float, mode: str, training: bool = True) -> torch.Tensor:
    """Randomly drop whole samples (``mode="row"``) or the whole batch (``"batch"``) while
    training, rescaling survivors by ``1/(1-p)``; identity otherwise (torchvision's definition)."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"stochastic_depth: drop probability has to be between 0 and 1, got {p}")
    if mode not in ("batch", "row"):
        raise ValueError(f"stochastic_depth: mode has to be 'batch' or 'row', got {mode!r}")
    if not training or p == 0.0:
        return input
    survival = 1.0 - p
    shape = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(shape, dtype=input.dtype, device=input.device).bernoulli_(survival)
    if survival > 0.0:
        noise.div_(survival)
    return input * noise


@register_op
@attrs.frozen
class StochasticDepth(TorchOp):
    """torchvision's ``stochastic_depth(input, p, mode, training)``; ``training`` None
    follows the graph's mode."""

    name: ClassVar[str] = "stochastic_depth"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Transparent})
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (stochastic_depth,)
    function_names: ClassVar[tuple[str, ...]] = ("torchvision.ops.stochastic_depth.stochastic_depth",)
    signature: ClassVar[tuple[str, ...]] = ("input", "p", "mode", "training")

    p: float = 0.0
    mode: str = "row"
    training: bool | None = None

    def evaluate(self, ctx: EvalContext, operands: Sequence[Any]) -> Any:
        training = ctx.training if self.training is None else self.training
        return stochastic_depth(operands[0], self.p, self.mode, training)

    def compute(self, x: Any) -> Any:
        return stochastic_depth(x, self.p, self.mode, bool(self.training))
