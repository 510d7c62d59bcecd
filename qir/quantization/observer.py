"""Observers: modules that watch float tensors and keep the symmetric scale for them.

Every observer is an ``nn.Module`` with float32 buffers ``min_val``, ``max_val`` and
``scale`` (so a state dict carries calibrated scales), returns its input unchanged, and
exposes :meth:`ObserverBase.calculate_qparams`. The scale rule is docs/semantics.md's:
``scale = max(amax / ((qmax - qmin) / 2), eps)`` with zero point 0.

The hot path (``forward``) is tensor ops only, no host syncs, except
:class:`PercentileObserver`, a calibration-time observer that reads its histogram range
on the host once per batch, and the min-max observers on the CPU, which read two numbers per
batch to take a shorter update (``ObserverBase._fast_update``; there is no device to wait for).
Under ``torch.distributed`` every observer reduces its batch statistics across ranks (MIN/MAX,
histogram SUM) so all ranks keep identical scales; each rank must then run the same observers
in the same order, as DDP training does.

A batch holding NaN or Inf never changes an observer's range (``nonfinite=``, see
:class:`ObserverBase`): it is skipped and counted in ``nonfinite_batches``, or raises.
"""

from __future__ import annotations

import inspect
import math
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from backends.common.numerics import MIN_SCALE, DTypeLike, observable_qdtype, scale_denominator
from qir.ir.types import DType

__all__ = [
    "NONFINITE_MODES",
    "FixedScaleObserver",
    "HistogramObserver",
    "MinMaxObserver",
    "ModuleFactory",
    "MovingAverageMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "MovingAveragePerTensorMinMaxObserver",
    "ObserverBase",
    "PercentileObserver",
    "nonfinite_report",
    "warn_nonfinite",
]

M = TypeVar("M", bound=nn.Module)


class ModuleFactory(Generic[M]):
    """A partial of a module class: ``Cls.with_args(a=1)`` then ``factory()`` builds ``Cls(a=1)``.

    ``with_args`` on a factory returns a new factory with the keyword arguments merged
    (later ones win), so ``FakeQuantize.with_args(dtype="qint16").with_args(ch_axis=0)``
    works. Factories are immutable, picklable (for module-level classes), compare and hash
    by value, and expose ``func`` / ``keywords`` like :func:`functools.partial`.
    """

    __slots__ = ("func", "keywords")

    def __init__(self, func: Callable[..., M], **keywords: Any) -> None:
        check = getattr(func, "check_args", None)
        if callable(check):
            check(keywords)
        self.func = func
        self.keywords: Mapping[str, Any] = dict(keywords)

    def __call__(self, **overrides: Any) -> M:
        return self.func(**{**self.keywords, **overrides})

    def with_args(self, **keywords: Any) -> ModuleFactory[M]:
        return ModuleFactory(self.func, **{**self.keywords, **keywords})

    def __eq__(self, other: object) -> bool:
        # Equal factories build equal modules: prepare can compare qconfigs by value.
        if not isinstance(other, ModuleFactory):
            return NotImplemented
        return self.func == other.func and dict(self.keywords) == dict(other.keywords)

    def __hash__(self) -> int:
        try:
            return hash((self.func, frozenset(self.keywords.items())))
        except TypeError:  # an unhashable keyword value: equal factories still hash equal
            return hash((self.func, frozenset(self.keywords)))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_factory, (self.func, dict(self.keywords)))

    def __repr__(self) -> str:
        name = getattr(self.func, "__qualname__", repr(self.func))
        args = ", ".join(f"{k}={_short_repr(v)}" for k, v in self.keywords.items())
        return f"{name}.with_args({args})"


def _rebuild_factory(func: Callable[..., Any], keywords: dict[str, Any]) -> ModuleFactory[Any]:
    return ModuleFactory(func, **keywords)


def _short_repr(v: Any) -> str:
    return getattr(v, "__qualname__", None) or repr(v)


def check_init_kwargs(cls: type, keywords: Mapping[str, Any]) -> None:
    """Raise a TypeError naming the keywords ``cls(...)`` does not accept, and the valid ones."""
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(keywords) - set(params) - {"self"})
    if unknown:
        valid = ", ".join(p for p in params if p != "self")
        raise TypeError(f"{cls.__name__} got unknown argument(s) {', '.join(unknown)}; valid: {valid}")


