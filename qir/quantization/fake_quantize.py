"""Fake quantization: ``x -> saturate(floor(x / s + 0.5)) * s`` in float, with a straight-through gradient.

Rounding is half up, like the BPU's integer datapath, so a QAT model and its deployed
integer program round ties the same way (docs/semantics.md, "Fake quantization").
Forward is bit-identical to ``numerics.dequantize(numerics.quantize(x, s), s)`` for
float32 input. The scale lives in a tensor buffer and is never read on the host.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from backends.common.numerics import (
    DTypeLike,
    broadcast_along,
    observable_qdtype,
    round_half_up,
    scale_denominator,
)
from qir.quantization.blockwise import blocks, part
from qir.quantization.observer import (
    FixedScaleObserver,
    ModuleFactory,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
    ObserverBase,
    check_init_kwargs,
    keep_buffer_dtypes,
    warn_nonfinite,
)

__all__ = [
    "CalibFakeQuantize",
    "FakeQuantState",
    "FakeQuantize",
    "default_16bit_fake_quant",
    "default_8bit_fake_quant",
    "default_weight_8bit_fake_quant",
    "disable_fake_quant",
    "disable_observer",
    "enable_fake_quant",
    "enable_observer",
    "fake_quantize",
    "set_fake_quantize",
]

M = TypeVar("M", bound=nn.Module)


class _FakeQuantFn(torch.autograd.Function):
    """Fused fake quant; backward passes the gradient where ``floor(x/s + 0.5)`` is in range, else 0.

    Float32 and float64 inputs run block by block (:mod:`qir.quantization.blockwise`): only the
    result and the gradient mask are allocated at full size. The mask is a float tensor of 1s and
    0s in the input's dtype: multiplying by it is vectorized, masking by a bool tensor is not.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int, axis: int | None) -> torch.Tensor:
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        s = broadcast_along(scale.to(ct), axis, x.dim())
        if x.dtype != ct:  # float16 / bfloat16: computed in float32 at once
            q = round_half_up(x.to(ct) / s)
            qc = q.clamp(qmin, qmax)
            ctx.save_for_backward(torch.eq(qc, q).to(x.dtype))  # in range <=> clamping changed nothing
            return qc.mul_(s).to(x.dtype)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        keep = torch.empty_like(out)
        nd = x.dim()
        for idx in blocks(x.shape):
            v = torch.div(x[idx], part(s, idx, nd))
            f = torch.floor(v)
            f.add_(v.sub_(f).ge_(0.5))  # numerics.round_half_up, in place
            qc = f.clamp(qmin, qmax)
            torch.eq(qc, f, out=keep[idx])  # in range <=> clamping changed nothing
            torch.mul(qc, part(s, idx, nd), out=out[idx])
        ctx.save_for_backward(keep)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (keep,) = ctx.saved_tensors
        return grad * keep, None, None, None, None


def fake_quantize(
    x: torch.Tensor, scale: torch.Tensor, dtype: DTypeLike = "qint8", axis: int | None = None
) -> torch.Tensor:
    """Functional fake quant with the straight-through, clip-aware gradient (scale gets none)."""
    qmin, qmax = observable_qdtype(dtype).qrange
    out: torch.Tensor = _FakeQuantFn.apply(x, scale.detach(), qmin, qmax, axis)
    return out


def _check_plugin_range(dtype: str, quant_min: int | None, quant_max: int | None, saturate: bool | None) -> None:
    """The plugin's ``quant_min`` / ``quant_max`` / ``saturate`` arguments, accepted when they say
    what qir does anyway: the full range of ``dtype`` (``qinfo(dtype).min`` / ``.max``), saturating."""
    lo, hi = observable_qdtype(dtype).qrange
    for name, value, want in (("quant_min", quant_min, lo), ("quant_max", quant_max, hi)):
        if value is not None and int(value) != want:
            raise ValueError(
                f"FakeQuantize({name}={value}) with dtype={dtype}: qir quantizes to the full range of the dtype "
                f"[{lo}, {hi}]; pass {name}=qinfo({dtype!r}).{name[6:]} ({want}) or leave it out"
            )
    if saturate is not None and not saturate:
        raise ValueError("FakeQuantize(saturate=False) is not supported: qir's quantization always saturates")


