"""Eager calibration and shared-conv fusion: ``prepare_calibration`` and ``fuse_conv_shared_modules``.

``prepare_calibration(model, inplace=False)`` is eager ``prepare_qat`` for calibration
qconfigs (``model.qconfig = get_default_calib_qconfig()``): modules become their QAT classes
with observe-only fake quants, so running data through the model records the scales;
``convert`` then gives the integer model, or ``prepare_qat`` on the float model plus the
calibrated state dict starts QAT from them.

``fuse_conv_shared_modules(model, modules_to_fuse, inplace=False)`` fuses conv (+ bn) (+ relu)
groups whose conv is shared with other groups (one conv module in every level's Sequential,
each level with its own batch norm). The fused module takes the *last* position of each group
and the others become ``Identity()``, so the shared conv module itself is never replaced and
every group folds its own batch norm into its own copy of the weights.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

from qir.quantization.eager import fuse_known_modules, prepare_qat
from qir.quantization.qconfig import as_qir_qconfig, qconfig_kind

__all__ = ["fuse_conv_shared_modules", "prepare_calibration"]


def prepare_calibration(model: nn.Module, inplace: bool = False) -> nn.Module:
    """Eager preparation for calibration; every module's qconfig (``.qconfig`` or an ancestor's)
    must be a calibration qconfig. Returns the prepared model (``model`` itself when ``inplace``)."""
    kinds: dict[str, str] = {}
    for path, m in model.named_modules():
        qc = as_qir_qconfig(getattr(m, "qconfig", None), f"module '{path or '<root>'}'.qconfig")
        if qc is not None and (qc.activation is not None or qc.weight is not None):
            kinds[path or "<root>"] = qconfig_kind(qc)
    if not kinds:
        raise ValueError(
            "prepare_calibration: no module of the model has a qconfig; set "
            "model.qconfig = qir.quantization.get_default_calib_qconfig() first"
        )
    qat = sorted(p for p, k in kinds.items() if k == "qat")
    if qat:
        raise ValueError(
            f"prepare_calibration got QAT qconfigs (on {', '.join(repr(p) for p in qat[:3])}); calibration "
            "observes without fake quantization: use get_default_calib_qconfig() (or "
            "default_calib_8bit_fake_quant_qconfig), or call prepare_qat for QAT"
        )
    return prepare_qat(model, inplace=inplace)


def _get(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        children = ", ".join(n for n, _ in model.named_modules() if n) or "(none)"
        raise ValueError(
            f"fuse_conv_shared_modules: the model has no module '{name}'; its modules: {children}"
        ) from None


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def fuse_conv_shared_modules(
    model: nn.Module, modules_to_fuse: Sequence[str] | Sequence[Sequence[str]], inplace: bool = False
) -> nn.Module:
    """Fuse each ``[conv, bn?, relu?]`` group of ``modules_to_fuse`` (names in ``model``), putting
    the fused module last in the group and ``Identity()`` before it."""
    if not inplace:
        model = copy.deepcopy(model)
    groups = [list(modules_to_fuse)] if modules_to_fuse and isinstance(modules_to_fuse[0], str) else modules_to_fuse
    for group in groups:
        names = [str(n) for n in group]
        if len(names) < 2:
            raise ValueError(f"fuse_conv_shared_modules: a group needs at least two modules, got {names}")
        fused = fuse_known_modules([_get(model, n) for n in names])
        # the shared conv keeps its place and identity for the other groups: the fused module,
        # which holds this group's folded copy, goes where the group ends
        for n in names[:-1]:
            _set(model, n, nn.Identity())
        _set(model, names[-1], fused[0])
    return model
