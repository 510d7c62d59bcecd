"""The QAT mode: what ``prepare_qat_fx`` does with a batch norm that follows a conv / linear.

The plugin's ``horizon_plugin_pytorch.qat_mode``: ``set_qat_mode(QATMode.WithBN)`` before
``prepare_qat_fx``. qir has two modes:

- ``QATMode.FuseBN`` (``"fuse_bn"``, the default): the batch norm is folded into the conv's
  weight and bias at prepare; QAT trains the folded weights, no batch statistics.
- ``QATMode.WithBN`` (``"with_bn"``): the batch norm is kept in the QAT conv (``<conv>.bn``)
  and trained with batch statistics, its running statistics updated; the conv's weight is
  fake-quantized folded with the running statistics, and convert folds the batch norm for
  good (docs/qconfig.md, "QAT with batch norm").

The mode is read by ``prepare_qat_fx`` when it prepares a model with QAT qconfigs
(calibration prepares always fold). ``qat_mode_scope`` sets it for a block.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

__all__ = ["QATMode", "get_qat_mode", "qat_mode_scope", "set_qat_mode"]


class QATMode(enum.Enum):
    FuseBN = "fuse_bn"
    WithBN = "with_bn"

    @classmethod
    def parse(cls, mode: QATMode | str) -> QATMode:
        if isinstance(mode, QATMode):
            return mode
        if isinstance(mode, str):
            key = mode.strip().lower()
            for m in cls:
                if key in (m.value, m.name.lower()):
                    return m
        raise ValueError(f"unknown QAT mode {mode!r}; valid: {', '.join(repr(m.value) for m in cls)}")


_MODE = [QATMode.FuseBN]


def set_qat_mode(mode: QATMode | str) -> None:
    """Set the QAT mode for the following ``prepare_qat_fx`` calls (``QATMode`` or its value)."""
    _MODE[0] = QATMode.parse(mode)


def get_qat_mode() -> QATMode:
    """The current QAT mode (default ``QATMode.FuseBN``)."""
    return _MODE[0]


@contextlib.contextmanager
def qat_mode_scope(mode: QATMode | str) -> Iterator[None]:
    """``set_qat_mode(mode)`` for the block, then the previous mode again."""
    before = _MODE[0]
    _MODE[0] = QATMode.parse(mode)
    try:
        yield
    finally:
        _MODE[0] = before
