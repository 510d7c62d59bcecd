"""Softmax of qint16 codes has no integer form (the Bayes table takes qint8 softmax input only;
convert raises), so on the integer grid it stays float fake quantization, reported as such. Its QAT
forward is within a proven bound of the exact softmax of the same input, rounded to the output grid
(docs/semantics.md, "What stays float fake quantization in training"): every element is checked
against it over a hypothesis search of rows built to line the exp table's rounding errors up, and
the rows the proof names as the worst case reach the bound."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, target
from hypothesis import strategies as st

from benchmarks.softmax_qint16_bound import measure, prepare, row, worst_row
from qir.march import march_scope
from qir.quantization import convert_fx, integer_grid_report
from qir.quantization.integer_grid import bind_integer_grid

_SM16 = prepare(True).get_submodule("sm")
_SM8 = prepare(False).get_submodule("sm")


@settings(max_examples=120)
@given(
    n=st.integers(2, 300),
    spread=st.floats(0.25, 40.0),
    seed=st.integers(0, 2**16),
    cluster=st.floats(0.0, 1.0),
    ratio=st.floats(0.01, 2.0),
    out16=st.booleans(),
)
def test_every_element_is_within_its_bound(
    n: int, spread: float, seed: int, cluster: float, ratio: float, out16: bool
) -> None:
    x = row(n, spread, seed, int(cluster * (n - 1)), ratio)
    diff, bound = measure(_SM16 if out16 else _SM8, x, out16)
    assert bool((diff <= bound).all()), (float(diff.max()), float(bound.max()))
    target(float(diff.max()) / max(1.0, float(bound.max())), label="measured / bound")


@pytest.mark.parametrize("n", [8, 64, 300])
def test_the_worst_case_reaches_the_bound(n: int) -> None:
    """All but the maximum at an exp just under half a step: each rounds to 0 and the sum loses
    ``(n - 1) s_e / 2``; the maximum's probability is off by about that (in LSBs at a qint16 output)."""
    x = worst_row(n)
    # a fresh module: its output observer sees this row first, so the maximum's ~1 is inside the range
    diff, bound = measure(prepare(True).get_submodule("sm"), x, True)
    assert bool((diff <= bound).all())
    assert float(diff.max()) >= float(bound.max()) / 4 and float(diff.max()) >= (n - 1) / 2 - 2


@pytest.mark.parametrize("out16", [False, True])
def test_qint16_softmax_is_reported_float_and_within_its_bound(out16: bool) -> None:
    qat = prepare(out16)
    assert integer_grid_report(qat)["sm"] == "float fake quant"
    assert bind_integer_grid(qat, "bayes")["sm"] == "Softmax of qint16 codes has no integer form (qint8 only)"
    sm = qat.get_submodule("sm")
    worst = 0.0
    for n in (2, 7, 64, 300):
        for spread in (0.5, 4.0, 30.0):  # logits' std: flat rows to one dominant entry
            for seed in range(4):
                diff, bound = measure(sm, row(n, spread, seed, 0, 1.0), out16)
                assert bool((diff <= bound).all()), (n, spread, float(diff.max()))
                worst = max(worst, float(diff.max()))
    if out16:
        assert worst >= 1  # the float path is not exact at qint16 resolution: the bound is what holds


def test_convert_refuses_qint16_softmax_input() -> None:
    qat = prepare(False)
    qat(torch.randn(2, 8))
    with march_scope("bayes"), pytest.raises(Exception, match="qint8"):
        convert_fx(qat)(torch.randn(2, 8))
