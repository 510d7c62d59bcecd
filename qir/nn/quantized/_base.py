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


def output_fq(qat: nn.Module) -> FakeQuantize | None:
    fq = getattr(qat, "activation_post_process", None)
    return fq if isinstance(fq, FakeQuantize) else None