def keep_buffer_dtypes(module: nn.Module, dtypes: Mapping[str, torch.dtype]) -> None:
    """Undo ``.half()`` / ``.double()`` on quantization state: scales are float32 by definition."""
    for name, dt in dtypes.items():
        buf = module._buffers.get(name)
        if buf is not None and buf.dtype != dt:
            module._buffers[name] = buf.to(dt)


#: Every observer class's own statistics buffers (see ``ObserverBase._statistics``), by name.
_ALL_STATISTICS: set[str] = set()


#: What an observer does with a batch holding NaN or Inf (``nonfinite=``): see :class:`ObserverBase`.
NONFINITE_MODES = ("skip", "raise")


def _check_nonfinite(mode: str) -> str:
    if mode not in NONFINITE_MODES:
        raise ValueError(
            f"nonfinite={mode!r} is not a mode; valid: 'skip' (leave the range unchanged, count the batch, "
            "warn once) or 'raise' (a ValueError at the batch)"
        )
    return mode


#: per thread: two (1,) float32 tensors holding a batch's extremes (ObserverBase.observe_extremes)
_SCRATCH = threading.local()


def _ddp_world() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class ObserverBase(nn.Module):
    """Shared state and rules: dtype, eps, buffers, DDP reduction, lazily sized per-channel buffers.

    Per-tensor buffers have shape ``(1,)``; per-channel ones ``(C,)``, sized on the first
    batch (they start empty) and resized when a state dict with a different size loads.
    An observer that has seen nothing has ``min_val > max_val`` (``+inf``/``-inf``) and
    ``scale == 1``.

    ``nonfinite``: what a batch holding NaN or Inf does. Its min and max would be NaN or
    infinite and stay in a running range for good (a moving average never forgets a NaN),
    so such a batch never updates the statistics. ``"skip"`` (the default) leaves the
    range as it was, adds one to ``nonfinite_batches`` (a non-persistent int64 buffer:
    checkpoints keep their keys) and warns once per observer; ``"raise"`` raises a
    ``ValueError`` at the batch. Skip is the default because one bad batch (an augmentation
    dividing by zero, an Inf in a label-free image) should not end a long calibration or
    QAT run, while the count keeps it visible (:func:`nonfinite_report`,
    ``check_qconfig``). The test costs no extra pass over the data: min and max propagate
    NaN and Inf. Under DDP a rank's non-finite batch is left out of the cross-rank reduction,
    so every rank still keeps the same range. The warning needs a host read of a flag: the
    histogram observers (which read the host per batch anyway) and "raise" mode read it at
    the batch; the min-max observers only count on the device, so QAT steps never sync, and
    their warning comes from :func:`warn_nonfinite` (which ``set_fake_quantize`` calls).
    """

    min_val: torch.Tensor
    max_val: torch.Tensor
    scale: torch.Tensor
    nonfinite_batches: torch.Tensor
    #: Buffers whose length follows the channel count.
    _sized_buffers: ClassVar[tuple[str, ...]] = ("min_val", "max_val", "scale")
    #: Buffers this observer keeps besides min/max/scale (a histogram...). Every class's are
    #: collected, so a checkpoint written by another observer kind loads strictly (below).
    _statistics: ClassVar[tuple[str, ...]] = ()
    #: Buffer dtypes that survive ``module.half()`` and friends.
    _buffer_dtypes: ClassVar[dict[str, torch.dtype]] = {
        "min_val": torch.float32,
        "max_val": torch.float32,
        "scale": torch.float32,
        "histogram": torch.float64,
        "hist_range": torch.float32,
        "nonfinite_batches": torch.int64,
    }

    def __init__(
        self,
        dtype: DTypeLike = "qint8",
        ch_axis: int | None = None,
        eps: float = MIN_SCALE,
        sync_ranks: bool = True,
        nonfinite: str = "skip",
    ) -> None:
        super().__init__()
        self.nonfinite = _check_nonfinite(nonfinite)
        self._warned_nonfinite = False
        #: whether the last batch was finite on this rank, when read on the host (None: not read)
        self._local_finite: bool | None = None
        self.dtype: DType = observable_qdtype(dtype)
        self.qmin, self.qmax = self.dtype.qrange
        if not (eps > 0.0 and math.isfinite(eps)):
            raise ValueError(f"eps must be positive and finite, got {eps}")
        self.eps = float(eps)
        self.ch_axis = ch_axis
        self.sync_ranks = sync_ranks
        n = 0 if ch_axis is not None else 1
        self.register_buffer("min_val", torch.full((n,), math.inf))
        self.register_buffer("max_val", torch.full((n,), -math.inf))
        self.register_buffer("scale", torch.ones(n))
        self.register_buffer("nonfinite_batches", torch.zeros((), dtype=torch.int64), persistent=False)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _ALL_STATISTICS.update(cls._statistics)

    @classmethod
    def with_args(cls: type[M], **kwargs: Any) -> ModuleFactory[M]:
        """A factory building this observer with ``kwargs`` (see :class:`ModuleFactory`)."""
        return ModuleFactory(cls, **kwargs)

    @classmethod
    def check_args(cls, keywords: Mapping[str, Any]) -> None:
        """Reject keyword arguments the constructor does not take, naming the valid ones."""
        check_init_kwargs(cls, keywords)

    @property
    def is_per_channel(self) -> bool:
        return self.ch_axis is not None

    # -- statistics -----------------------------------------------------------------------

    def _batch_min_max(self, x: torch.Tensor, host_check: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """This batch's min and max (per tensor: shape (1,); per channel: (C,)), reduced over ranks.

        A batch holding NaN or Inf counts as empty (``+inf``, ``-inf``), which every combine
        rule ignores (see ``nonfinite``). ``host_check``: read the finiteness flag on the host
        whatever the device (the caller syncs anyway).
        """
        x = x.detach()
        if x.numel() == 0:
            # Still take part in the collective (e.g. a rank with no RoIs this step): an empty
            # batch is (+inf, -inf), which every combine rule ignores.
            if self.ch_axis is not None and x.dim() == 0:
                raise ValueError(f"{type(self).__name__} with ch_axis={self.ch_axis} needs a tensor with dimensions")
            n = 1 if self.ch_axis is None else x.shape[self.ch_axis % x.dim()]
            lo = torch.full((n,), math.inf, device=x.device)
            hi = torch.full((n,), -math.inf, device=x.device)
        elif self.ch_axis is None:
            lo, hi = torch.aminmax(x)
            lo, hi = lo.reshape(1), hi.reshape(1)
        else:
            if x.dim() == 0:
                raise ValueError(f"{type(self).__name__} with ch_axis={self.ch_axis} needs a tensor with dimensions")
            ax = self.ch_axis % x.dim()
            dims = [d for d in range(x.dim()) if d != ax]
            if dims:
                lo, hi = torch.amin(x, dim=dims), torch.amax(x, dim=dims)
            else:
                lo, hi = x.clone(), x.clone()
        lo, hi = lo.to(torch.float32), hi.to(torch.float32)
        if x.numel() != 0:
            lo, hi = self._drop_nonfinite(x, lo, hi, host_check)
        if self.sync_ranks and _ddp_world():
            # One collective: MAX of (-min, max) gives MIN of min and MAX of max.
            both = torch.cat([-lo, hi])
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            lo, hi = -both[: lo.numel()], both[lo.numel() :]
        return lo, hi

    def _drop_nonfinite(
        self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, host_check: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)``, or an empty range when the batch holds NaN or Inf (counted; raised in "raise" mode)."""
        # min / max propagate NaN and are infinite exactly when the batch holds an Inf, so the
        # batch's own reductions tell, with no further pass over x.
        finite = torch.isfinite(lo).all() & torch.isfinite(hi).all()
        self.nonfinite_batches.add_((~finite).to(torch.int64))
        self._local_finite = None
        if self.nonfinite == "raise" or host_check:
            self._local_finite = bool(finite)
            if not self._local_finite:
                self._on_nonfinite(x)
        return torch.where(finite, lo, math.inf), torch.where(finite, hi, -math.inf)

    def _on_nonfinite(self, x: torch.Tensor) -> None:
        nan = int(torch.isnan(x).sum())
        inf = int(torch.isinf(x).sum())
        what = f"a batch of shape {tuple(x.shape)} with {nan} NaN and {inf} Inf value(s)"
        if self.nonfinite == "raise":
            raise ValueError(
                f"{type(self).__name__} ({self.dtype.name}) saw {what} (nonfinite='raise'): clean the data, "
                "or pass nonfinite='skip' to leave the range unchanged and count such batches"
            )
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(
                f"{type(self).__name__} ({self.dtype.name}) skipped {what}: its range is unchanged; "
                "later ones are counted silently in nonfinite_batches (qir.quantization.nonfinite_report lists "
                "them; nonfinite='raise' stops at the first)",
                RuntimeWarning,
                stacklevel=4,
            )

    def _ensure_size(self, n: int) -> None:
        cur = self.min_val.numel()
        if cur == n:
            return
        if cur != 0:
            raise ValueError(
                f"{type(self).__name__} tracked {cur} channels along axis {self.ch_axis} but got {n}; "
                "use one observer per tensor, or reset it with a fresh module"
            )
        dev = self.min_val.device
        self.min_val = torch.full((n,), math.inf, device=dev)
        self.max_val = torch.full((n,), -math.inf, device=dev)
        self.scale = torch.ones(n, device=dev)

    def _scale_from(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        amax = torch.maximum(-lo, hi).clamp_min(0.0)
        return (amax / scale_denominator(self.dtype)).clamp_min(self.eps)

    def _update_scale(self) -> None:
        seen = self.min_val <= self.max_val
        self.scale.copy_(torch.where(seen, self._scale_from(self.min_val, self.max_val), self.scale))

    # -- public ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fast_update(x):
            return x
        lo, hi = self._batch_min_max(x)
        if lo.numel() == 0:  # per-channel with zero channels: nothing to track
            return x
        self._ensure_size(lo.numel())
        self._combine(lo, hi)
        self._update_scale()
        return x

    def _combine(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define how batch statistics combine")

    def _combine_settled(self, lo: torch.Tensor, hi: torch.Tensor) -> bool:
        """:meth:`_combine` of a finite batch into a finite range every channel of which has seen data,
        in fewer operations (the where()s for first and empty batches select nothing then); False
        when this observer has no such form (nothing changed)."""
        return False

    def _fast_update(self, x: torch.Tensor) -> bool:
        """:meth:`forward`'s update in a third of its tensor operations, for the common case: a float32
        CPU batch with data, all finite, into a finite range that has seen data on every channel, no
        cross-rank reduction. Then the non-finite bookkeeping adds 0 and the first-batch and
        empty-batch branches select nothing, so the result is the general path's bit for bit (tested);
        the checks read two numbers on the host (cheap on the CPU, hence CPU only). False (nothing
        changed) otherwise: the general path runs."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0 or self.nonfinite != "skip":
            return False
        n = self.min_val.numel()
        if n == 0 or (self.sync_ranks and _ddp_world()):
            return False
        x = x.detach()
        if self.ch_axis is None:
            if n != 1:
                return False
            lo, hi = torch.aminmax(x)
        else:
            if x.dim() < 2 or x.shape[self.ch_axis % x.dim()] != n:
                return False
            ax = self.ch_axis % x.dim()
            dims = [d for d in range(x.dim()) if d != ax]
            lo, hi = torch.amin(x, dim=dims), torch.amax(x, dim=dims)
        # read on the host through numpy views (no tensor operations): the batch's extremes and the
        # range finite, and max >= min on every channel (the range has seen data everywhere)
        b_lo, b_hi = lo.numpy(), hi.numpy()
        o_lo, o_hi = self.min_val.numpy(), self.max_val.numpy()
        if not (np.isfinite(b_lo).all() and np.isfinite(b_hi).all() and np.isfinite(o_lo).all()):
            return False
        if not (np.isfinite(o_hi).all() and (o_hi >= o_lo).all()):
            return False
        if not self._combine_settled(lo, hi):
            return False
        # every channel has seen data: _update_scale's where() selects the new scale everywhere
        self._scale_on_host()
        return True

    def observe_extremes(self, lo: float, hi: float) -> bool:
        """:meth:`forward` of a float32 batch whose minimum is ``lo`` and maximum ``hi`` (float32 values), in
        the fast update's case only (per tensor, on the CPU, ``lo <= hi`` finite, into a finite range that has
        seen data, no cross-rank reduction): the same buffers bit for bit, without a tensor of the two values
        or a reduction over it. False (nothing changed) otherwise: the caller runs :meth:`forward` on them."""
        if self.ch_axis is not None or self.nonfinite != "skip" or self.min_val.numel() != 1:
            return False
        if self.min_val.device.type != "cpu" or (self.sync_ranks and _ddp_world()):
            return False
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            return False
        o_lo, o_hi = float(self.min_val.numpy()[0]), float(self.max_val.numpy()[0])
        if not (math.isfinite(o_lo) and math.isfinite(o_hi) and o_hi >= o_lo):
            return False
        # the batch's extremes as the (1,) tensors aminmax gives, in this thread's scratch written through numpy
        pair = getattr(_SCRATCH, "pair", None)
        if pair is None:
            pair = _SCRATCH.pair = (torch.empty(1), torch.empty(1))
        pair[0].numpy()[0], pair[1].numpy()[0] = lo, hi
        if not self._combine_settled(*pair):
            return False
        self._scale_on_host()
        return True

    def _scale_on_host(self) -> None:
        """:meth:`_scale_from` of a range that has seen data on every channel, in numpy float32: the same IEEE
        negation, maximum, division and clamps (``clamp_min`` compares with the bound cast to float32; the
        result is at least ``eps``, so the sign a maximum of two zeros picks cannot show)."""
        lo, hi = self.min_val.numpy(), self.max_val.numpy()
        amax = np.maximum(np.maximum(-lo, hi), np.float32(0.0))
        s = np.maximum(amax / np.float32(scale_denominator(self.dtype)), np.float32(self.eps))
        if s.size == 1:
            self.scale.fill_(float(s[0]))
        else:
            self.scale.copy_(torch.from_numpy(s))

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero_point)``: float32 and int32 tensors, shape (1,) or (C,); zero point is 0."""
        if self.scale.numel() == 0:
            raise RuntimeError(
                f"{type(self).__name__} has not observed any data: run calibration batches or load a state dict"
            )
        scale = self.scale.detach().clone()
        return scale, torch.zeros(scale.shape, dtype=torch.int32, device=scale.device)

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
        # Per-channel buffers are sized lazily; take the checkpoint's size before copying.
        for name in self._sized_buffers:
            key = prefix + name
            cur = getattr(self, name)
            if key in state_dict and isinstance(cur, torch.Tensor) and state_dict[key].shape != cur.shape:
                if self.ch_axis is not None:
                    setattr(self, name, torch.empty_like(state_dict[key], device=cur.device, dtype=cur.dtype))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # A checkpoint of another observer kind (calibration's percentile histogram loaded into a
        # QAT moving average: the toolkit's calibration -> QAT flow) carries statistics this
        # observer does not keep. They are not unexpected: min/max/scale are common to all
        # observers and loaded above. Its scale did not come from min/max (a percentile), so
        # the range restarts from the scale, as prepare's calibration carry-over does.
        foreign = [prefix + k for k in sorted(_ALL_STATISTICS - set(self._buffers)) if prefix + k in state_dict]
        if foreign:
            for k in foreign:
                if k in unexpected_keys:
                    unexpected_keys.remove(k)
            self._range_from_scale()

    @torch.no_grad()
    def _range_from_scale(self) -> None:
        """``min_val``/``max_val`` := ``-/+ scale * (qmax - qmin) / 2`` where this observer has seen data."""
        seen = self.min_val <= self.max_val
        amax = self.scale * scale_denominator(self.dtype)
        self.min_val.copy_(torch.where(seen, -amax, self.min_val))
        self.max_val.copy_(torch.where(seen, amax, self.max_val))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ObserverBase:
        super()._apply(fn, recurse)
        keep_buffer_dtypes(self, self._buffer_dtypes)
        return self

    def extra_repr(self) -> str:
        axis = f", ch_axis={self.ch_axis}" if self.ch_axis is not None else ""
        mode = f", nonfinite={self.nonfinite!r}" if self.nonfinite != "skip" else ""
        return f"dtype={self.dtype.name}{axis}{mode}"


def _check_averaging_constant(c: float) -> float:
    if not 0.0 <= c <= 1.0:
        raise ValueError(
            f"averaging_constant must be in [0, 1] (1: use the current batch only, 0: keep the first), got {c}"
        )
    return float(c)


class _MovingAverage(ObserverBase):
    def __init__(
        self,
        averaging_constant: float = 0.01,
        dtype: DTypeLike = "qint8",
        ch_axis: int | None = None,
        eps: float = MIN_SCALE,
        sync_ranks: bool = True,
        nonfinite: str = "skip",
    ) -> None:
        super().__init__(dtype=dtype, ch_axis=ch_axis, eps=eps, sync_ranks=sync_ranks, nonfinite=nonfinite)
        self.averaging_constant = _check_averaging_constant(averaging_constant)

    def _combine(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        c = self.averaging_constant
        first = self.min_val > self.max_val
        empty = lo > hi  # no data anywhere this step: keep the old range
        # lerp is exact at both ends (c=0 keeps old, c=1 takes the batch); where() takes the
        # batch on the first step, whose other branch may hold inf - inf.
        self.min_val.copy_(torch.where(empty, self.min_val, torch.where(first, lo, torch.lerp(self.min_val, lo, c))))
        self.max_val.copy_(torch.where(empty, self.max_val, torch.where(first, hi, torch.lerp(self.max_val, hi, c))))

    def _combine_settled(self, lo: torch.Tensor, hi: torch.Tensor) -> bool:
        # lerp in place: the same kernel as torch.lerp (signed zeros included)
        shape = self.min_val.shape
        self.min_val.lerp_(lo if lo.shape == shape else lo.reshape(shape), self.averaging_constant)
        self.max_val.lerp_(hi if hi.shape == shape else hi.reshape(shape), self.averaging_constant)
        return True

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, averaging_constant={self.averaging_constant}"


class MovingAveragePerTensorMinMaxObserver(_MovingAverage):
    """Exponential moving average of the per-tensor min and max.

    ``new = old + averaging_constant * (batch - old)``; the first batch is taken as is.
    ``averaging_constant=1`` uses the current batch only, ``0`` keeps the first batch's.
    ``ch_axis`` is accepted (the seeds pass it) and ignored: this observer is per tensor.
    """

    def __init__(
        self,
        averaging_constant: float = 0.01,
        dtype: DTypeLike = "qint8",
        ch_axis: int | None = None,
        eps: float = MIN_SCALE,
        sync_ranks: bool = True,
        nonfinite: str = "skip",
    ) -> None:
        del ch_axis  # per tensor by construction
        super().__init__(
            averaging_constant, dtype=dtype, ch_axis=None, eps=eps, sync_ranks=sync_ranks, nonfinite=nonfinite
        )


class MovingAveragePerChannelMinMaxObserver(_MovingAverage):
    """Moving average of min and max per slice along ``ch_axis`` (weights: axis 0)."""

    def __init__(
        self,
        averaging_constant: float = 0.01,
        dtype: DTypeLike = "qint8",
        ch_axis: int = 0,
        eps: float = MIN_SCALE,
        sync_ranks: bool = True,
        nonfinite: str = "skip",
    ) -> None:
        if ch_axis is None:
            raise ValueError("MovingAveragePerChannelMinMaxObserver needs an integer ch_axis (weights use 0)")
        super().__init__(
            averaging_constant, dtype=dtype, ch_axis=ch_axis, eps=eps, sync_ranks=sync_ranks, nonfinite=nonfinite
        )


class MinMaxObserver(ObserverBase):
    """Running min and max over every batch seen; per tensor (``ch_axis=None``) or per channel."""

    def __init__(
        self,
        dtype: DTypeLike = "qint8",
        ch_axis: int | None = None,
        eps: float = MIN_SCALE,
        sync_ranks: bool = True,
        nonfinite: str = "skip",
    ) -> None:
        super().__init__(dtype=dtype, ch_axis=ch_axis, eps=eps, sync_ranks=sync_ranks, nonfinite=nonfinite)

    def _combine(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        self.min_val.copy_(torch.minimum(self.min_val, lo))
        self.max_val.copy_(torch.maximum(self.max_val, hi))

    def _combine_settled(self, lo: torch.Tensor, hi: torch.Tensor) -> bool:
        torch.minimum(self.min_val, lo, out=self.min_val)
        torch.maximum(self.max_val, hi, out=self.max_val)
        return True


class HistogramObserver(ObserverBase):
    """Base of the calibration observers that pick amax from a histogram of ``|x|``.

    Keeps a ``bins``-bin histogram of ``|x|`` over ``[0, hist_range]``. When a batch
    exceeds the range, the range doubles (adjacent bins merge, exact) as often as needed,
    so no sample is ever re-binned approximately. A subclass says how the histogram gives
    amax (:meth:`_amax_from_histogram`); the result is capped at the true running amax.
    Per tensor only (``ch_axis`` is ignored). One host read per batch (the histogram
    range): fine for calibration, not meant for QAT.
    """

    histogram: torch.Tensor
    hist_range: torch.Tensor
    _statistics: ClassVar[tuple[str, ...]] = ("histogram", "hist_range")

    def __init__(
        self,
        bins: int = 2048,
        dtype: DTypeLike = "qint8",
        ch_axis: int | None = None,
        eps: float = MIN_SCALE,
        sync_ranks: bool = True,
        nonfinite: str = "skip",
    ) -> None:
        del ch_axis
        super().__init__(dtype=dtype, ch_axis=None, eps=eps, sync_ranks=sync_ranks, nonfinite=nonfinite)
        if bins < 2 or bins % 2:
            raise ValueError(f"bins must be an even number >= 2 (the range grows by merging pairs), got {bins}")
        self.bins = int(bins)
        self.register_buffer("histogram", torch.zeros(self.bins, dtype=torch.float64))
        self.register_buffer("hist_range", torch.zeros(1))

    def _combine(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        self.min_val.copy_(torch.minimum(self.min_val, lo))
        self.max_val.copy_(torch.maximum(self.max_val, hi))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = self._batch_min_max(x, host_check=True)  # reduced across ranks: identical ranges everywhere
        if bool(lo > hi):  # empty (or non-finite) on every rank
            return x
        self._combine(lo, hi)
        batch_amax = float(torch.maximum(-lo, hi).clamp_min(0.0))
        rng = float(self.hist_range)
        if rng <= 0.0:
            rng = max(batch_amax, self.eps)
        while batch_amax > rng:
            merged = self.histogram.view(-1, 2).sum(1)
            self.histogram.copy_(torch.cat([merged, torch.zeros_like(merged)]))
            rng *= 2.0
        self.hist_range.fill_(rng)
        if self._local_finite is False:  # this rank's batch was skipped; the others' still count
            h = torch.zeros_like(self.histogram)
        else:
            h = torch.histc(x.detach().abs().to(torch.float32), bins=self.bins, min=0.0, max=rng).to(torch.float64)
        if self.sync_ranks and _ddp_world():
            dist.all_reduce(h, op=dist.ReduceOp.SUM)
        self.histogram.add_(h)
        self._update_scale()
        return x

    def bin_centers(self) -> torch.Tensor:
        """Float64 centres of the histogram's bins."""
        width = float(self.hist_range) / self.bins
        return (torch.arange(self.bins, dtype=torch.float64, device=self.histogram.device) + 0.5) * width

    def _amax_from_histogram(self) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must say how its histogram gives amax")

    def _update_scale(self) -> None:
        if float(self.histogram.sum()) == 0.0:
            return
        true_amax = torch.maximum(-self.min_val, self.max_val)
        amax = torch.minimum(self._amax_from_histogram().to(torch.float32).reshape(1), true_amax)
        self.scale.copy_((amax / scale_denominator(self.dtype)).clamp_min(self.eps))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bins={self.bins}"


