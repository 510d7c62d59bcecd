"""``qir.qtensor.QTensor``: the plugin's quantized-tensor type, for code that checks for it.

In the plugin, QAT and quantized models pass ``QTensor`` values between modules. qir does not:
a QAT model passes fake-quantized float tensors and a converted model passes integer codes,
with every scale a static buffer of the module that produced it (docs/migration.md). Users'
heads and post-processing still test ``isinstance(x, QTensor)`` and call ``.dequantize()``,
``.int_repr()``, ``.q_scale()`` or ``.as_subclass(torch.Tensor)``; this class makes that code
import and run. Such checks are False for the values qir's models pass, so the float branch of
the user's code runs, which is what it means for a plain tensor.

A ``QTensor`` is a ``torch.Tensor`` subclass holding either integer codes (``is_quantized``,
``real = code * scale``) or float values on the quantization grid, plus its scale, quantized
dtype and channel axis. As in the plugin, ``.dtype`` is the quantized dtype (``"qint8"``); the
stored tensor's torch dtype is ``.storage_dtype``. Torch operations on it act on the stored tensor and return plain
tensors (as ``x.as_subclass(torch.Tensor)`` would): quantization parameters are never carried
silently through arithmetic that changes them.
"""

from __future__ import annotations

from typing import Any

import torch

from qir.ir.numerics import DTypeLike, qdtype
from qir.ir.types import DType

__all__ = ["QTensor"]


class QTensor(torch.Tensor):
    """``QTensor(data, scale, dtype="qint8", per_channel_axis=-1)``.

    ``data``: integer codes (int8/int16/int32 storage) or float values; ``scale``: a float or a
    1-element tensor, or one scale per slice along ``per_channel_axis`` (``-1``: per tensor, the
    plugin's convention).
    """

    # no __torch_function__ wrapping: results of torch ops are plain tensors
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    _q_scale: torch.Tensor
    _q_dtype: DType
    _q_axis: int

    def __new__(
        cls, data: torch.Tensor, scale: float | torch.Tensor, dtype: DTypeLike = "qint8", per_channel_axis: int = -1
    ) -> QTensor:
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"QTensor data must be a torch.Tensor, got {type(data).__name__}")
        if isinstance(data, QTensor):
            data = data.as_subclass(torch.Tensor)
        qd = qdtype(dtype)
        s = torch.as_tensor(scale, dtype=torch.float32, device=data.device).detach().reshape(-1)
        if per_channel_axis == -1:
            if s.numel() != 1:
                raise ValueError(
                    f"QTensor: {s.numel()} scales for a per-tensor QTensor; "
                    "pass per_channel_axis= for per-channel scales"
                )
        elif not 0 <= per_channel_axis < data.dim() or s.numel() != data.shape[per_channel_axis]:
            raise ValueError(
                f"QTensor: per_channel_axis={per_channel_axis} with {s.numel()} scales does not fit data of shape "
                f"{tuple(data.shape)}"
            )
        if not bool(torch.all(s > 0)):
            raise ValueError("QTensor scales must be positive (qir's quantization is symmetric, zero point 0)")
        if not (data.is_floating_point() or data.dtype in (torch.int8, torch.int16, torch.int32)):
            raise TypeError(f"QTensor data must be float or int8/int16/int32 codes, got {data.dtype}")
        out = torch.Tensor._make_subclass(cls, data, data.requires_grad)
        out._q_scale = s
        out._q_dtype = qd
        out._q_axis = per_channel_axis
        return out

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # everything happens in __new__
        pass

    def _plain(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def _scale_along(self) -> torch.Tensor:
        if self._q_axis == -1:
            return self._q_scale
        shape = [1] * self.dim()
        shape[self._q_axis] = -1
        return self._q_scale.reshape(shape)

    @property
    def is_quantized(self) -> bool:  # type: ignore[override]
        """True when the stored values are integer codes (a converted model's), False for float values."""
        return not self._plain().is_floating_point()

    # The plugin's QTensor.dtype is the quantized dtype (its code compares ``x.dtype == qint16``
    # and passes ``x.dtype`` on as the output dtype); torch's C code reads the storage dtype
    # directly, so shadowing the Python attribute changes only what user code sees.
    @property
    def dtype(self) -> str:  # type: ignore[override]
        """The quantized dtype, ``"qint8"`` / ``"qint16"`` / ``"qint32"`` (``qir.dtype.qint8``...), as the
        plugin's ``QTensor.dtype``; the stored tensor's torch dtype is :attr:`storage_dtype`."""
        return self._q_dtype.name

    @property
    def qdtype(self) -> str:
        """Same as :attr:`dtype` (kept for code written against earlier qir)."""
        return self._q_dtype.name

    @property
    def qtype(self) -> str:
        """Same as :attr:`dtype` (the plugin's other spelling)."""
        return self._q_dtype.name

    @property
    def storage_dtype(self) -> torch.dtype:
        """The torch dtype of the stored tensor: int8 / int16 / int32 codes, or a float dtype for
        fake-quantized values (``x.as_subclass(torch.Tensor).dtype``)."""
        return self._plain().dtype

    # the plugin's QTensor returns tensors here (torch's per-tensor quantized tensors return numbers)
    def q_scale(self) -> torch.Tensor:  # type: ignore[override]
        return self._q_scale

    def q_zero_point(self) -> torch.Tensor:  # type: ignore[override]
        return torch.zeros(self._q_scale.shape, dtype=torch.long, device=self._q_scale.device)

    def q_per_channel_axis(self) -> int:
        return self._q_axis

    def int_repr(self) -> torch.Tensor:
        """The integer codes: stored ones, or ``saturate(floor(x / scale + 0.5))`` of float values."""
        plain = self._plain()
        if not plain.is_floating_point():
            return plain
        lo, hi = self._q_dtype.qrange
        codes = torch.floor(plain.detach().to(torch.float64) / self._scale_along().to(torch.float64) + 0.5)
        return codes.clamp(lo, hi).to(self._q_dtype.to_torch())

    def dequantize(self) -> torch.Tensor:
        """The real values as a float32 tensor: ``codes * scale``, or the stored float values."""
        plain = self._plain()
        if plain.is_floating_point():
            return plain
        return (plain.to(torch.float64) * self._scale_along().to(torch.float64)).to(torch.float32)

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]  # torch's is untyped
        axis = "" if self._q_axis == -1 else f", per_channel_axis={self._q_axis}"
        scale = self._q_scale.tolist() if self._q_axis != -1 else float(self._q_scale[0])
        return f"QTensor({self._plain()!r}, scale={scale}, dtype={self.qdtype}{axis})"

    def __deepcopy__(self, memo: dict[int, Any]) -> QTensor:
        return QTensor(self._plain().clone(), self._q_scale.clone(), self._q_dtype.name, self._q_axis)

    def __reduce_ex__(self, proto: Any) -> Any:
        # pickling / torch.save: rebuild from the plain tensor and the quantization parameters
        return (_rebuild, (self._plain().clone(), self._q_scale.clone(), self._q_dtype.name, self._q_axis))


def _rebuild(data: torch.Tensor, scale: torch.Tensor, dtype: str, axis: int) -> QTensor:
    return QTensor(data, scale, dtype, axis)
