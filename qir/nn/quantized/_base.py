"""Shared plumbing of the quantized modules: scale buffers and conversion checks.

A quantized module takes integer code tensors (torch.int8 / int16 / int32) and returns
code tensors. Its input scales (one per tensor input) and output ``scale`` are float32
buffers fixed by :meth:`from_qat`; ``dtype`` (a qir DType, or ``None`` for "same as the
input") is a plain attribute. A per-channel scale (a high-precision conv output) is
shaped to broadcast against the tensor it describes: (C, 1, 1) for NCHW, (C,) for a
linear output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from qir.ir.types import DType
from qir.march import March
from qir.nn.quantized.derived_state import DERIVED_KEY, flatten_ints, unflatten_ints
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.observer import keep_buffer_dtypes

__all__ = ["QuantizedModule", "as_scale_tensor", "check_qat", "march_name", "per_tensor_scale", "untraced"]

T = TypeVar("T")


def untraced(make: Callable[[], T]) -> T:
    """Run ``make`` with jit tracing suspended.

    Integer parameters derived lazily (on a method's first call) must not be recorded as
    graph ops: they would appear in the first traced invocation only, and ``jit.trace``'s
    check would see two different graphs. Computed here, they enter the trace as constants.
    """
    get_state, set_state = torch._C._get_tracing_state, getattr(torch._C, "_set_tracing_state")  # noqa: B009
    state = get_state()
    if state is None:
        return make()
    set_state(None)
    try:
        return make()
    finally:
        set_state(state)


def march_name(march: Any) -> str:
    """``march`` as its lowercase name, validated."""
    return March.parse(march).value


def as_scale_tensor(s: Any, what: str) -> torch.Tensor:
    """A scale given as a tensor or float, as a detached float32 tensor (shape (1,) for scalars)."""
    t = s.detach() if isinstance(s, torch.Tensor) else torch.tensor([float(s)])
    t = t.to(torch.float32).clone()
    if t.dim() == 0:
        t = t.reshape(1)
    if t.numel() == 0 or not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise ValueError(f"{what}: scales must be positive and finite, got {t.tolist()}")
    return t


def check_qat(cls: type, qat: nn.Module, want: type | tuple[type, ...]) -> None:
    if not isinstance(qat, want):
        names = ", ".join(w.__name__ for w in (want if isinstance(want, tuple) else (want,)))
        raise TypeError(f"{cls.__name__}.from_qat takes a QAT {names}, got {type(qat).__name__}")


def per_tensor_scale(name: str, s: torch.Tensor, i: int) -> float:
    """Module ``name``'s input ``i`` scale ``s`` as a float; raises when it is per channel (a qint32 output)."""
    if s.numel() != 1:
        raise ValueError(
            f"{name}: input {i} has a per-channel scale (a high-precision qint32 output); "
            "only DeQuantStub can consume it. Give the producer an activation fake quant"
        )
    return float(s.reshape(-1)[0])


class QuantizedModule(nn.Module):
    """Base of the quantized modules: ``input_scale_<i>`` and ``scale`` buffers, ``dtype`` attribute."""

    num_inputs: ClassVar[int] = 1
    #: plain attributes forward reads that conversion derives from the scales and weights: the
    #: state dict carries them (qir.nn.quantized.derived_state), so a loaded checkpoint runs its own
    derived: ClassVar[tuple[str, ...]] = ()
    #: buffers whose length depends on the scales (a segmented table's knots): a checkpoint's replaces them
    resized_buffers: ClassVar[tuple[str, ...]] = ()
    scale: torch.Tensor
    input_scale_0: torch.Tensor
    dtype: DType | None
    num_input_scales: int

    def _set_scales(
        self, input_scales: Sequence[Any], out_scale: torch.Tensor | None, dtype: DType | None, n: int | None = None
    ) -> None:
        name = type(self).__name__
        if isinstance(input_scales, (torch.Tensor, float, int)):
            raise TypeError(f"{name}.from_qat: input_scales is a sequence with one scale per tensor input")
        want = self.num_inputs if n is None else n
        if want >= 0 and len(input_scales) != want:
            raise ValueError(f"{name}.from_qat: expected {want} input scale(s), got {len(input_scales)}")
        self.num_input_scales = len(input_scales)
        for i, s in enumerate(input_scales):
            self.register_buffer(f"input_scale_{i}", as_scale_tensor(s, f"{name} input {i}"))
        if out_scale is not None:
            self.register_buffer("scale", as_scale_tensor(out_scale, f"{name} output"))
        self.dtype = dtype

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> QuantizedModule:
        # scales are float32 by definition: .half() / .double() must not round them
        super()._apply(fn, recurse)
        names = [n for n in self._buffers if n == "scale" or n.startswith("input_scale_")]
        keep_buffer_dtypes(self, dict.fromkeys(names, torch.float32))
        return self

    def _derived_names(self) -> list[str]:
        """The :attr:`derived` attributes this instance has (a nearest resize has no multiplier)."""
        return [n for n in self.derived if n in self.__dict__]

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        names = self._derived_names()
        if names:
            ints = flatten_ints([self.__dict__[n] for n in names])
            destination[prefix + DERIVED_KEY] = torch.tensor(ints, dtype=torch.int64)

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
        names = self._derived_names()
        key = prefix + DERIVED_KEY
        before = {n: b.detach().clone() for n, b in self._buffers.items() if b is not None} if names else {}
        for name in self.resized_buffers:
            cur, new = self._buffers.get(name), state_dict.get(prefix + name)
            if cur is not None and isinstance(new, torch.Tensor) and new.shape != cur.shape:
                self._buffers[name] = torch.empty(new.shape, dtype=cur.dtype, device=cur.device)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # parameters derived lazily from the scales (QFunctional, AdaptiveAvgPool2d) are derived again
        self.__dict__.pop("_param_cache", None)
        if not names:
            return
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        where = f"{type(self).__name__} at '{prefix[:-1]}'" if prefix else type(self).__name__
        if key in state_dict:
            try:
                values = unflatten_ints([self.__dict__[n] for n in names], state_dict[key], where)
            except ValueError as e:
                error_msgs.append(str(e))
                return
            self.__dict__.update(zip(names, values, strict=True))
            return
        # a checkpoint written before the derived integers were carried: right only for this
        # module's own scales and weights
        changed = [n for n, b in self._buffers.items() if n in before and b is not None and not _same(before[n], b)]
        if changed:
            error_msgs.append(
                f"{where}: the checkpoint has no '{key}' (it was saved before converted models carried their "
                f"requantization parameters) and its {', '.join(changed)} differ from this model's, so the "
                f"model would run this model's {', '.join(names)} with the checkpoint's scales. Load the QAT "
                "checkpoint into the QAT model and convert it again, or save the converted model again"
            )

    @property
    def input_scales(self) -> list[torch.Tensor]:
        return [getattr(self, f"input_scale_{i}") for i in range(self.num_input_scales)]

    def per_tensor_input(self, i: int) -> float:
        """Input ``i``'s scale as a float; raises when it is per channel (a qint32 output)."""
        return per_tensor_scale(type(self).__name__, getattr(self, f"input_scale_{i}"), i)

    def extra_repr(self) -> str:
        d = self.dtype.name if self.dtype is not None else "same as input"
        s = getattr(self, "scale", None)
        shown = f"{float(s.reshape(-1)[0]):.6g}" if s is not None and s.numel() == 1 else "per-channel"
        return f"dtype={d}, scale={shown}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b.to(a.device)))


def output_fq(qat: nn.Module) -> FakeQuantize | None:
    fq = getattr(qat, "activation_post_process", None)
    return fq if isinstance(fq, FakeQuantize) else None
