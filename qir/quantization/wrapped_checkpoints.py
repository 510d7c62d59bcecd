"""Checkpoints without the generated input stubs of the modules wrapped methods call.

``prepare_qat_fx`` gives every module a wrapped method calls a generated input ``QuantStub``,
``_generated_wrapped_quant_<path>`` (qir.quantization.wrapped_modules): the wrapped code receives
float tensors, which carry no scale. horizon_plugin_pytorch's prepared model has no such stub:
its wrapped code receives ``QTensor``\\s, whose scale the module's input takes, so the plugin's
checkpoints hold the module's own keys (``iou.weight``, ``iou.activation_post_process.scale``)
and nothing for the stub. Nothing in such a checkpoint gives the stub's scale, so a strict
``load_state_dict`` is refused, before anything loads, with the keys and the fix
(:func:`refuse_missing_wrapped_stubs`, called by ``QATGraphModule.load_state_dict``), and
:func:`calibrate_wrapped_inputs` gives the stubs their scales after a ``strict=False`` load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from qir.quantization.fake_quantize import FakeQuantize, FakeQuantState
from qir.quantization.wrapped_modules import WRAPPED_MODULES_KEY, WrappedModule

__all__ = ["calibrate_wrapped_inputs", "refuse_missing_wrapped_stubs"]


def _prepared(model: nn.Module) -> list[WrappedModule]:
    found: tuple[WrappedModule, ...] = getattr(model, "meta", {}).get(WRAPPED_MODULES_KEY, ())
    return [w for w in found if not w.graph_called]


def _fake_quant_keys(module: nn.Module, prefix: str) -> list[str]:
    """State-dict keys of the fake quants ``module`` holds (a float checkpoint has none of them)."""
    return [
        f"{prefix}{name}.{key}" if name else f"{prefix}{key}"
        for name, fq in module.named_modules()
        if isinstance(fq, FakeQuantize)
        for key in fq.state_dict()
    ]


def refuse_missing_wrapped_stubs(model: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Raise when ``state_dict`` holds the QAT state (the fake quants) of a module ``model``'s wrapped
    methods call but nothing of its generated input stub: the layout of the plugin's checkpoints,
    which a strict ``load_state_dict`` refuses with what to do (``QATGraphModule.load_state_dict``)."""
    lacking: list[tuple[WrappedModule, list[str]]] = []
    for w in _prepared(model):
        stub_keys = [f"{w.quant}.{k}" for k in model.get_submodule(w.quant).state_dict()]
        own = _fake_quant_keys(model.get_submodule(w.path), f"{w.path}.")
        if stub_keys and not any(k in state_dict for k in stub_keys) and any(k in state_dict for k in own):
            lacking.append((w, stub_keys))
    if not lacking:
        return
    stubs = ", ".join(f"'{w.quant}' (the input of '{w.path}')" for w, _ in lacking)
    keys = ", ".join(k for _, ks in lacking for k in ks)
    raise RuntimeError(
        f"Error(s) in loading state_dict for {type(model).__name__}: the checkpoint holds the QAT state of the "
        f"modules called inside wrapped methods but nothing for their generated input QuantStubs {stubs}; missing "
        f"keys: {keys}. A horizon_plugin_pytorch checkpoint has no such stubs (its wrapped code receives QTensors, "
        "whose scale the module's input takes); qir's wrapped code receives float tensors, so each such module "
        "records its input scale in its stub, and the checkpoint holds nothing to take it from. Load with "
        "strict=False (every other key loads; the result lists these as missing), then give the stubs their "
        "scales: qir.quantization.calibrate_wrapped_inputs(model, batches) observes them on a few batches with "
        "every other fake quant frozen, or QAT training observes them from its first step (docs/hybrid.md, "
        "'Wrapped functions')"
    )


def calibrate_wrapped_inputs(model: nn.Module, batches: Iterable[Any]) -> list[str]:
    """Observe the generated input QuantStubs of the modules ``model``'s wrapped methods call on
    ``batches`` (each a tensor or a tuple of the forward's arguments), with every other fake quant
    frozen in validation state and the model in eval mode; then put everything back as it was.
    Returns the stubs' paths. For a prepared model loaded with ``strict=False`` from a checkpoint
    that lacks them (:func:`refuse_missing_wrapped_stubs`)."""
    wrapped = _prepared(model)
    if not wrapped:
        raise ValueError(
            f"{type(model).__name__} has no generated input QuantStubs of modules called inside wrapped methods "
            "(prepare_qat_fx makes them for a model whose fx_wrap'ed methods call modules with a qconfig)"
        )
    stubs = {w.quant: model.get_submodule(w.quant) for w in wrapped}
    stub_fqs = {id(m) for stub in stubs.values() for m in stub.modules() if isinstance(m, FakeQuantize)}
    fqs = [m for m in model.modules() if isinstance(m, FakeQuantize)]
    unset = [name for name, m in model.named_modules() if isinstance(m, FakeQuantize) and m.scale.numel() == 0]
    unset = [name for name in unset if not any(name.startswith(f"{stub}.") for stub in stubs)]
    if unset:
        raise ValueError(
            f"calibrate_wrapped_inputs observes the input stubs only, with every other fake quant frozen, and "
            f"{', '.join(unset[:5])}{' ...' if len(unset) > 5 else ''} have no scale yet: load the checkpoint "
            "first (load_state_dict(state_dict, strict=False))"
        )
    saved = [(fq, fq.state, fq.observer_enabled, fq.fake_quant_enabled) for fq in fqs]
    modes = [(m, m.training) for m in model.modules()]
    seen: set[str] = set()
    hooks = [stub.register_forward_pre_hook(lambda *_, p=path: seen.add(p)) for path, stub in stubs.items()]
    runs = 0
    try:
        for fq in fqs:
            # the stubs observe and fake-quantize as in QAT, so a module's stub sees what the one before it gives
            fq.set_state(FakeQuantState.QAT if id(fq) in stub_fqs else FakeQuantState.VALIDATION)
        model.eval()
        with torch.no_grad():
            for batch in batches:
                model(*batch) if isinstance(batch, tuple) else model(batch)
                runs += 1
    finally:
        for h in hooks:
            h.remove()
        for fq, state, observing, quantizing in saved:  # the state as it was, None (never set) included
            fq.state, fq.observer_enabled, fq.fake_quant_enabled = state, observing, quantizing
        model.train(modes[0][1])  # the root's mode reaches the wrapped methods' bound modules too
        for m, training in modes:
            m.training = training
    if runs == 0:
        raise ValueError("calibrate_wrapped_inputs: batches gave no batch to observe")
    unseen = [p for p in stubs if p not in seen]
    if unseen:
        raise RuntimeError(
            f"calibrate_wrapped_inputs: the wrapped code did not call the module(s) behind {', '.join(unseen)} on "
            "these batches (a branch not taken?), so their stubs observed nothing: pass batches that reach them"
        )
    return list(stubs)
