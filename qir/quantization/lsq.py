"""Learnable-scale fake quants for QAT: LSQ (learned step size) and PACT (learned clipping).

Both keep the scale as an ``nn.Parameter`` named ``scale``, so a calibration checkpoint, the
QAT model and what ``convert_fx`` reads share one state-dict key (``...scale``), and convert
deploys the learned value. The forward is :func:`~qir.quantization.fake_quantize.fake_quantize`'s
exactly (same half-up grid, same float operations), so VALIDATION and the converted model
agree bit for bit as for the plain fake quant; only the backward differs:

- input: straight through where ``floor(x / s + 1/2)`` is in range, 0 where it clips;
- LSQ (Esser et al., 2020): ``d out / d s = q - x / s`` in range, ``qmin`` / ``qmax`` where it
  clips, times ``g = 1 / sqrt(n * qmax)`` (``n``: elements per scale value in the batch),
  which keeps the scale's updates in proportion to the weights' updates;
- PACT (Choi et al., 2018), symmetric: the scale is the clipping level ``alpha / qmax``; only
  clipped elements pull it (``qmin`` / ``qmax``), values in range give it no gradient.

The scale starts from the observer: the first observed batch (or a calibrated model through
``prepare_qat_fx``, or a state dict) sets it, after which the observer no longer moves it in
QAT state; in CALIBRATION state it follows the observer as a plain fake quant does. Each QAT
forward and each state change clamps the scale to at least the observer's ``eps`` in place,
so the stored scale is the one the forward used and convert never reads a non-positive one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from backends.common.numerics import broadcast_along, round_half_up
from qir.quantization.fake_quantize import FakeQuantize, FakeQuantState

__all__ = ["LSQFakeQuantize", "PACTFakeQuantize"]


class _LearnableScaleFn(torch.autograd.Function):
    """Fake quant with gradients for both ``x`` and ``scale`` (``pact``: only clipped values pull the scale)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        scale: torch.Tensor,
        qmin: int,
        qmax: int,
        axis: int | None,
        grad_factor: float,
        pact: bool,
    ) -> torch.Tensor:
        # The same operations, in the same order, as fake_quantize's forward: identical bits.
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        s = broadcast_along(scale.detach().to(ct), axis, x.dim())
        v = x.detach().to(ct) / s
        q = round_half_up(v)
        qc = q.clamp(qmin, qmax)
        inside = qc == q
        if pact:
            ds = torch.where(inside, torch.zeros_like(qc), qc)
        else:
            ds = torch.where(inside, qc - v, qc)
        ctx.save_for_backward(inside, ds)
        ctx.axis, ctx.grad_factor, ctx.scale_shape, ctx.scale_dtype = axis, grad_factor, scale.shape, scale.dtype
        return (qc * s).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inside, ds = ctx.saved_tensors
        grad_x = grad * inside.to(grad.dtype)
        g = grad.to(ds.dtype) * ds
        if ctx.axis is None:
            grad_s = g.sum().reshape(ctx.scale_shape)
        else:
            ax = ctx.axis % g.dim()
            grad_s = g.sum(dim=[d for d in range(g.dim()) if d != ax]).reshape(ctx.scale_shape)
        grad_s = (grad_s * ctx.grad_factor).to(ctx.scale_dtype)
        return grad_x, grad_s, None, None, None, None, None