def percentile_amax(histogram: torch.Tensor, hist_range: torch.Tensor, percentile: float) -> torch.Tensor:
    """Upper edge of the first bin whose cumulative count reaches ``percentile``% of the total."""
    cdf = torch.cumsum(histogram, 0)
    target = cdf[-1] * (percentile / 100.0)
    idx = torch.searchsorted(cdf, target.reshape(1)).clamp(max=histogram.numel() - 1)
    return (idx.to(torch.float32) + 1.0) * (hist_range / histogram.numel())


class PercentileObserver(HistogramObserver):
    """Calibration observer: amax is the ``percentile`` of ``|x|`` over every batch seen.

    The percentile's bin upper edge in the :class:`HistogramObserver` histogram, capped at
    the true running amax, gives amax.
    """

    def __init__(
        self,
        percentile: float = 99.99,
        bins: int = 2048,
        dtype: DTypeLike = "qint8",
        ch_axis: int | None = None,
        eps: float = MIN_SCALE,
        sync_ranks: bool = True,
        nonfinite: str = "skip",
    ) -> None:
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        super().__init__(bins=bins, dtype=dtype, ch_axis=ch_axis, eps=eps, sync_ranks=sync_ranks, nonfinite=nonfinite)
        self.percentile = float(percentile)

    def _amax_from_histogram(self) -> torch.Tensor:
        return percentile_amax(self.histogram, self.hist_range, self.percentile)

    def extra_repr(self) -> str:
        return f"dtype={self.dtype.name}, percentile={self.percentile}, bins={self.bins}"


