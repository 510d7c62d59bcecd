"""A warning for a QAT model evaluated under ``eval()`` while its observers still update.

``model.eval()`` switches dropout and batch norm to inference, but not the fake quants: in QAT
state (``FakeQuantState.QAT``) every forward still feeds its observers and moves the activation
scales, in eval as in training (torch.ao's fake quants behave the same). Evaluating a trained QAT
model that way puts the evaluation batches' statistics into the scales ``convert_fx`` then reads:
the deployed model is not the one that was trained, and the evaluation did not measure it (qir's
demo had 448/449 argmax agreement until it evaluated in validation state). Validation state
(``set_fake_quantize(model, "validation")``) freezes the scales, and its forward is the converted
model.

So a prepared model that ran a training forward in QAT state, then runs a forward under ``eval()``
with a QAT-state fake quant still observing, warns once (a ``UserWarning`` naming the model and the
fix). Not warned: calibration (its state is CALIBRATION: observing is the point), a model evaluated
before it trained (a prepared model's first check against the float one), validation state, fake
quants whose observers were turned off (``disable_observer``) or whose scale is fixed,
``float_fake_quant()`` blocks (tools that run the QAT graph itself) and ``types_only_fake_quant()``
runs (nothing observes).

Whether a model has a fake quant observing in QAT state is cached per model on
``fake_quantize.switch_epoch()`` (which moves whenever any fake quant's state, switches or observer is
set), so the forwards that cannot warn (calibration steps, validation batches after training) cost
a dictionary lookup, not a walk over the model's modules.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from types import FrameType

import torch
from torch import nn

import qir
from qir.quantization.fake_quantize import (
    FakeQuantize,
    FakeQuantState,
    float_fake_quant_active,
    switch_epoch,
    types_only_fake_quant_active,
)

__all__ = ["note_forward"]

#: models that ran a training forward in QAT state, and those already warned
_TRAINED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


#: frames in these folders are the call machinery between the user's ``model(x)`` and this module
_MACHINERY = tuple(os.path.dirname(p) + os.sep for p in (torch.__file__, qir.__file__))


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside torch and qir."""
    frame: FrameType | None
    frame, level = sys._getframe(2), 2  # stacklevel 2 is note_forward's caller, frame 2 from here
    while frame is not None and frame.f_code.co_filename.startswith(_MACHINERY):
        frame, level = frame.f_back, level + 1
    return level


#: model -> (switch epoch, whether a fake quant of it observes in QAT state): a forward in the same
#: switch settings (every calibration step, every validation batch) answers without walking the model
_OBSERVING: weakref.WeakKeyDictionary[nn.Module, tuple[int, bool]] = weakref.WeakKeyDictionary()


def _observing_in_qat(model: nn.Module) -> bool:
    epoch = switch_epoch()
    known = _OBSERVING.get(model)
    if known is not None and known[0] == epoch:
        return known[1]
    found = _scan(model)
    _OBSERVING[model] = (epoch, found)
    return found


def _scan(model: nn.Module) -> bool:
    return any(
        isinstance(m, FakeQuantize)
        and m.state is FakeQuantState.QAT
        and m.observer_enabled
        and m.fake_quant_enabled
        and not m.has_fixed_scale
        for m in model.modules()
    )


def note_forward(model: nn.Module) -> None:
    """Called by a prepared model's forward (fx: qir.quantization.exact_validation; eager:
    qir.quantization.eager) before it runs: remembers a QAT training forward, and warns once when
    the trained model then runs under ``eval()`` with QAT-state observers on."""
    if float_fake_quant_active() or types_only_fake_quant_active():
        return  # a tool running the QAT graph, or a types-only run that observes nothing
    if model.training:
        if model not in _TRAINED and _observing_in_qat(model):
            _TRAINED.add(model)
        return
    if model in _WARNED or model not in _TRAINED or not _observing_in_qat(model):
        return
    _WARNED.add(model)
    warnings.warn(
        f"{type(model).__name__} runs under eval() in QAT fake-quant state: its observers still update, so "
        "these batches move the activation scales that convert will read. To evaluate the model you "
        'deploy, call set_fake_quantize(model, FakeQuantState.VALIDATION) (or "validation") after eval(); '
        "set_fake_quantize(model, FakeQuantState.QAT) before training again (docs/debugging.md)",
        UserWarning,
        stacklevel=_caller_level(),  # the user's model(x), above the forward machinery
    )
