"""Real QAT on digits (benchmarks/digits_accuracy.py) with a short schedule and looser bounds.

The benchmark itself (30 float epochs, 5 QAT epochs) checks converted within 1 point of
float and >= 99.5% QAT/converted argmax agreement; this quick run checks 3 points and, with QAT
evaluated in validation mode (what the converted model computes), 100% agreement.
"""

from __future__ import annotations

from benchmarks.digits_accuracy import check, run, table


def test_digits_qat_both_marches() -> None:
    rows = run(epochs=6, qat_epochs=1)
    print(table(rows))
    assert [r.march for r in rows] == ["bayes", "bernoulli2"]
    for r in rows:
        assert r.float_acc > 85.0, table(rows)
        assert r.calib_acc > r.float_acc - 5.0, table(rows)
    assert not check(rows, max_drop=3.0, min_agreement=100.0), table(rows)
