"""``self`` of an ``fx_helper.wrap``-ed method follows the model's training mode.

A wrapped method is recorded bound to the traced copy of the user's module (its class, its
attributes, its other methods), which is not a submodule of the prepared or converted
GraphModule; ``model.train()`` / ``model.eval()`` would not reach it, and the seed's RetinaNet
branches on ``self.training`` inside its wrapped ``_post_process``. A forward pre-hook on the
GraphModule sets the bound modules' mode to the model's before each call.
"""

from __future__ import annotations

from typing import Any

import torch.fx
from torch import nn

from qir.quantization.graph_pickle import make_picklable, wrapped_selves

__all__ = ["follow_training", "picklable", "wrapped_selves"]


def _sync_training(gm: nn.Module, args: Any) -> None:
    if not isinstance(gm, torch.fx.GraphModule):
        return
    for m in wrapped_selves(gm):
        if m.training != gm.training:
            m.train(gm.training)


def _copied(copy: torch.fx.GraphModule) -> None:
    follow_training(copy)  # GraphModule's deepcopy drops forward hooks


def picklable(gm: torch.fx.GraphModule) -> bool:
    """Make ``gm`` picklable when it calls wrapped methods (fx writes a bound method as an import,
    and ``torch.save`` fails: qir.quantization.graph_pickle); whether it calls any."""
    if not wrapped_selves(gm):
        return False
    make_picklable(gm)
    return True


def follow_training(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Register the mode-following hook on ``gm`` when it calls wrapped methods (once), and
    again on every deep copy of it; make ``gm`` picklable (qir.quantization.graph_pickle)."""
    if not picklable(gm):
        return gm
    if _sync_training not in gm._forward_pre_hooks.values():
        gm.register_forward_pre_hook(_sync_training)
    register = getattr(gm, "_register_deepcopy_hook", None)
    if register is not None and _copied not in gm.__dict__.get("_deepcopy_hooks", []):
        register(_copied)
    return gm
