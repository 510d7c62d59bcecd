"""The per-step constants the integer-grid conv computes on the host equal the tensor rules they replace."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from backends.common import numerics
from qir.ir.types import DType
from qir.quantization.code_ops import constant_code


def _ties(value: float) -> list[float]:
    """Scales at which value / scale lands on (or one float32 step beside) a half-integer."""
    out = []
    for k in (0.5, 1.5, 46.5, 127.5, 128.5, 32766.5, 32767.5):
        s = np.float32(value / k)
        out += [float(s), float(np.nextafter(s, np.float32(0))), float(np.nextafter(s, np.float32(1)))]
    return out


SCALES = [1e-45, 1e-38, 1e-9, 6 / 127, 6 / 128, 0.047, 1.0, 6.0, 12.0, 13.0, 1e30, 3e38]


@pytest.mark.parametrize("dtype", [DType.qint8, DType.qint16])
@pytest.mark.parametrize("value", [6.0, 0.0, -6.0, 1.0, 0.5])
def test_constant_code_is_numerics_quantize_at_edges(dtype: DType, value: float) -> None:
    for s in SCALES + _ties(value if value else 1.0):
        want = int(numerics.quantize(torch.tensor([value]), s, dtype).reshape(-1)[0])
        assert constant_code(value, s, dtype) == want, (value, s, dtype)


@settings(max_examples=300, deadline=None)
@given(
    value=st.floats(-1e6, 1e6, width=32),
    exponent=st.floats(-40.0, 40.0),
    mantissa=st.floats(1.0, 2.0),
    dtype=st.sampled_from([DType.qint8, DType.qint16]),
)
def test_constant_code_is_numerics_quantize(value: float, exponent: float, mantissa: float, dtype: DType) -> None:
    s = float(np.float32(mantissa * 2.0**exponent))
    assume(s > 0.0 and math.isfinite(s))
    want = int(numerics.quantize(torch.tensor([value]), s, dtype).reshape(-1)[0])
    assert constant_code(value, s, dtype) == want
