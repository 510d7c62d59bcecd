"""``qir.nn.LayerNorm``: the plugin's LayerNorm, which can normalize over one dim (``dim=1``: channels).

``LayerNorm(normalized_shape)`` is ``torch.nn.LayerNorm`` (the trailing dims). With ``dim``
(the plugin's "LayerNorm2d" use: ``LayerNorm([C, 1, 1], dim=1)`` on N, C, H, W), it normalizes
over that one dim: the module moves ``dim`` last, applies a ``torch.nn.LayerNorm(C)`` child and
moves it back. Built from a transpose and an ordinary LayerNorm, it prepares, converts, checks
and compiles through the existing LayerNorm rules (exact integer mean, variance and square root)
with no op of its own.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = ["LayerNorm"]


def _shape(normalized_shape: int | Sequence[int] | torch.Size) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (int(normalized_shape),)
    return tuple(int(d) for d in normalized_shape)


class LayerNorm(nn.Module):
    """``LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, device, dtype, dim=None, sqrt_kwargs=None)``.

    ``dim=None`` returns a ``torch.nn.LayerNorm``. With ``dim``, ``normalized_shape`` gives the
    affine parameters' shape as in the plugin (``[C]`` or ``[C, 1, 1]``: one entry other than 1);
    the state dict holds them as ``norm.weight`` / ``norm.bias`` of shape ``(C,)``, and a
    checkpoint with the plugin's ``weight`` / ``bias`` keys loads (reshaped).
    ``sqrt_kwargs`` tune the plugin's reciprocal-square-root lookup table; qir computes an exact
    integer square root, so they have no effect (a warning says so).
    """

    #: fx traces into this module (a transpose around a LayerNorm child): see qir.frontend.lookup
    trace_through: ClassVar[bool] = True

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:  # copy.deepcopy / pickle rebuild an instance of this class
            return super().__new__(cls)
        names = ("normalized_shape", "eps", "elementwise_affine", "device", "dtype", "dim", "sqrt_kwargs")
        bound = {**dict(zip(names, args, strict=False)), **kwargs}
        if bound.get("dim") is None:
            if bound.get("sqrt_kwargs") is not None:
                _warn_sqrt_kwargs()
            bound.pop("dim", None)
            bound.pop("sqrt_kwargs", None)
            return nn.LayerNorm(**bound)
        return super().__new__(cls)

    def __init__(
        self,
        normalized_shape: int | Sequence[int] | torch.Size,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        device: Any = None,
        dtype: Any = None,
        dim: int | None = None,
        sqrt_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        shape = _shape(normalized_shape)
        big = [d for d in shape if d != 1]
        if not shape or len(big) > 1:
            raise ValueError(
                f"LayerNorm(normalized_shape={list(shape)}, dim={dim}): with dim=, normalized_shape is the shape of "
                "the per-channel weight, e.g. [C] or [C, 1, 1] (one entry other than 1)"
            )
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"LayerNorm dim must be an int or None, got {dim!r}")
        if sqrt_kwargs is not None:
            _warn_sqrt_kwargs()
        self.normalized_shape = shape
        self.dim = dim
        self.eps = float(eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.norm = nn.LayerNorm(math.prod(shape), eps, elementwise_affine, device=device, dtype=dtype)
        self._register_load_state_dict_pre_hook(self._plugin_keys)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transpose is its own inverse: dim goes last, the child normalizes it, it comes back
        return self.norm(x.transpose(self.dim, -1)).transpose(self.dim, -1)

    def _plugin_keys(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """The plugin's module holds ``weight`` / ``bias`` of ``normalized_shape``: load them into the child."""
        for name in ("weight", "bias"):
            key = prefix + name
            if key in state_dict and prefix + "norm." + name not in state_dict:
                state_dict[prefix + "norm." + name] = state_dict.pop(key).reshape(-1)

    def extra_repr(self) -> str:
        affine = self.elementwise_affine
        return f"{list(self.normalized_shape)}, eps={self.eps}, elementwise_affine={affine}, dim={self.dim}"


def _warn_sqrt_kwargs() -> None:
    warnings.warn(
        "LayerNorm(sqrt_kwargs=...) tunes the plugin's rsqrt lookup table; qir computes an exact integer "
        "square root, so sqrt_kwargs have no effect",
        stacklevel=3,
    )
