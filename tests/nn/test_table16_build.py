"""The vectorised version-2 table build gives the tables the plain per-level rule gives
(benchmarks/table16_reference.py), knot for knot and code for code, for random functions,
scales, output dtypes and knot budgets."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qir.nn as qnn
from backends.common.lut_segmented import KNOT_BUDGET, full_table16, lut_int16, method_table16
from benchmarks.table16_reference import reference_table16
from qir.nn.qat import LUT_FLOAT_CLASSES

_FUNCTIONS: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
    *((cls.__name__, cls()) for cls in LUT_FLOAT_CLASSES),
    *((type(m).__name__, m.function()) for m in (qnn.Exp(), qnn.Sin(), qnn.Atan(), qnn.Erf())),
    ("ceil", torch.ceil),
    ("floor", torch.floor),
    # flat stretches and exact ties between the bounds of many intervals (the selection's hard case)
    ("steps", lambda x: torch.floor(x * 3).clamp(-2, 2) * 0.25),
]


@settings(max_examples=60)
@given(
    fn=st.sampled_from(_FUNCTIONS),
    amax=st.floats(0.01, 64.0),
    out_range=st.floats(0.05, 40.0),
    out_dtype=st.sampled_from(["qint8", "qint16"]),
    budget=st.one_of(st.just(KNOT_BUDGET), st.just(1 << 16), st.integers(1, 2048)),
)
def test_vectorised_build_equals_the_reference(
    fn: tuple[str, Callable[[torch.Tensor], torch.Tensor]], amax: float, out_range: float, out_dtype: str, budget: int
) -> None:
    _, f = fn
    s_in = amax / 32767.5
    s_out = out_range / (127.5 if out_dtype == "qint8" else 32767.5)
    got = lut_int16(f, s_in, s_out, out_dtype, measure=False, budget=budget).entries
    want = reference_table16(f, s_in, s_out, out_dtype, budget)
    assert torch.equal(got, want)
    assert got.shape[1] - 1 <= budget
    # every code's output: what the grid's cache and the lut16 kernel read
    assert torch.equal(full_table16(got, out_dtype), full_table16(want, out_dtype))


@pytest.mark.parametrize("method", ["exp", "ceil", "floor"])
def test_method_tables_equal_the_reference(method: str) -> None:
    fn = {"exp": torch.exp, "ceil": torch.ceil, "floor": torch.floor}[method]
    budget = KNOT_BUDGET if method == "exp" else 1 << 16
    got = method_table16(method, fn, 6 / 32767.5, 3 / 32767.5, "qint16", 2)
    assert got is not None
    assert torch.equal(got, reference_table16(fn, 6 / 32767.5, 3 / 32767.5, "qint16", budget))


def test_a_budget_of_one_interval_is_the_two_ends() -> None:
    entries = lut_int16(torch.tanh, 4 / 32767.5, 1 / 32767.5, "qint16", measure=False, budget=1).entries
    assert entries[0].tolist() == [-32768, 32768]
