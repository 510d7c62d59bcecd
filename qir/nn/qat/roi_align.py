"""QAT RoIAlign: the integer rule's sampling weights in float, the exact mean, then the output fake quant."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from qir.nn.modules.roi_align import RoIAlign as FloatRoIAlign
from qir.nn.qat._base import QATModule, make_activation_fq, resolve_qconfig
from qir.quantization.qconfig import QConfig

__all__ = ["RoIAlign", "roi_sample"]


def roi_sample(
    x: torch.Tensor, boxes: torch.Tensor | list[torch.Tensor], m: Any, what: str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """Per RoI: ``(W_y, W_x, batch index, samples)`` from the integer rule (weights at ``2**-B``).

    ``m`` holds torchvision's fields (a float, QAT or integer RoIAlign). The boxes are checked
    first as the compiled kernel checks them (``check_rois``: finite, a batch index naming an
    image of ``x``, a bounded extent), a ``DataError`` naming ``what`` (default: ``m``'s class).
    """
    from backends.common.kernels.data_checks import check_rois
    from backends.common.roi_rules import ROI_BITS, axis_weights, rois_of

    what = what or type(m).__name__
    rois = rois_of(boxes, what)
    h, w = int(x.shape[-2]), int(x.shape[-1])
    fixed = check_rois(
        what, rois, float(m.spatial_scale), int(x.shape[0]), (h, w), int(m.sampling_ratio), ROI_BITS
    ).tolist()
    ph, pw = m.output_size
    out = []
    for (bx1, by1, bx2, by2), b in zip(fixed, rois[:, 0].tolist(), strict=True):
        wy, gh = axis_weights(by1, by2, h, ph, m.sampling_ratio, m.aligned)
        wx, gw = axis_weights(bx1, bx2, w, pw, m.sampling_ratio, m.aligned)
        out.append((wy, wx, int(b), max(gh * gw, 1)))
    return out


class RoIAlign(QATModule, FloatRoIAlign):
    """``fq(mean of the bilinear samples)`` with the integer rule's sampling positions and weights.

    The boxes stay float (they are not trained and get no gradient, as in torchvision);
    positions are rounded to ``2**-12`` pixel exactly as the integer module rounds them.
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = FloatRoIAlign
    #: the boxes are float at every stage (convert_fx lets them in unquantized)
    float_inputs: ClassVar[tuple[int, ...]] = (1,)

    def forward(self, input: torch.Tensor, boxes: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        from backends.common.roi_rules import ROI_BITS

        per_roi = roi_sample(input, boxes, self)
        ph, pw = self.output_size
        scale = 2.0 ** (2 * ROI_BITS)
        outs = [
            (wy.to(input.dtype) @ input[b] @ wx.to(input.dtype).T) / (scale * count) for wy, wx, b, count in per_roi
        ]
        y = torch.stack(outs) if outs else input.new_zeros(0, input.shape[1], ph, pw)
        assert self.activation_post_process is not None
        return self.activation_post_process(y)

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> RoIAlign:
        """From ``qir.nn.RoIAlign`` or ``torchvision.ops.RoIAlign`` (same fields)."""
        names = ("output_size", "spatial_scale", "sampling_ratio", "aligned")
        if not all(hasattr(mod, n) for n in names):
            raise TypeError(
                f"RoIAlign.from_float takes qir.nn.RoIAlign or torchvision.ops.RoIAlign, got {type(mod).__name__}"
            )
        new = cls(*(getattr(mod, n) for n in names))
        qc = resolve_qconfig(mod, qconfig, cls.__name__)
        new.activation_post_process = make_activation_fq(qc, cls.__name__, required=True)
        new.train(mod.training)
        return new