class FakeQuantState(enum.Enum):
    """Whole-model modes for :func:`set_fake_quantize`."""

    QAT = "qat"  # observe and fake-quantize
    CALIBRATION = "calibration"  # observe only; the model computes in float
    VALIDATION = "validation"  # fake-quantize with frozen scales

    @classmethod
    def parse(cls, state: FakeQuantState | str) -> FakeQuantState:
        """Accept a member or its name/value in any case (``"qat"``, ``"VALIDATION"``)."""
        if isinstance(state, FakeQuantState):
            return state
        if isinstance(state, str):
            key = state.strip().lower()
            for s in cls:
                if key == s.value:
                    return s
        raise ValueError(f"unknown fake-quant state {state!r}; valid: {', '.join(s.name for s in cls)}")


#: attributes of a fake quant that decide whether its forward observes in QAT state
_SWITCHES = frozenset({"state", "observer_enabled", "fake_quant_enabled", "observer"})
#: how often any fake quant's switches were set in this process: what a per-model answer about its fake quants
#: is cached on (qir.quantization.eval_observers), so a forward need not walk the model to know it
_SWITCH_EPOCH = [0]


def switch_epoch() -> int:
    """The count of fake-quant switch settings so far (:data:`_SWITCHES`); it changes whenever one is set."""
    return _SWITCH_EPOCH[0]


