"""Integer-exact VALIDATION: a prepared model in validation state computes what convert_fx deploys.

A QAT model's float fake quantization and the converted model's integer arithmetic differ
by up to one LSB per layer (float vs int32 bias, float vs multiplier/shift requantization),
and the differences compound with depth. So when every fake quant of an fx-prepared model
is in ``FakeQuantState.VALIDATION``, its forward runs the model's *integer twin*: the
``convert_fx`` result of its current state, built on first use and rebuilt whenever a
parameter, buffer or submodule changed. QAT-validation output ≡ ``convert_fx`` output ≡
compiled artifact output, bit for bit, by construction: one implementation serves all three.
Eager ``prepare_qat`` models do the same with eager ``convert`` as the twin's builder (their
instance ``forward``, qir.quantization.eager).

    set_fake_quantize(qat_model, "validation")
    qat_model(x)                                  # == convert_fx(qat_model)(x), exactly
    set_exact_validation(qat_model, False)        # back to float fake quantization

The twin runs without autograd (it is the deployed model); turn exactness off to get
gradients in validation state. Calibration and QAT states are unchanged (docs/semantics.md).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx
from torch import nn

from qir.quantization.graph_pickle import PicklableGraphModule, reclass

__all__ = [
    "EAGER_FLAG",
    "EXACT_VALIDATION_KEY",
    "ExactValidationMixin",
    "QATGraphModule",
    "exact_twin",
    "forget_failure",
    "install",
    "set_exact_validation",
    "set_twin_builder",
    "uninstall",
]

#: ``GraphModule.meta`` key: False turns integer-exact validation off for that model
EXACT_VALIDATION_KEY = "qir.exact_validation"

_TWINS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], nn.Module]] = weakref.WeakKeyDictionary()
_FAILED: weakref.WeakKeyDictionary[nn.Module, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def _in_validation(model: nn.Module) -> bool:
    from qir.quantization.fake_quantize import FakeQuantize, FakeQuantState

    found = False
    for m in model.modules():
        if isinstance(m, FakeQuantize):
            # the state set_fake_quantize chose, and flags not toggled since
            if m.state is not FakeQuantState.VALIDATION or m.observer_enabled or not m.fake_quant_enabled:
                return False
            found = True
    return found


def _fingerprint(model: nn.Module) -> tuple[Any, ...]:
    """Changes whenever a tensor is replaced or written in place, or a module is swapped."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return (
        tuple((name, id(t), t._version) for name, t in tensors),
        tuple((name, id(m)) for name, m in model.named_modules()),
    )


#: how a twin is built (``convert_fx`` in the prepared model's march); set by qir.quantization.convert,
#: which sits above this module (prepare installs the mixin, convert builds what it dispatches to)
_BUILDER: list[Callable[[nn.Module], nn.Module] | None] = [None]


def set_twin_builder(build: Callable[[nn.Module], nn.Module]) -> None:
    """Install the function that converts a prepared model into its integer twin."""
    _BUILDER[0] = build


