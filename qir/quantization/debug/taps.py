"""Per-layer outputs of a model, by module path, as float tensors with the size of one output LSB.

A model is one of four stages (:func:`model_stage`): ``float``, ``prepared`` (calibration or
QAT: holds fake quants), ``converted`` (holds qir quantized modules, whose outputs are
integer codes with a ``scale`` buffer) or ``opaque`` (e.g. a compiled artifact: only its
final output is seen). :func:`record` runs the model once with forward hooks and undoes
everything it changed: hooks, train/eval flags and fake-quant switches.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from qir.quantization.fake_quantize import FakeQuantize, float_fake_quant
from qir.quantization.observer import ObserverBase

__all__ = ["OUTPUT", "Stage", "Tap", "as_inputs", "comparable", "frozen", "model_stage", "record"]

Stage = Literal["float", "prepared", "converted", "opaque"]
#: Name of the row for the model's final output(s).
OUTPUT = "(output)"


@dataclass
class Tap:
    """One recorded tensor: its name, float value, LSB size (``None``: not quantized) and dtype name."""

    name: str
    module_type: str
    value: torch.Tensor
    lsb: torch.Tensor | None
    dtype: str


def is_quantized_module(m: nn.Module) -> bool:
    """One of qir's integer modules (``qir.nn.quantized``), known by its class's module: qir.nn sits above."""
    return type(m).__module__.startswith("qir.nn.quantized")


def _is_qat_module(m: nn.Module) -> bool:
    return type(m).__module__.startswith("qir.nn.qat")


def model_stage(model: Any) -> Stage:
    """What ``model`` is: float, prepared (fake quants), converted (quantized modules), or opaque."""
    if not isinstance(model, nn.Module):
        if callable(model):
            return "opaque"
        raise TypeError(f"expected an nn.Module or a callable model, got {type(model).__name__}")
    mods = list(model.modules())
    if any(is_quantized_module(m) for m in mods):
        return "converted"
    if any(isinstance(m, FakeQuantize) or _is_qat_module(m) for m in mods):
        return "prepared"
    if not any(True for _ in model.children()) and type(model).forward is nn.Module.forward:
        return "opaque"
    return "float"


def as_inputs(inputs: Any) -> tuple[Any, ...]:
    """``inputs`` as the positional arguments of one call: a tensor becomes a 1-tuple."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs)
    raise TypeError(f"inputs must be a tensor or a tuple of a model's positional inputs, got {type(inputs).__name__}")


def comparable(float_model: nn.Module, other: Stage) -> nn.Module:
    """A float model fused like prepare fuses it (on a copy), so module paths match the other model's.

    prepare and convert fuse conv + bn + relu into one module named after the conv (or the
    add); compared by path, the unfused float model would pair a conv's pre-BN output with
    the fused module's post-ReLU one.
    """
    if other not in ("prepared", "converted"):
        return float_model
    from qir.quantization import fuse_fx

    work = copy.deepcopy(float_model).eval()
    try:
        return fuse_fx(work)
    except Exception as e:  # a model fx cannot trace: say what to pass instead
        raise ValueError(
            f"cannot fuse the float model to match the quantized one's module paths ({type(e).__name__}: {e}); "
            "pass qir.quantization.fuse_fx(float_model) yourself"
        ) from e


@contextlib.contextmanager
def frozen(model: Any) -> Iterator[None]:
    """Run ``model`` without changing it: eval mode, prepared models in validation state; all restored after."""
    if not isinstance(model, nn.Module):
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    fqs = [(fq, fq.observer_enabled, fq.fake_quant_enabled) for fq in model.modules() if isinstance(fq, FakeQuantize)]
    try:
        model.eval()
        for fq, _, _ in fqs:
            fq.observer_enabled, fq.fake_quant_enabled = False, True
        yield
    finally:
        for m, t in modes:
            m.training = t
        for fq, obs, fake in fqs:
            fq.observer_enabled, fq.fake_quant_enabled = obs, fake


def _lsb(module: nn.Module, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """(float value, LSB size or None, dtype name) of one module output."""
    scale = getattr(module, "scale", None)
    if is_quantized_module(module) and not out.is_floating_point() and isinstance(scale, torch.Tensor):
        scale = scale.detach()
        return out.to(torch.float32) * scale, scale, _int_name(out.dtype)
    fq = getattr(module, "activation_post_process", None)
    if isinstance(fq, FakeQuantize) and fq.fake_quant_enabled and fq.scale.numel() == 1:
        return out.detach().float(), fq.scale.detach().clone(), fq.dtype.name
    return out.detach().float(), None, "float32"


def _int_name(dt: torch.dtype) -> str:
    return {torch.int8: "qint8", torch.int16: "qint16", torch.int32: "qint32"}.get(dt, str(dt).replace("torch.", ""))


def _flatten(name: str, out: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(out, torch.Tensor):
        return [(name, out)]
    if isinstance(out, (tuple, list)):
        return [pair for i, o in enumerate(out) for pair in _flatten(f"{name}[{i}]", o)]
    if isinstance(out, dict):
        return [pair for k, o in out.items() for pair in _flatten(f"{name}[{k!r}]", o)]
    return []


def _skip(name: str, module: nn.Module) -> bool:
    # Fake quants and observers are part of their owner's output; pass-through wrappers add nothing.
    return not name or isinstance(module, (FakeQuantize, ObserverBase)) or isinstance(module, nn.Identity)


def record(model: Any, inputs: Sequence[Any]) -> tuple[dict[str, Tap], list[Tap]]:
    """Run ``model(*inputs)`` once; ``(per-layer taps in call order, final-output taps)``.

    A module called more than once gets ``name#2``, ``name#3``... for its later calls.
    A prepared model runs its fake-quant graph here even in validation state (where its
    forward would otherwise run the integer twin, docs/semantics.md): the per-layer taps are
    its own modules' outputs.
    """
    taps: dict[str, Tap] = {}
    calls: dict[str, int] = {}
    handles = []

    def hook(name: str) -> Any:
        def fn(module: nn.Module, args: Any, out: Any) -> None:
            k = calls.get(name, 0) + 1
            calls[name] = k
            key = name if k == 1 else f"{name}#{k}"
            for sub, t in _flatten(key, out):
                value, lsb, dtype = _lsb(module, t)
                taps[sub] = Tap(sub, type(module).__name__, value, lsb, dtype)

        return fn

    if isinstance(model, nn.Module):
        skipped: set[str] = set()
        for name, mod in model.named_modules():
            if any(name.startswith(s + ".") for s in skipped):
                continue
            if _skip(name, mod):
                if name:
                    skipped.add(name)
                continue
            handles.append(mod.register_forward_hook(hook(name)))
    try:
        with frozen(model), torch.no_grad(), float_fake_quant():
            out = model(*inputs)
    finally:
        for h in handles:
            h.remove()
    final = [
        Tap(n, "output", t.detach().float(), None, _int_name(t.dtype) if not t.is_floating_point() else "float32")
        for n, t in _flatten(OUTPUT, out)
    ]
    return taps, final