class FakeQuantize(nn.Module):
    """Observer plus fake quant for one tensor.

    ``FakeQuantize(observer=Obs, dtype=..., ch_axis=..., **observer_kwargs)`` builds
    ``Obs(dtype=dtype, ch_axis=ch_axis, **observer_kwargs)`` (``ch_axis`` only when given).
    ``scale=`` fixes the scale instead (a :class:`FixedScaleObserver`; ``observer`` and its
    keyword arguments are then unused) — this is how ``QuantStub(scale=1/128)`` is built.

    Buffers: ``scale`` (float32, shape (1,) or (C,)) and ``zero_point`` (int32, zeros),
    refreshed from the observer after every observed batch. Switches: ``observer_enabled``
    and ``fake_quant_enabled`` (plain bools, so checking them never syncs a device).
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    #: "qat" or "calibration": what :func:`qir.quantization.qconfig.qconfig_kind` reports.
    kind: ClassVar[str] = "qat"
    _initial_state: ClassVar[FakeQuantState] = FakeQuantState.QAT

    def __init__(
        self,
        observer: Callable[..., ObserverBase] = MovingAveragePerTensorMinMaxObserver,
        dtype: DTypeLike = "qint8",
        ch_axis: int | None = None,
        scale: float | torch.Tensor | None = None,
        quant_min: int | None = None,
        quant_max: int | None = None,
        saturate: bool | None = None,
        **observer_kwargs: Any,
    ) -> None:
        super().__init__()
        qd = observable_qdtype(dtype)
        _check_plugin_range(qd.name, quant_min, quant_max, saturate)
        obs: ObserverBase
        if scale is not None:
            obs = FixedScaleObserver(scale=scale, dtype=qd)
        else:
            kwargs = dict(observer_kwargs)
            if ch_axis is not None:
                kwargs["ch_axis"] = ch_axis
            obs = observer(dtype=qd, **kwargs)
            if not isinstance(obs, ObserverBase):
                raise TypeError(
                    f"FakeQuantize observer must build a qir observer (ObserverBase), got {type(obs).__name__}; "
                    "use one from qir.quantization.observer"
                )
        self.observer = obs
        self.dtype = obs.dtype
        self.qmin, self.qmax = obs.qmin, obs.qmax
        self.ch_axis: int | None = obs.ch_axis
        self.register_buffer("scale", obs.scale.detach().clone())
        self.register_buffer("zero_point", torch.zeros(obs.scale.shape, dtype=torch.int32))
        self.observer_enabled = True
        self.fake_quant_enabled = True
        #: the state :meth:`set_state` last set (None: never set); VALIDATION makes a
        #: prepare_qat_fx model run its integer twin (qir.quantization.exact_validation)
        self.state: FakeQuantState | None = None
        self.set_state(self._initial_state)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SWITCHES:
            _SWITCH_EPOCH[0] += 1  # set directly too (debug taps, sensitivity), not only by set_state
        super().__setattr__(name, value)

    @classmethod
    def with_args(cls: type[M], **kwargs: Any) -> ModuleFactory[M]:
        """A factory for this class with ``kwargs`` bound; chain further ``.with_args(...)`` calls."""
        return ModuleFactory(cls, **kwargs)

    @classmethod
    def check_args(cls, keywords: Mapping[str, Any]) -> None:
        """Early check of ``with_args`` keywords: own parameters plus those of the chosen observer."""
        own = {"observer", "dtype", "ch_axis", "scale", "quant_min", "quant_max", "saturate"}
        observer = keywords.get("observer", MovingAveragePerTensorMinMaxObserver)
        if isinstance(observer, nn.Module):
            raise TypeError(
                "FakeQuantize observer must be an observer class or factory, not an instance; "
                "write observer=MovingAveragePerTensorMinMaxObserver and pass its arguments alongside"
            )
        if "dtype" in keywords:
            observable_qdtype(keywords["dtype"])
        _check_plugin_range(
            observable_qdtype(keywords.get("dtype", "qint8")).name,
            keywords.get("quant_min"),
            keywords.get("quant_max"),
            keywords.get("saturate"),
        )
        rest = {k: v for k, v in keywords.items() if k not in own}
        target = observer.func if isinstance(observer, ModuleFactory) else observer
        if isinstance(target, type) and "scale" not in keywords:
            check_init_kwargs(target, rest)

    @property
    def is_per_channel(self) -> bool:
        return self.ch_axis is not None

    # -- switches -------------------------------------------------------------------------

    def enable_observer(self, enabled: bool = True) -> FakeQuantize:
        self.observer_enabled = bool(enabled)
        return self

    def disable_observer(self) -> FakeQuantize:
        return self.enable_observer(False)

    def enable_fake_quant(self, enabled: bool = True) -> FakeQuantize:
        self.fake_quant_enabled = bool(enabled)
        return self

    def disable_fake_quant(self) -> FakeQuantize:
        return self.enable_fake_quant(False)

    def set_state(self, state: FakeQuantState | str) -> FakeQuantize:
        st = FakeQuantState.parse(state)
        self.state = st
        self.observer_enabled = st in (FakeQuantState.QAT, FakeQuantState.CALIBRATION)
        self.fake_quant_enabled = st in (FakeQuantState.QAT, FakeQuantState.VALIDATION)
        return self

    # -- compute --------------------------------------------------------------------------

    def _take_observer_scale(self) -> None:
        src = self.observer.scale
        if src.shape != self.scale.shape:  # per-channel buffers are sized on the first batch
            self._replace_scale(src.detach().clone())
        else:
            self.scale.copy_(src)

    def _replace_scale(self, scale: torch.Tensor) -> None:
        """Make ``scale`` (any shape) this fake quant's scale, with a matching zero point.

        Subclasses whose scale is a Parameter (:mod:`qir.quantization.lsq`) keep the Parameter
        object, so an optimizer holding it still trains it.
        """
        self.scale = scale
        self.zero_point = torch.zeros(scale.shape, dtype=torch.int32, device=scale.device)

    @torch.no_grad()
    def start_from_scale(self, scale: torch.Tensor, amax: torch.Tensor | None = None) -> FakeQuantize:
        """Take ``scale`` exactly and set the observer's range to ``±amax`` (default: the one the
        scale represents, ``scale * (qmax - qmin) / 2``), so a moving average continues from it; in place."""
        scale = scale.detach().to(torch.float32)
        amax = scale * scale_denominator(self.dtype) if amax is None else amax.detach()
        obs = self.observer
        obs.min_val = -amax.clone()
        obs.max_val = amax.clone()
        obs.scale = scale.clone()
        self._replace_scale(scale.clone())
        return self

    @property
    def has_fixed_scale(self) -> bool:
        """Built with ``scale=``: never observes, so edits to ``self.scale`` stick."""
        return isinstance(self.observer, FixedScaleObserver)

    def observe(self, x: torch.Tensor) -> None:
        """What :meth:`forward` does to this fake quant's state (observe ``x``, take the observer's
        scale), without fake-quantizing ``x``: the scale a forward of ``x`` would use, at the cost of
        the observer alone (conversion reads a weight's scale so)."""
        if self.observer_enabled and not self.has_fixed_scale:
            self.observer(x.detach())
            self._take_observer_scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and _TYPES_ONLY.get():
            return x  # same shape and dtype: all a typing run reads
        self.observe(x)
        if not self.fake_quant_enabled:
            return x
        if self.scale.numel() == 0:
            raise RuntimeError(
                "FakeQuantize has no per-channel scale yet: observe a batch first (enable the observer) "
                "or load a state dict that holds the scale"
            )
        return fake_quantize(x, self.scale, self.dtype, self.ch_axis)

    @torch.no_grad()
    def init_from(self, source: FakeQuantize) -> FakeQuantize:
        """Start from ``source``'s scale (e.g. calibration -> QAT); in place, returns self.

        Copies the scale exactly and sets the observer's range to the one that scale
        represents (``±scale * (qmax - qmin) / 2``), so a moving average continues from the
        calibrated range instead of restarting. A fixed-scale fake quant keeps its scale.
        """
        if not isinstance(source, FakeQuantize):
            raise TypeError(f"init_from needs a FakeQuantize, got {type(source).__name__}")
        if source.dtype is not self.dtype or source.ch_axis != self.ch_axis:
            raise ValueError(
                f"cannot start a {self.dtype.name} fake quant (ch_axis={self.ch_axis}) from a "
                f"{source.dtype.name} one (ch_axis={source.ch_axis}); dtype and ch_axis must match"
            )
        if self.has_fixed_scale:
            return self
        return self.start_from_scale(source.scale.detach().to(self.scale.device))

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The current ``(scale, zero_point)`` buffers (copies)."""
        return self.scale.detach().clone(), self.zero_point.detach().clone()

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        if self.ch_axis is not None:
            for name in ("scale", "zero_point"):
                key, cur = prefix + name, getattr(self, name)
                if key in state_dict and state_dict[key].shape != cur.shape:
                    setattr(self, name, torch.empty_like(state_dict[key], device=cur.device, dtype=cur.dtype))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FakeQuantize:
        super()._apply(fn, recurse)
        keep_buffer_dtypes(self, {"scale": torch.float32, "zero_point": torch.int32})
        return self

    def extra_repr(self) -> str:
        axis = f", ch_axis={self.ch_axis}" if self.ch_axis is not None else ""
        return (
            f"dtype={self.dtype.name}{axis}, observer_enabled={self.observer_enabled}, "
            f"fake_quant_enabled={self.fake_quant_enabled}"
        )


class CalibFakeQuantize(FakeQuantize):
    """A :class:`FakeQuantize` for calibration qconfigs: starts observe-only (float compute).

    Its ``kind`` is ``"calibration"`` so prepare can refuse to mix it with QAT qconfigs.
    Switch to ``VALIDATION`` to evaluate the calibrated scales.
    """

    kind: ClassVar[str] = "calibration"
    _initial_state: ClassVar[FakeQuantState] = FakeQuantState.CALIBRATION


# -- whole-model helpers (in place; return the model for chaining) -----------------------------

_N = TypeVar("_N", bound=nn.Module)


def _fake_quants(model: nn.Module) -> list[FakeQuantize]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    return [m for m in model.modules() if isinstance(m, FakeQuantize)]


def enable_observer(model: _N) -> _N:
    """Turn observing on in every :class:`FakeQuantize` of ``model`` (in place)."""
    for fq in _fake_quants(model):
        fq.enable_observer()
    return model


def disable_observer(model: _N) -> _N:
    """Freeze the scales of every :class:`FakeQuantize` in ``model`` (in place)."""
    for fq in _fake_quants(model):
        fq.disable_observer()
    return model


def enable_fake_quant(model: _N) -> _N:
    """Turn fake quantization on in every :class:`FakeQuantize` of ``model`` (in place)."""
    for fq in _fake_quants(model):
        fq.enable_fake_quant()
    return model


def disable_fake_quant(model: _N) -> _N:
    """Make every :class:`FakeQuantize` in ``model`` pass its input through (in place)."""
    for fq in _fake_quants(model):
        fq.disable_fake_quant()
    return model


_FLOAT_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("qir_float_fake_quant", default=False)


@contextlib.contextmanager
def float_fake_quant() -> Iterator[None]:
    """Within the block, prepared models in VALIDATION state run their float fake quantization
    instead of their integer twin (qir.quantization.exact_validation): for tools that hook or
    trace the QAT modules themselves (ONNX export, per-layer comparisons)."""
    token = _FLOAT_ONLY.set(True)
    try:
        yield
    finally:
        _FLOAT_ONLY.reset(token)


_TYPES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("qir_types_only_fake_quant", default=False)


@contextlib.contextmanager
def types_only_fake_quant() -> Iterator[None]:
    """Within the block, a :class:`FakeQuantize` returns a float32 input as it is and observes
    nothing: for runs that read only the shapes and dtypes of a QAT model's values (a fake quant
    keeps both), such as the trace ``convert_fx`` types the QAT model's IR with; the values are not
    the model's. Subclasses with their own ``forward`` (a learnable scale) run as usual."""
    token = _TYPES_ONLY.set(True)
    try:
        yield
    finally:
        _TYPES_ONLY.reset(token)