def exact_twin(model: nn.Module, builder: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module | None:
    """The integer model ``model``'s validation forward runs, or None when it runs float fake quant.

    None when exactness is off (:func:`set_exact_validation`), some fake quant is not in
    VALIDATION state, or the model cannot be converted (warned once, naming the reason).
    ``builder`` converts the model (default: ``convert_fx``; eager models pass eager ``convert``)."""
    from qir.quantization.fake_quantize import float_fake_quant, float_fake_quant_active

    meta = getattr(model, "meta", {})
    if meta.get(EXACT_VALIDATION_KEY, True) is False or float_fake_quant_active():
        return None
    if not _in_validation(model):
        return None
    key = _fingerprint(model)
    cached = _TWINS.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    if _FAILED.get(model) == key:
        return None
    build = builder or _BUILDER[0]
    if build is None:
        return None
    try:
        with float_fake_quant():
            twin = build(model)
    except Exception as e:  # a model convert cannot handle keeps the float simulation, loudly
        _FAILED[model] = key
        warnings.warn(
            f"validation of {type(model).__name__} runs float fake quantization, not the integer model: "
            f"{'convert_fx' if builder is None else 'convert'} failed ({type(e).__name__}: {e}). Its outputs may "
            "differ from the deployed model's by a few LSB per layer",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    _TWINS[model] = (key, twin)
    return twin


def forget_failure(model: nn.Module) -> None:
    """Try building ``model``'s twin again on its next validation forward (an eager model whose
    first forward just recorded what convert needs)."""
    _FAILED.pop(model, None)


#: ``GraphModule.meta`` key: True when prepare traced the model without example inputs (a ``chunk(n)``
#: then has the call's n pieces, see :func:`_missing_piece`)
TRACED_WITHOUT_EXAMPLES_KEY = "qir.traced_without_examples"


class ExactValidationMixin:
    """Mixed into a prepared GraphModule's class: validation state runs the integer twin."""

    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        from qir.quantization.eval_observers import note_forward

        note_forward(self)  # type: ignore[arg-type]
        twin = exact_twin(self)  # type: ignore[arg-type]
        if twin is not None:
            with torch.no_grad():
                return twin(*args, **kwargs)
        try:
            return super()._call_impl(*args, **kwargs)  # type: ignore[misc]
        except IndexError as e:
            better = _missing_piece(self, e)  # type: ignore[arg-type]
            if better is e:
                raise
            raise better from e


def _missing_piece(gm: torch.fx.GraphModule, e: IndexError) -> IndexError:
    """``e`` explained when ``gm`` was prepared without example inputs and reads all n pieces of a
    ``chunk(n)``: the piece count was taken from the call, and this input's size gave fewer."""
    from qir.frontend.tracer import whole_chunk_calls

    calls = whole_chunk_calls(gm.graph) if gm.meta.get(TRACED_WITHOUT_EXAMPLES_KEY) else []
    if not calls:
        return e
    return IndexError(
        f"{e}: {type(gm).__name__} was prepared without example inputs, so the chunk call(s) {', '.join(calls)} were "
        "traced as n pieces each, the count the call asks for; torch returns fewer when the size along the dim is "
        "small for n (chunk(4) of 5 channels gives 3). Pass example_inputs=(...) to prepare_qat_fx: the piece "
        "count is then measured on them"
    )


class QATGraphModule(ExactValidationMixin, PicklableGraphModule):
    """The class of ``prepare_qat_fx`` results: a GraphModule with integer-exact validation
    (``torch.save`` / ``torch.load`` keep the class, qir.quantization.graph_pickle)."""

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        if strict:  # refused before anything loads: a checkpoint in the plugin's layout around wrapped calls
            from qir.quantization.wrapped_checkpoints import refuse_missing_wrapped_stubs

            refuse_missing_wrapped_stubs(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def install(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Make ``gm`` (a prepared model) a :class:`QATGraphModule`, in place; deepcopy keeps the class.

    fx gives every GraphModule instance its own ``GraphModuleImpl`` subclass holding its
    generated ``forward``; ``gm`` gets a fresh one under QATGraphModule and regenerates it."""
    if not isinstance(gm, QATGraphModule):
        reclass(gm, QATGraphModule)
    return gm


def uninstall(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Make ``gm`` a plain GraphModule again, in place (a converted model is no QAT model)."""
    if isinstance(gm, QATGraphModule):
        reclass(gm, torch.fx.GraphModule)
    return gm


#: attribute of an eager QAT model's instance ``forward`` (qir.quantization.eager): exactness on / off
EAGER_FLAG = "exact_validation"


def set_exact_validation(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Turn integer-exact validation of a ``prepare_qat_fx`` or eager ``prepare_qat`` model on
    (default) or off, in place."""
    eager_forward = model.__dict__.get("forward")
    if hasattr(eager_forward, EAGER_FLAG):
        setattr(eager_forward, EAGER_FLAG, bool(enabled))
        return model
    if not isinstance(model, ExactValidationMixin):
        raise TypeError(
            f"{type(model).__name__} is not a model made by prepare_qat_fx or prepare_qat: integer-exact "
            "validation needs the prepared model"
        )
    meta: dict[str, Any] = model.meta  # type: ignore[assignment]
    meta[EXACT_VALIDATION_KEY] = bool(enabled)
    return model
