"""``qat_conv_bn``: a QAT conv / linear that keeps its batch norm (the plugin's ``with_bn`` QAT mode).

A ``qat_conv`` (same attributes and operands: ``kind``, the conv hyper-parameters, fused add /
activation, ``weight_fq``, ``out_fq``) whose module also holds ``bn``, a batch norm of torch's
``bn_class`` with ``bn_eps`` / ``bn_momentum`` / ``bn_affine``; its state follows the conv's as
``bn.weight`` / ``bn.bias`` (affine), ``bn.running_mean``, ``bn.running_var``,
``bn.num_batches_tracked``. In training the batch norm normalizes with the batch statistics and
updates the running ones (shared constants: ``run_graph`` updates them as the prepared model
does); in eval the module is the folded conv. The ``quantize`` pass folds it (as ``convert_fx``
does before tracing) and converts the folded conv.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from qir.ir.op import IRError, register_op
from qir.ir.ops.qat import QATConv, is_number

__all__ = ["QATConvBN"]

_BN_CLASSES = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm")


@register_op
@attrs.frozen
class QATConvBN(QATConv):
    """``out_fq(act(bn(conv(x, weight_fq(w * s)) / s + b) + addend))`` in training, the folded conv in eval."""

    name: ClassVar[str] = "qat_conv_bn"

    bn_class: str = "BatchNorm2d"
    bn_eps: float = 1e-5
    bn_momentum: float | None = 0.1
    bn_affine: bool = True

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.bn_class not in _BN_CLASSES:
            raise IRError(f"qat_conv_bn: bn_class must be one of {_BN_CLASSES}, got {self.bn_class!r}")
        if not is_number(self.bn_eps) or not 0 < self.bn_eps < 1:
            raise IRError(f"qat_conv_bn: bn_eps must be a number in (0, 1), got {self.bn_eps!r}")
        m = self.bn_momentum
        if m is not None and (not is_number(m) or not 0 <= m <= 1):
            raise IRError(f"qat_conv_bn: bn_momentum must be None or in [0, 1], got {m!r}")
        if not isinstance(self.bn_affine, bool):
            raise IRError(f"qat_conv_bn: bn_affine must be a boolean, got {self.bn_affine!r}")
        if self.kind == "conv_transpose2d" and self.groups != 1:
            raise IRError("qat_conv_bn: a grouped transposed conv does not keep its batch norm")

    def bn_features(self) -> int:
        return self.out_channels

    def param_roles(self) -> tuple[str, ...]:
        affine = ("bn.weight", "bn.bias") if self.bn_affine else ()
        return (*super().param_roles(), *affine, "bn.running_mean", "bn.running_var", "bn.num_batches_tracked")
