"""QAT conv / linear modules that keep their batch norm (the plugin's ``with_bn`` QAT mode).

``ConvBN2d``, ``ConvBNReLU2d``, ``ConvBNAddReLU2d``, ``LinearBN``, ...: one class per QAT
conv class (:mod:`qir.nn.qat.conv`), holding the unfolded ``weight`` / ``bias`` and the batch
norm as ``bn``. With ``s = gamma / sqrt(running_var + eps)`` per output channel:

- training: ``bn(conv(x, fq(w * s)) / s + b)``: the weight is fake-quantized as it will be
  deployed (folded with the running statistics), the division undoes the fold so the batch
  norm sees the conv's own output, normalizes with the batch statistics and updates its
  running statistics (Krishnamoorthi 2018, section 3.2; torch.ao's ``ConvBn2d``);
- eval: ``conv(x, fq(w * s)) + (b - running_mean) * s + beta``: the folded conv, exactly
  what :meth:`QATConvBNBase.fold` makes for convert.

Then the fused add, activation and output fake quant, as in the base class. ``convert_fx``
folds each module into its base class first (:func:`fold_batch_norms`), so the integer
model is a fuse_bn model's and validation equals it bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from qir.nn.qat.conv import QAT_CONV_CLASSES, QATConvBase

__all__ = ["QAT_CONV_BN_CLASSES", "QATConvBNBase", "fold_batch_norms", "keep_batch_norm", "keep_batch_norms"]


def _along(t: torch.Tensor, axis: int, ndim: int) -> torch.Tensor:
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return t.reshape(shape)


class QATConvBNBase(QATConvBase):
    """Behaviour shared by the with-batch-norm QAT conv / linear classes."""

    base_class: ClassVar[type[QATConvBase]]
    bn: _BatchNorm
    #: no integer grid: the batch norm normalizes with batch statistics after the conv
    grid_inputs: ClassVar[int] = 0

    def _bn_scale(self) -> torch.Tensor:
        """``gamma / sqrt(running_var + eps)`` per output channel."""
        bn = self.bn
        assert bn.running_var is not None
        std = torch.sqrt(bn.running_var + bn.eps)
        return bn.weight / std if bn.affine else 1.0 / std

    def _folded_weight(self, s: torch.Tensor) -> torch.Tensor:
        return self.weight * _along(s, self.weight_axis, self.weight.dim())

    def _folded_bias(self, s: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        assert bn.running_mean is not None
        b = self.bias if self.bias is not None else torch.zeros_like(bn.running_mean)
        beta = bn.bias if bn.affine else torch.zeros_like(bn.running_mean)
        return (b - bn.running_mean) * s + beta

    def forward(self, x: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
        s = self._bn_scale()
        w = self.weight_fake_quant(self._folded_weight(s))
        if self.training:
            zero = torch.zeros_like(s)
            y = self._linear_op(x, w, zero)
            # Undo the fold: a channel with gamma = 0 has an all-zero folded weight and output; its
            # batch norm then outputs beta whatever the divisor, so divide by 1 there.
            y = y / _along(torch.where(s == 0, torch.ones_like(s), s), self.out_axis, y.dim())
            if self.bias is not None:
                y = y + _along(self.bias, self.out_axis, y.dim())
            y = self.bn(y)
        else:
            y = self._linear_op(x, w, self._folded_bias(s))
        return self._finish(y, addend)

    @torch.no_grad()
    def fold(self) -> QATConvBase:
        """This module as its base class with the batch norm folded in (running statistics), in place.

        The folded weight and bias are the eval forward's, so the base module computes what
        this one computes in eval mode; the fake quants, and so the scales, are kept.
        """
        s = self._bn_scale().detach()
        weight = self._folded_weight(s).detach().clone()
        bias = self._folded_bias(s).detach().clone()
        del self.bn
        self.__class__ = self.base_class  # type: ignore[assignment]
        self.weight = nn.Parameter(weight, requires_grad=self.weight.requires_grad)
        self.bias = nn.Parameter(bias)
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, with_bn=True"


def _check_bn(conv: QATConvBase, bn: nn.Module, where: str) -> _BatchNorm:
    if not isinstance(bn, _BatchNorm) or not bn.track_running_stats or bn.running_var is None:
        raise ValueError(
            f"with_bn QAT: '{where}' needs a batch norm that tracks running statistics, got {type(bn).__name__}; "
            "give it track_running_stats=True, or prepare in the fuse_bn QAT mode"
        )
    channels = conv.weight.shape[conv.weight_axis]
    groups = int(getattr(conv, "groups", 1))
    if conv.weight_axis == 1:
        channels *= groups
    if bn.num_features != channels:
        raise ValueError(
            f"with_bn QAT: '{where}' has {channels} output channels but its batch norm has {bn.num_features} features"
        )
    if conv.weight_axis == 1 and groups != 1:
        raise NotImplementedError(
            f"with_bn QAT: '{where}' is a grouped transposed conv; keeping its batch norm is not implemented "
            "(prepare in the fuse_bn QAT mode)"
        )
    return bn


@torch.no_grad()
def keep_batch_norm(conv: QATConvBase, bn: nn.Module, where: str) -> QATConvBNBase:
    """Turn ``conv`` (a QAT conv whose weight and bias hold ``bn`` folded in) into its with-BN class, in place.

    ``bn`` is the batch norm that was folded (its statistics at folding); a copy of it goes
    to ``conv.bn`` and the weight and bias are unfolded (computed in float64):
    ``w = w' / s``, ``b = (b' - beta) / s + running_mean``. A channel with ``gamma = 0`` keeps
    a zero weight (its folded weight held nothing to recover).
    """
    cls = QAT_CONV_BN_CLASSES.get(type(conv))
    if cls is None:
        raise TypeError(f"with_bn QAT: '{where}' is a {type(conv).__name__}, which has no with-batch-norm form")
    bn = _check_bn(conv, bn, where)
    assert bn.running_var is not None and bn.running_mean is not None
    var, mean = bn.running_var.double(), bn.running_mean.double()
    gamma = bn.weight.double() if bn.affine else torch.ones_like(var)
    beta = bn.bias.double() if bn.affine else torch.zeros_like(var)
    s = gamma / torch.sqrt(var + bn.eps)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    w = conv.weight.detach().double() / _along(safe, conv.weight_axis, conv.weight.dim())
    b_folded = conv.bias.detach().double() if conv.bias is not None else beta.clone()
    b = torch.where(s == 0, mean, (b_folded - beta) / safe + mean)
    conv.weight.copy_(w.to(conv.weight.dtype))
    if conv.bias is not None:
        conv.bias.copy_(b.to(conv.bias.dtype))
    else:
        conv.bias = nn.Parameter(b.to(conv.weight.dtype))
    kept = type(bn)(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
    kept.load_state_dict(bn.state_dict())
    kept.to(device=conv.weight.device)
    conv.__class__ = cls
    conv.bn = kept
    conv.bn.train(conv.training)
    assert isinstance(conv, QATConvBNBase)
    return conv


def keep_batch_norms(
    model: nn.Module, batch_norms: Mapping[str, tuple[str, _BatchNorm]], call_sites: Mapping[str, list[str]]
) -> list[str]:
    """Turn the QAT convs of ``model`` that folded a recorded batch norm into their with-BN classes, in place.

    Returns their paths. A conv called at several places, or whose weight another module
    shares, stays folded: its call sites share one weight, which one batch norm's
    statistics cannot unfold for all of them.
    """
    shared_calls = set(call_sites) | {p for copies in call_sites.values() for p in copies}
    owners: dict[int, int] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for param in mod.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    kept = []
    for path, (bn_path, bn) in batch_norms.items():
        try:
            conv = model.get_submodule(path)
        except AttributeError:
            continue
        if not isinstance(conv, QATConvBase) or type(conv) not in QAT_CONV_BN_CLASSES:
            continue
        if path in shared_calls or owners.get(id(conv.weight), 0) > 1:
            continue
        keep_batch_norm(conv, bn, f"{path} (batch norm {bn_path})")
        kept.append(path)
    return kept


def fold_batch_norms(model: nn.Module) -> list[str]:
    """Fold every with-BN QAT module of ``model`` into its base class, in place; their paths."""
    folded = [name for name, m in model.named_modules() if isinstance(m, QATConvBNBase)]
    for name in folded:
        m = model.get_submodule(name)
        assert isinstance(m, QATConvBNBase)
        m.fold()
    return folded


def _bn_name(name: str) -> str:
    """``Conv2d`` -> ``ConvBN2d``, ``ConvAddReLU2d`` -> ``ConvBNAddReLU2d``, ``LinearReLU`` -> ``LinearBNReLU``."""
    for head in ("ConvTranspose", "Conv", "Linear"):
        if name.startswith(head):
            return f"{head}BN{name[len(head) :]}"
    raise ValueError(name)


#: QAT conv class -> its with-batch-norm class
QAT_CONV_BN_CLASSES: dict[type[QATConvBase], type[QATConvBNBase]] = {}


def _make() -> dict[str, Any]:
    made: dict[str, Any] = {}
    for base in QAT_CONV_CLASSES.values():
        name = _bn_name(base.__name__)
        cls = type(
            name,
            (QATConvBNBase, base),
            {
                "base_class": base,
                "__module__": __name__,
                "__qualname__": name,
                "__doc__": f"QAT {base.__name__} that keeps its batch norm (with_bn QAT mode).",
            },
        )
        QAT_CONV_BN_CLASSES[base] = cls
        made[name] = cls
    return made


_GENERATED = _make()
globals().update(_GENERATED)
__all__ += sorted(_GENERATED)