class LSQFakeQuantize(FakeQuantize):
    """A :class:`~qir.quantization.fake_quantize.FakeQuantize` whose scale is learned with the LSQ gradient.

    Same constructor as ``FakeQuantize`` (the observer initializes the scale). ``scale=``
    (a fixed scale, e.g. ``QuantStub(scale=1/128)``) stays fixed: nothing is learned.
    ``scale`` is an ``nn.Parameter`` (float32, shape (1,) or (C,)), so pass the model's
    parameters to the optimizer after the first batch or after ``prepare_qat_fx`` of a
    calibrated model; per-channel scales are sized in place, keeping the Parameter object.
    """

    kind: ClassVar[str] = "qat"
    #: PACT's rule: only clipped values give the scale a gradient
    _pact: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._initialized = False
        if not self.has_fixed_scale:
            scale = self._buffers.pop("scale")
            assert scale is not None
            self.scale = nn.Parameter(scale.detach().clone())

    # -- the scale --------------------------------------------------------------------------

    def _replace_scale(self, scale: torch.Tensor) -> None:
        if not isinstance(self.scale, nn.Parameter):
            super()._replace_scale(scale)
            return
        with torch.no_grad():
            self.scale.data = scale.detach().to(device=self.scale.device, dtype=torch.float32).clone()
        self.zero_point = torch.zeros(scale.shape, dtype=torch.int32, device=scale.device)
        self._initialized = True

    def _take_observer_scale(self) -> None:
        obs = self.observer
        with torch.no_grad():
            if obs.scale.shape != self.scale.shape:
                self._replace_scale(obs.scale)
            else:
                self.scale.copy_(obs.scale)
        # Started only once the observer has seen data: a first batch it skipped (NaN, Inf, empty)
        # leaves its default scale, not a range. One host read per step until then.
        self._initialized = bool((obs.min_val <= obs.max_val).any())

    @torch.no_grad()
    def _project(self) -> None:
        """Keep the learned scale at least ``eps`` (a step may push it to zero or below)."""
        if isinstance(self.scale, nn.Parameter) and self.scale.numel():
            self.scale.clamp_(min=self.observer.eps)

    def set_state(self, state: FakeQuantState | str) -> LSQFakeQuantize:
        super().set_state(state)
        if hasattr(self, "_initialized"):  # FakeQuantize.__init__ sets the first state before the Parameter exists
            self._project()
        return self

    # -- compute ----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.scale, nn.Parameter):  # a fixed scale: the plain fake quant
            return super().forward(x)
        follow = self.state is FakeQuantState.CALIBRATION or not self._initialized
        if self.observer_enabled and follow:
            self.observer(x.detach())
            self._take_observer_scale()
        if not self.fake_quant_enabled:
            return x
        if self.scale.numel() == 0:
            raise RuntimeError(
                f"{type(self).__name__} has no per-channel scale yet: observe a batch first (enable the observer) "
                "or load a state dict that holds the scale"
            )
        if self.training and self.scale.requires_grad:
            self._project()
        n = x.numel() // max(1, self.scale.numel())
        grad_factor = 1.0 / math.sqrt(max(1, n) * self.qmax)
        out: torch.Tensor = _LearnableScaleFn.apply(
            x, self.scale, self.qmin, self.qmax, self.ch_axis, grad_factor, self._pact
        )
        return out

    # -- state ------------------------------------------------------------------------------

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
        key = prefix + "scale"
        if isinstance(self.scale, nn.Parameter) and key in state_dict and state_dict[key].shape != self.scale.shape:
            with torch.no_grad():  # per-channel: take the checkpoint's size, keep the Parameter object
                self.scale.data = torch.empty_like(state_dict[key], dtype=torch.float32, device=self.scale.device)
            zp = prefix + "zero_point"
            if zp in state_dict:
                self.zero_point = torch.empty_like(state_dict[zp], device=self.zero_point.device)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if key in state_dict:
            # a checkpoint's scale is a starting point only if some observer saw data for it
            obs = self.observer
            self._initialized = bool((obs.min_val <= obs.max_val).any()) if obs.min_val.numel() else False

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> LSQFakeQuantize:
        super()._apply(fn, recurse)
        if isinstance(self.scale, nn.Parameter) and self.scale.dtype != torch.float32:
            self.scale.data = self.scale.data.float()  # scales are float32 by definition, as for the buffers
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, learnable={isinstance(self.scale, nn.Parameter)}"


class PACTFakeQuantize(LSQFakeQuantize):
    """Learned clipping (PACT): the scale is ``alpha / qmax`` and only clipped values pull it.

    Values inside the range give the scale no gradient, so without clipping it never moves;
    PACT pairs it with an L2 penalty on alpha (add ``wd * scale**2`` to the loss, or weight
    decay on these parameters) to pull the clip inward.
    """

    _pact: ClassVar[bool] = True