class FixedScaleObserver(ObserverBase):
    """A scale fixed at construction (``QuantStub(scale=1/128)``); observing changes nothing.

    ``min_val``/``max_val`` hold the representable range ``scale * qmin`` .. ``scale * qmax``.
    """

    def __init__(
        self,
        scale: float | torch.Tensor,
        dtype: DTypeLike = "qint8",
        ch_axis: int | None = None,
        eps: float = MIN_SCALE,
        sync_ranks: bool = True,
        nonfinite: str = "skip",
    ) -> None:
        del ch_axis
        super().__init__(dtype=dtype, ch_axis=None, eps=eps, sync_ranks=sync_ranks, nonfinite=nonfinite)
        value = float(scale.detach().reshape(-1)[0]) if isinstance(scale, torch.Tensor) else float(scale)
        if isinstance(scale, torch.Tensor) and scale.numel() != 1:
            raise ValueError(f"a fixed scale is per tensor: one value, got {scale.numel()}")
        if not (value > 0.0 and math.isfinite(value)):
            raise ValueError(f"fixed scale must be positive and finite, got {value}")
        self.scale.fill_(value)
        self.min_val.fill_(value * self.qmin)
        self.max_val.fill_(value * self.qmax)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={float(self.scale):.6g}"


#: The plugin's name for the per-tensor moving-average observer.
MovingAverageMinMaxObserver = MovingAveragePerTensorMinMaxObserver