def float_fake_quant_active() -> bool:
    """Whether a :func:`float_fake_quant` block is active in this context."""
    return _FLOAT_ONLY.get()


def types_only_fake_quant_active() -> bool:
    """Whether a :func:`types_only_fake_quant` block is active in this context."""
    return _TYPES_ONLY.get()


def set_fake_quantize(model: _N, state: FakeQuantState | str) -> _N:
    """Put every :class:`FakeQuantize` of ``model`` in ``state`` (QAT, CALIBRATION, VALIDATION), in place.

    Also warns, once per observer, about observers that skipped batches holding NaN or Inf
    (:func:`~qir.quantization.observer.warn_nonfinite`).
    """
    st = FakeQuantState.parse(state)
    for fq in _fake_quants(model):
        fq.set_state(st)
    warn_nonfinite(model)
    return model


# -- the plugin's named fake-quant factories (``fake_quantize.default_8bit_fake_quant``) ------

#: Activations, qint8: per-tensor moving average (constant 0.01), as in the default QAT qconfig.
default_8bit_fake_quant = FakeQuantize.with_args(
    observer=MovingAveragePerTensorMinMaxObserver, dtype="qint8", averaging_constant=0.01
)
#: Activations, qint16.
default_16bit_fake_quant = FakeQuantize.with_args(
    observer=MovingAveragePerTensorMinMaxObserver, dtype="qint16", averaging_constant=0.01
)
#: Weights, qint8: per output channel (axis 0), the current values only.
default_weight_8bit_fake_quant = FakeQuantize.with_args(
    observer=MovingAveragePerChannelMinMaxObserver, dtype="qint8", ch_axis=0, averaging_constant=1.0
)


class _CallableModule(types.ModuleType):
    """This module, callable as :func:`fake_quantize`.

    Users reach into the module (``qir.quantization.fake_quantize.FakeQuantize``,
    ``fake_quantize.default_8bit_fake_quant``) as they do in the plugin, so the package
    attribute ``qir.quantization.fake_quantize`` must be the module, not the function of the
    same name; calling the module calls the function, so ``qir.quantization.fake_quantize(x,
    scale)`` keeps working too.
    """

    def __call__(
        self, x: torch.Tensor, scale: torch.Tensor, dtype: DTypeLike = "qint8", axis: int | None = None
    ) -> torch.Tensor:
        return fake_quantize(x, scale, dtype, axis)


sys.modules[__name__].__class__ = _CallableModule
