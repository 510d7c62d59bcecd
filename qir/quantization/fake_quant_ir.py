"""Fake quants as IR data: :class:`~qir.ir.ops.qat.FakeQuantSpec` <-> qir's fake-quant modules.

A fake quant becomes a ``FakeQuantSpec`` when its class and its observer's class are ones
qir knows by name (:data:`OBSERVER_KINDS`); any other (a learnable scale, a user observer)
has no data form (``NotImplementedError``). The IR's QAT ops (qir/nn/qat/ir_ops.py) and
``prepare_qat_fx`` (which hands each module's qconfig to the ``insert-observers`` pass as
data) read and rebuild fake quants with these.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from qir.ir.ops.qat import FakeQuantSpec
from qir.ir.ops.quant import ObserverSpec
from qir.quantization.fake_quantize import CalibFakeQuantize, FakeQuantize, FakeQuantState
from qir.quantization.observer import (
    FixedScaleObserver,
    MinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
    ObserverBase,
    PercentileObserver,
)

__all__ = ["OBSERVER_KINDS", "bind_fake_quant", "build_fake_quant", "fake_quant_factory", "fake_quant_spec"]

#: observer kind (an ObserverSpec's ``observer``) -> class, and the constructor options each reads
OBSERVER_KINDS: dict[str, tuple[type[ObserverBase], tuple[str, ...]]] = {
    "moving_average_minmax": (MovingAveragePerTensorMinMaxObserver, ("averaging_constant",)),
    "moving_average_per_channel_minmax": (MovingAveragePerChannelMinMaxObserver, ("averaging_constant",)),
    "minmax": (MinMaxObserver, ()),
    "percentile": (PercentileObserver, ("percentile", "bins")),
    "fixed_scale": (FixedScaleObserver, ()),
}
_KIND_OF = {cls: kind for kind, (cls, _) in OBSERVER_KINDS.items()}
#: options every observer takes (ObserverBase's constructor)
_COMMON = ("eps", "sync_ranks", "nonfinite")


def fake_quant_spec(fq: Any, where: str) -> FakeQuantSpec:
    """``fq`` as data; NotImplementedError (the module stays an opaque call) when it has no data form."""
    if type(fq) not in (FakeQuantize, CalibFakeQuantize):
        raise NotImplementedError(f"{where}: {type(fq).__name__} is not a FakeQuantize the IR can describe")
    obs = fq.observer
    kind = _KIND_OF.get(type(obs))
    if kind is None:
        raise NotImplementedError(f"{where}: observer {type(obs).__name__} has no IR observer kind")
    if kind == "fixed_scale":
        # FakeQuantize(scale=...) builds the observer with default options: the scale is all there is
        options: dict[str, Any] = {"scale": float(obs.scale.reshape(-1)[0])}
    else:
        names = OBSERVER_KINDS[kind][1] + _COMMON
        options = {k: getattr(obs, k) for k in names}
    state = fq.state.value if isinstance(fq.state, FakeQuantState) else None
    return FakeQuantSpec(
        observer=ObserverSpec(kind, obs.dtype, obs.ch_axis, options),
        calibration=type(fq) is CalibFakeQuantize,
        observe=bool(fq.observer_enabled),
        fake_quant=bool(fq.fake_quant_enabled),
        state=state,
    )


# one factory per distinct spec: ``with_args`` validates its arguments by building an observer, and
# a model's layers share a few specs (prepare's insert-observers builds every layer's from one)
@functools.lru_cache(maxsize=256)
def fake_quant_factory(spec: FakeQuantSpec) -> Any:
    """The fake-quant factory (a qconfig's ``activation`` / ``weight``) ``spec`` describes."""
    cls = CalibFakeQuantize if spec.calibration else FakeQuantize
    obs = spec.observer
    opts = dict(obs.options)
    if obs.observer == "fixed_scale":
        return cls.with_args(dtype=obs.dtype.name, scale=float(opts["scale"]))
    observer_cls = OBSERVER_KINDS[obs.observer][0]
    if obs.axis is not None:
        opts["ch_axis"] = obs.axis
    return cls.with_args(observer=observer_cls, dtype=obs.dtype.name, **opts)


def build_fake_quant(spec: FakeQuantSpec, tensors: dict[str, torch.Tensor], prefix: str) -> FakeQuantize:
    """A fake quant as ``spec`` describes it, holding ``tensors[prefix + '.' + role]`` (shared, not copied)."""
    if spec.observer.observer not in OBSERVER_KINDS:
        raise ValueError(
            f"{prefix}: unknown observer kind {spec.observer.observer!r}; the kinds are {', '.join(OBSERVER_KINDS)}"
        )
    return bind_fake_quant(fake_quant_factory(spec)(), spec, tensors, prefix)


def bind_fake_quant(
    fq: FakeQuantize, spec: FakeQuantSpec, tensors: dict[str, torch.Tensor], prefix: str
) -> FakeQuantize:
    """``fq`` (built from ``spec``'s factory) holding ``tensors[prefix + '.' + role]`` as its state, with
    ``spec``'s switches: a fake quant built once per spec takes each layer's state so (conversion)."""
    for role in spec.roles():
        owner: nn.Module = fq
        leaf = role
        if role.startswith("observer."):
            owner, leaf = fq.observer, role.partition(".")[2]
        owner._buffers[leaf] = tensors[f"{prefix}.{role}"]
    fq.observer_enabled = spec.observe
    fq.fake_quant_enabled = spec.fake_quant
    fq.state = None if spec.state is None else FakeQuantState(spec.state)
    return fq
