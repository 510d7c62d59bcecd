"""The comparison operators QAT evaluates on float32 values, by op name: one table for the
QAT code ops (qir.quantization.code_ops) and the integer kernels (kernels/codes.py)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

#: comparison op name -> the Python operator QAT evaluates on float32 values
COMPARISONS: dict[str, Callable[[Any, Any], Any]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.gt,
    "ge": operator.ge,
    "lt": operator.lt,
    "le": operator.le,
}
