"""QAT AnchorGenerator: the float module itself (anchors come from shapes, not values; no fake quant).

The operator tables give its output as float32, so there is nothing to train or observe: the
anchors are the same float32 tensors at every stage (float, QAT, converted, compiled).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from qir.nn.modules.anchor_generator import AnchorGenerator as FloatAnchorGenerator
from qir.nn.qat._base import QATModule
from qir.quantization.qconfig import QConfig

__all__ = ["AnchorGenerator"]


class AnchorGenerator(QATModule, FloatAnchorGenerator):
    """Float32 anchors from the image and feature map shapes; inputs may be float or quantized."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = FloatAnchorGenerator
    #: the images (argument 0) may stay float: only their shape is read
    float_inputs: ClassVar[tuple[int, ...]] = (0,)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.activation_post_process = None

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> AnchorGenerator:
        """From ``qir.nn.AnchorGenerator`` or torchvision's ``AnchorGenerator`` (same fields)."""
        if not (hasattr(mod, "sizes") and hasattr(mod, "aspect_ratios")):
            raise TypeError(
                "AnchorGenerator.from_float takes qir.nn.AnchorGenerator or "
                f"torchvision.models.detection.rpn.AnchorGenerator, got {type(mod).__name__}"
            )
        new = cls(mod.sizes, mod.aspect_ratios)
        new.train(mod.training)
        return new
