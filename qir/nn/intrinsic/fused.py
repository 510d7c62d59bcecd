"""The fused module classes, generated from one table so names and behaviour agree.

A fused module has a ``conv`` child (``nn.Conv1d/2d/3d``, ``nn.ConvTranspose2d`` or
``nn.Linear``; the child is named ``conv`` for all of them, as the BPU treats a linear
layer as a 1x1 conv) and, when it has an activation, a ``relu`` child (``nn.ReLU`` or
``nn.ReLU6``). ``forward(x, addend=None)``: ``act(conv(x) + addend)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qir.ir.ops.nn import register_fused_module


class FusedModule(nn.Module):
    """Base of all fused modules. ``has_add`` / ``act`` are class-level facts."""

    has_add: bool = False
    act: str | None = None
    conv_type: type[nn.Module] = nn.Conv2d

    def __init__(self, conv: nn.Module, relu: nn.Module | None = None) -> None:
        super().__init__()
        if type(conv) is not self.conv_type:
            raise TypeError(f"{type(self).__name__} needs a {self.conv_type.__name__}, got {type(conv).__name__}")
        self.conv = conv
        if self.act is not None:
            if relu is None:
                relu = nn.ReLU() if self.act == "relu" else nn.ReLU6()
            want = nn.ReLU if self.act == "relu" else nn.ReLU6
            if type(relu) is not want:
                raise TypeError(f"{type(self).__name__} needs a {want.__name__}, got {type(relu).__name__}")
            self.relu = relu
        elif relu is not None:
            raise TypeError(f"{type(self).__name__} has no activation, got {type(relu).__name__}")

    def forward(self, x: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
        y = self.conv(x)
        if self.has_add:
            if addend is None:
                raise TypeError(f"{type(self).__name__}.forward needs the addend (second input)")
            y = y + addend
        elif addend is not None:
            raise TypeError(f"{type(self).__name__} has no fused add; got a second input")
        if self.act is not None:
            y = self.relu(y)
        return y

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``FloatFunctional.add``'s call form, for eager models fused at the add (the plugin's
        eager fusion puts the conv + add module where the ``FloatFunctional`` was): ``self(x, y)``,
        ``x`` being the conv's input."""
        if not self.has_add:
            raise TypeError(f"{type(self).__name__} has no fused add; call it as a module")
        out: torch.Tensor = self(x, y)
        return out


_CONVS: dict[str, type[nn.Module]] = {
    "Conv1d": nn.Conv1d,
    "Conv2d": nn.Conv2d,
    "Conv3d": nn.Conv3d,
    "ConvTranspose2d": nn.ConvTranspose2d,
    "Linear": nn.Linear,
}
_VARIANTS: list[tuple[str, bool, str | None]] = [
    ("ReLU", False, "relu"),
    ("ReLU6", False, "relu6"),
    ("Add", True, None),
    ("AddReLU", True, "relu"),
    ("AddReLU6", True, "relu6"),
]


def _class_name(conv: str, suffix: str) -> str:
    # Horizon's spelling: ConvAddReLU2d, ConvTransposeReLU2d, LinearAddReLU6.
    if conv == "Linear":
        return f"Linear{suffix}"
    stem, dims = conv[:-2], conv[-2:]
    return f"{stem}{suffix}{dims}"


#: (conv module type, has_add, act) -> fused class
FUSED_CLASSES: dict[tuple[type[nn.Module], bool, str | None], type[FusedModule]] = {}


def _make() -> dict[str, Any]:
    made: dict[str, Any] = {}
    for conv_name, conv_type in _CONVS.items():
        for suffix, has_add, act in _VARIANTS:
            name = _class_name(conv_name, suffix)
            cls = type(
                name,
                (FusedModule,),
                {
                    "has_add": has_add,
                    "act": act,
                    "conv_type": conv_type,
                    "__module__": __name__,
                    "__doc__": f"Fused {conv_name}{' + add' if has_add else ''}{' + ' + act if act else ''}.",
                },
            )
            FUSED_CLASSES[(conv_type, has_add, act)] = cls
            register_fused_module(conv_type, has_add, act, cls)  # the IR ops' to_module builds these
            made[name] = cls
    return made


globals().update(_make())


def fused_class(conv_type: type[nn.Module], has_add: bool, act: str | None) -> type[FusedModule]:
    """The fused class for a conv type with the given add / activation."""
    try:
        return FUSED_CLASSES[(conv_type, has_add, act)]
    except KeyError:
        raise ValueError(f"no fused module for {conv_type.__name__} with add={has_add} act={act!r}") from None


ConvReLU1d: type[FusedModule]
ConvReLU2d: type[FusedModule]
ConvReLU3d: type[FusedModule]
ConvReLU61d: type[FusedModule]
ConvReLU62d: type[FusedModule]
ConvReLU63d: type[FusedModule]
ConvAdd1d: type[FusedModule]
ConvAdd2d: type[FusedModule]
ConvAdd3d: type[FusedModule]
ConvAddReLU1d: type[FusedModule]
ConvAddReLU2d: type[FusedModule]
ConvAddReLU3d: type[FusedModule]
ConvAddReLU61d: type[FusedModule]
ConvAddReLU62d: type[FusedModule]
ConvAddReLU63d: type[FusedModule]
ConvTransposeReLU2d: type[FusedModule]
ConvTransposeReLU62d: type[FusedModule]
ConvTransposeAdd2d: type[FusedModule]
ConvTransposeAddReLU2d: type[FusedModule]
ConvTransposeAddReLU62d: type[FusedModule]
LinearReLU: type[FusedModule]
LinearReLU6: type[FusedModule]
LinearAdd: type[FusedModule]
LinearAddReLU: type[FusedModule]
LinearAddReLU6: type[FusedModule]
