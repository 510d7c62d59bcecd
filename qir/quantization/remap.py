"""State-dict remapping: float checkpoints load into fused and prepared models by their original keys.

:class:`StateDictRemap` is registered as a load_state_dict pre-hook on the root of every
model fuse_fx / prepare_qat_fx return. It moves a conv's keys to where fusion put the
conv (``conv.weight`` -> ``_generated_add_0.conv.weight``), folds the batch norm the
fusion absorbed (same arithmetic as the absorb-bn pass), then renames fused keys to the
QAT modules' (``..._generated_add_0.conv.weight`` -> ``..._generated_add_0.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from passes.absorb_bn import fold_batch_norm

__all__ = ["KeyRemap", "StateDictRemap"]


@dataclass(frozen=True)
class KeyRemap:
    """One conv whose float keys moved (and maybe absorbed a batch norm)."""

    conv_prefix: str  # "conv." in the float model
    new_prefix: str  # "_generated_add_0.conv." in the fused model
    conv_op: Any  # the IR conv op (fold_batch_norm reads its kind and groups)
    bn_prefix: str | None = None
    bn_eps: float = 1e-5

    def __deepcopy__(self, memo: dict[int, Any]) -> KeyRemap:
        # frozen, and every field immutable (strings, a float, a frozen IR op): a copy would equal it
        # (convert_fx copies a prepared model's meta, which holds one of these per conv)
        return self


@dataclass
class StateDictRemap:
    """load_state_dict pre-hook: float-model keys -> fused (and prepared) model keys.

    ``remaps`` move conv keys and fold batch norms; ``key_map`` then renames fused-model
    keys to the final model's (prepare fills it when QAT modules name tensors differently).
    Keys already in the fused layout pass through untouched.
    """

    remaps: list[KeyRemap] = field(default_factory=list)
    key_map: dict[str, str] = field(default_factory=dict)

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        live: set[str] | None = None
        # conv prefix -> (weight, bias) it loaded as: a conv + BN called at several places whose
        # call sites fused into different modules (ConvReLU2d, ConvAdd2d) gives each the same folded tensors
        loaded: dict[str, tuple[Any, Any]] = {}
        for r in self.remaps:
            w_key = prefix + r.conv_prefix + "weight"
            new_w = prefix + r.new_prefix + "weight"
            if w_key not in state_dict and r.conv_prefix in loaded and new_w not in state_dict:
                weight, bias = loaded[r.conv_prefix]
                state_dict[new_w] = weight
                if bias is not None:
                    state_dict[prefix + r.new_prefix + "bias"] = bias
                continue
            if w_key not in state_dict or (new_w != w_key and new_w in state_dict):
                continue  # not a float checkpoint's key, or already in the fused layout
            if live is None:
                live = set(module.state_dict(keep_vars=True))
            # a conv still called unfused elsewhere (shared by two call sites) keeps its own key:
            # the fused site gets a copy of the value instead of taking the key away
            keep = new_w != w_key and r.conv_prefix + "weight" in live
            b_key = prefix + r.conv_prefix + "bias"
            weight = state_dict[w_key] if keep else state_dict.pop(w_key)
            bias = state_dict.get(b_key) if keep else state_dict.pop(b_key, None)
            if r.bn_prefix is not None:
                bn = {
                    k: state_dict.pop(prefix + r.bn_prefix + k)
                    for k in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
                    if prefix + r.bn_prefix + k in state_dict
                }
                if "running_mean" in bn and "running_var" in bn:
                    w64, b64 = fold_batch_norm(
                        r.conv_op,
                        weight,
                        bias,
                        bn["running_mean"],
                        bn["running_var"],
                        bn.get("weight"),
                        bn.get("bias"),
                        r.bn_eps,
                    )
                    weight, bias = w64.to(weight.dtype), b64.to(weight.dtype)
            state_dict[prefix + r.new_prefix + "weight"] = weight
            if bias is not None:
                state_dict[prefix + r.new_prefix + "bias"] = bias
            loaded[r.conv_prefix] = (weight, bias)
        for old, new in self.key_map.items():
            if prefix + old in state_dict and old != new:
                state_dict[prefix + new] = state_dict.pop(prefix + old)