def warn_nonfinite(model: nn.Module) -> None:
    """One warning naming the observers of ``model`` that skipped non-finite batches and have not said so.

    Each observer warns once in its life (here or at the batch); ``set_fake_quantize`` calls
    this, so switching a model to validation after calibration or QAT tells. One host read
    per observer.
    """
    quiet = {}
    for name, mod in model.named_modules():
        if isinstance(mod, ObserverBase) and not mod._warned_nonfinite:
            n = int(mod.nonfinite_batches)
            if n:
                mod._warned_nonfinite = True
                quiet[name or type(mod).__name__] = n
    if quiet:
        listed = ", ".join(f"{k} ({v})" for k, v in quiet.items())
        warnings.warn(
            f"{len(quiet)} observer(s) skipped batches holding NaN or Inf, their ranges unchanged: {listed}; "
            "qir.quantization.nonfinite_report lists them, nonfinite='raise' stops at the first",
            RuntimeWarning,
            stacklevel=3,
        )


def nonfinite_report(model: nn.Module) -> dict[str, int]:
    """Observers of ``model`` that skipped batches holding NaN or Inf: ``{module path: batches}``.

    Reads each observer's ``nonfinite_batches`` counter (one host read each); observers that
    skipped nothing are left out, so an empty dict means every batch seen was finite. The
    counters are not saved in state dicts: they describe this process's data.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"nonfinite_report needs an nn.Module, got {type(model).__name__}")
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, ObserverBase):
            n = int(mod.nonfinite_batches)
            if n:
                out[name] = n
    return out
