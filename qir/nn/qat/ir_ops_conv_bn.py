"""The IR's ``qat_conv_bn`` op for qir's with-batch-norm QAT convs: reader and builder.

The builder rebuilds the QAT conv (``qat_conv``'s builder), makes it its with-BN class and gives
it a batch norm holding the node's ``bn.*`` tensors (shared, not copied), so training through the
rebuilt module updates the running statistics the graph holds."""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn

from qir.ir.ops.qat import QATConv, register_qat_module
from qir.ir.ops.qat_conv_bn import QATConvBN
from qir.nn.qat.conv_bn import QAT_CONV_BN_CLASSES, QATConvBNBase
from qir.nn.qat.ir_ops import _build_conv, _param, _read_conv

__all__: list[str] = []

_BN: dict[str, type[nn.Module]] = {
    "BatchNorm1d": nn.BatchNorm1d,
    "BatchNorm2d": nn.BatchNorm2d,
    "BatchNorm3d": nn.BatchNorm3d,
    "SyncBatchNorm": nn.SyncBatchNorm,
}


def _read(m: Any) -> QATConvBN:
    bn_cls = type(m.bn)
    if _BN.get(bn_cls.__name__) is not bn_cls:
        raise NotImplementedError(f"{type(m).__name__}: a batch norm of class {bn_cls.__qualname__} has no IR form")
    eps, momentum, affine = m.bn.eps, m.bn.momentum, m.bn.affine
    base = _read_conv(m)
    fields = {f.name: getattr(base, f.name) for f in attrs.fields(QATConv)}
    return QATConvBN(
        **fields,
        bn_class=bn_cls.__name__,
        bn_eps=float(eps),
        bn_momentum=None if momentum is None else float(momentum),
        bn_affine=bool(affine),
    )


def _build(op: Any, tensors: dict[str, torch.Tensor]) -> QATConvBNBase:
    m = _build_conv(op, tensors)
    m.__class__ = QAT_CONV_BN_CLASSES[type(m)]
    bn: Any = _BN[op.bn_class](op.out_channels, op.bn_eps, op.bn_momentum, op.bn_affine, device="meta")
    if op.bn_affine:
        bn.weight, bn.bias = _param(tensors["bn.weight"]), _param(tensors["bn.bias"])
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        bn._buffers[name] = tensors[f"bn.{name}"]
    m.bn = bn
    assert isinstance(m, QATConvBNBase)
    return m


for _cls in QAT_CONV_BN_CLASSES.values():
    register_qat_module(QATConvBN, _cls, _read, _build)
