"""``qir.dtype``: the plugin's quantized dtype names and :func:`qinfo`.

``qint8``, ``qint16`` and ``qint32`` are the strings every qir API accepts wherever a
quantized dtype is asked for (qconfigs, ``FakeQuantize``, ``out_dtype``), as in the plugin's
``horizon_plugin_pytorch.dtype``. qir's quantization is symmetric and signed, so the
plugin's unsigned and 4-bit dtypes (``quint8``, ``qint4``, ``quint4``) are refused by name.
"""

from __future__ import annotations

import dis
import sys

import attrs

from qir.ir.numerics import DTypeLike, qdtype
from qir.ir.types import DType

__all__ = ["QuantDTypeInfo", "qinfo", "qint8", "qint16", "qint32"]

qint8 = "qint8"
qint16 = "qint16"
qint32 = "qint32"

_UNSUPPORTED = {
    "quint8": "unsigned (asymmetric) quantization",
    "qint4": "4-bit quantization",
    "quint4": "unsigned 4-bit quantization",
    "quint16": "unsigned (asymmetric) quantization",
}


@attrs.frozen
class QuantDTypeInfo:
    """``qinfo(dtype)``: the inclusive integer range and width of a quantized dtype."""

    dtype: str
    bits: int
    min: int
    max: int


def qinfo(dtype: DTypeLike) -> QuantDTypeInfo:
    """``qinfo("qint16").min == -32768``, ``.max == 32767``, ``.bits == 16`` (also for ``DType`` / ``torch.qint8``)."""
    if isinstance(dtype, str) and dtype.strip().lower() in _UNSUPPORTED:
        _refuse(dtype.strip().lower(), ValueError)
    d = qdtype(dtype)
    lo, hi = d.qrange
    return QuantDTypeInfo(dtype=d.name, bits=_BITS[d], min=lo, max=hi)


_BITS = {DType.qint8: 8, DType.qint16: 16, DType.qint32: 32}


def _refuse(name: str, exc: type[Exception]) -> None:
    raise exc(
        f"qir.dtype.{name} is not supported by qir: {_UNSUPPORTED[name]} has no integer rules in qir "
        "(symmetric, zero point 0); use qint8 or qint16"
    )


_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


def _caller_imports_from() -> bool:
    """Whether the code that asked for the attribute is a ``from qir.dtype import name``.

    ``from ... import`` turns an AttributeError into a bare "cannot import name" that loses the
    reason, and ``hasattr`` / ``getattr(..., default)`` must see an AttributeError, so the one
    exception type cannot serve both: the caller's current instruction tells them apart."""
    frame = sys._getframe(2)  # 0: here, 1: __getattr__, 2: the code reading the attribute
    code, i = frame.f_code.co_code, frame.f_lasti
    return 0 <= i < len(code) and code[i] == _IMPORT_FROM


def __getattr__(name: str) -> object:
    if name in _UNSUPPORTED:
        # hasattr(qir.dtype, "quint8") is False; `from qir.dtype import quint8` says why
        _refuse(name, ImportError if _caller_imports_from() else AttributeError)
    raise AttributeError(f"module 'qir.dtype' has no attribute {name!r}")
