"""The with_bn QAT mode in prepare: find the batch norms fusion folded, and keep them in the QAT convs.

``prepare_qat_fx`` folds every conv + batch norm at prepare (absorb-bn) whatever the mode, so
calibration and both QAT modes share one fused float model, one set of module paths and one
calibrated scale per tensor. The batch norms it folded are recorded at the first prepare
(:func:`folded_batch_norms`, copies: a few vectors per conv); in the with_bn mode a QAT
prepare then turns each such QAT conv into its with-BN class
(:func:`qir.nn.qat.conv_bn.keep_batch_norms`), unfolding the weights it holds (the float
ones, or the carried ones of a calibrated model) with the recorded statistics.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["folded_batch_norms"]


def folded_batch_norms(
    model: nn.Module, sources: Mapping[str, list[str]], copies: bool = True
) -> dict[str, tuple[str, _BatchNorm]]:
    """Fused module path -> (the batch norm's path in ``model``, a copy of it), for every folded batch norm.

    ``sources``: the fusion record's fused path -> original paths (conv first). ``copies=False``
    records the batch norms themselves: for a model that is prepare's own deep copy, whose
    folded batch norms nothing else holds once fusion took their statistics.
    """
    out: dict[str, tuple[str, _BatchNorm]] = {}
    for path, srcs in sources.items():
        bns = []
        for p in srcs[1:]:
            try:
                sub = model.get_submodule(p)
            except AttributeError:
                continue
            if isinstance(sub, _BatchNorm):
                bns.append((p, sub))
        if len(bns) == 1:
            p, bn = bns[0]
            out[path] = (p, copy.deepcopy(bn) if copies else bn)
    return out
