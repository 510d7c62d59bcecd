"""The model side of the ONNX export: an eval-mode deep copy whose fake quants call an export op.

``qir::onnx_fake_quant(x, scale, zero_point, axis)`` computes qir's fake quant (half up) in
torch; :mod:`qir.utils.onnx_helper` translates it to ``QuantizeLinear -> DequantizeLinear``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from qir.ir.types import DType
from qir.quantization.fake_quantize import FakeQuantize, fake_quantize, float_fake_quant

__all__ = ["export_copy"]

_STORAGE = {DType.qint8: torch.int8, DType.qint16: torch.int16}


# -- the export-only op ---------------------------------------------------------------------


@torch.library.custom_op("qir::onnx_fake_quant", mutates_args=())
def _onnx_fake_quant(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int | None) -> torch.Tensor:
    """qir's fake quant (half up); ``zero_point``'s dtype (int8/int16) names the quantized dtype."""
    dtype = "qint8" if zero_point.dtype == torch.int8 else "qint16"
    with torch.no_grad():
        return fake_quantize(x, scale.reshape(-1), dtype, axis)


@_onnx_fake_quant.register_fake
def _(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int | None) -> torch.Tensor:
    return torch.empty_like(x)


class _OnnxFakeQuantize(FakeQuantize):
    """A FakeQuantize of the export copy: no observing, fake quant through the export op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fake_quant_enabled:
            return x
        out: torch.Tensor = torch.ops.qir.onnx_fake_quant(x, self.scale, self.zero_point, self.ch_axis)
        return out


def _check_fake_quant(fq: FakeQuantize, name: str) -> None:
    storage = _STORAGE.get(fq.dtype)
    if storage is None:
        raise NotImplementedError(f"fake quant {name!r}: dtype {fq.dtype.name} has no ONNX QuantizeLinear mapping")
    info = torch.iinfo(storage)
    if (fq.qmin, fq.qmax) != (info.min, info.max):
        raise NotImplementedError(
            f"fake quant {name!r}: range [{fq.qmin}, {fq.qmax}] is not the full {storage} range; "
            "ONNX QuantizeLinear saturates to the full range only"
        )
    if fq.fake_quant_enabled and fq.scale.numel() == 0:
        raise RuntimeError(f"fake quant {name!r} has no per-channel scale yet: observe a batch before exporting")


def _switch_fake_quant(fq: FakeQuantize) -> None:
    """Switch ``fq`` (of the export copy) to the export op, with ONNX-shaped scale and zero point."""
    # ONNX wants a scalar scale per tensor and a 1-D one per channel; the zero point's type is the
    # quantized type. Both are buffers, so they become initializers named after the fake quant.
    scale = fq.scale.detach().to(torch.float32)
    fq.scale = scale.reshape(()) if fq.ch_axis is None else scale.reshape(-1)
    fq.zero_point = torch.zeros(fq.scale.shape, dtype=_STORAGE[fq.dtype], device=scale.device)
    fq.__class__ = _OnnxFakeQuantize


def _weight_pairs(model: nn.Module) -> list[tuple[nn.Parameter, FakeQuantize]]:
    """(weight, its enabled fake quant) of the QAT modules: ``m.weight_fake_quant(m.weight)``."""
    pairs, seen = [], set()
    for m in model.modules():
        w, fq = getattr(m, "weight", None), getattr(m, "weight_fake_quant", None)
        if isinstance(w, nn.Parameter) and isinstance(fq, FakeQuantize) and fq.fake_quant_enabled and id(w) not in seen:
            if fq.scale.numel() > 0:
                seen.add(id(w))
                pairs.append((w, fq))
    return pairs


def _direct_pairs(
    model: nn.Module,
    pairs: list[tuple[nn.Parameter, FakeQuantize]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
) -> list[tuple[nn.Parameter, FakeQuantize]]:
    """The pairs whose fake quant receives the weight itself (not, say, a BN-folded weight) on the example input."""
    seen: dict[int, list[bool]] = {id(fq): [] for _, fq in pairs}
    handles = []
    for w, fq in pairs:

        def hook(mod: nn.Module, inputs: tuple[Any, ...], w: nn.Parameter = w) -> None:
            seen[id(mod)].append(bool(inputs) and inputs[0] is w)

        handles.append(fq.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(*args, **(kwargs or {}))
    finally:
        for h in handles:
            h.remove()
    return [(w, fq) for w, fq in pairs if seen[id(fq)] and all(seen[id(fq)])]


def _preround_weights(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> int:
    """Store each fake-quantized weight as qir's fake-quantized value (in the export copy).

    ``w / scale`` is then an integer to well within half a code, so the exported Q/DQ reproduces
    qir's weight codes exactly, including the ties where ONNX's half-to-even rounding would
    differ (an observed channel's own extreme sits at -127.5). Done only where the fake quant is
    seen receiving the weight parameter itself. Returns how many weights were pre-rounded.
    """
    pairs = _weight_pairs(model)
    if pairs:
        pairs = _direct_pairs(model, pairs, args, kwargs)
    with torch.no_grad():
        for w, fq in pairs:
            w.copy_(fake_quantize(w, fq.scale, fq.dtype, fq.ch_axis))
    return len(pairs)


def export_copy(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> nn.Module:
    """An eval-mode deep copy of ``model`` for export: observers off, weights pre-rounded, fake quants switched."""
    try:
        dup = copy.deepcopy(model)
    except Exception as e:
        raise TypeError(f"export_to_onnx exports a deep copy of the model, and copying failed: {e}") from e
    dup.eval()
    for name, m in dup.named_modules():
        if isinstance(m, FakeQuantize):
            # no observing from here on: the export must carry the model's scales as they are
            m.disable_observer()
            _check_fake_quant(m, name)
    with float_fake_quant():  # the fake-quant modules' own forward, even in validation state
        _preround_weights(dup, args, kwargs)
    for m in dup.modules():
        if isinstance(m, FakeQuantize):
            _switch_fake_quant(m)
    return dup
