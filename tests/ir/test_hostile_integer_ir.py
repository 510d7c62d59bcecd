"""Edits of converted-model IR text that used to verify and then fail (or silently mistype) at
run time are refused by verify, naming the op and the fault: the integer ops infer their
result types and check their attributes, scales, march and state operands (the gaps
benchmarks/fuzz_ir.py found from its converted-model seeds)."""

from __future__ import annotations

import re

import pytest

from backends.common.math_rules import LN_EPS_MAX_BITS, LN_MAX_ELEMENTS, LN_MAX_SUM
from benchmarks import fuzz_ir
from benchmarks.fuzz_ir import run_case, seed_texts
from qir.ir import IRError
from qir.ir.ops.integer_functional import QLutMethod
from qir.ir.ops.integer_math import QLayerNorm
from qir.ir.types import DType, QuantSpec, TensorType

REFUSED = ("parse-error", "verify-error")


def _seed(name: str) -> tuple[str, dict[str, object]]:
    for n, text, constants in seed_texts():
        if n == name:
            return text, constants
    raise AssertionError(f"no seed {name}: {[n for n, _, _ in seed_texts()]}")


def test_converted_seeds_on_both_marches_run() -> None:
    names = {n for n, _, _ in seed_texts()}
    for model in ("vision", "math"):
        for march in ("bayes", "bernoulli2"):
            assert f"converted:{model}:{march}" in names
    text, _ = _seed("converted:math:bayes")
    for op in ("qconv(", "qmatmul(", "qsoftmax(", "qglu(", "qcat(", "qtensor_div(", "qlut_method("):
        assert op in text


EDITS = [
    # (seed, pattern, replacement, what the refusal names)
    ("vision", r"count=2, dim=1\)", "count=2, dim=7)", "qcat"),
    ("vision", r'march="bayes", count=2', 'march="numpy", count=2', "march"),
    ("vision", r"multiplier=(\d+), shift=22", r"multiplier=(\1,), shift=22", "multiplier"),
    ("vision", r"(%sm: tensor<2x)8(x4x4xqi8)", r"\g<1>4\2", "qsoftmax"),
    ("vision", r"qconv\(%conv, %conv,", "qconv(%conv, %quant,", "rejects its operand shapes"),
    ("vision", r"%fc_bias: tensor<5xi32>", "%fc_bias: tensor<4xi32>", "bias"),
    ("vision", r"qconv\(%flatten,", "qconv(%gap,", "qconv"),
    ("math", r"scalar=1\.0\)", "scalar=(1.0,))", "scalar"),
    ("math", r'(method="maximum", out=QuantSpec\(scale=\()[0-9.e-]+', r"\g<1>1e-12", "multiplier limit"),
    ("math", r"(qglu\(.*?multiplier=)\d+", r"\g<1>9223372036854775807", "multiplier"),
    ("math", r'%transpose, method="matmul"', '%getitem_1, method="matmul"', "qmatmul"),
    ("math", r"(in_scales=\()[0-9.e-]+(, [0-9.e-]+\), march=\"bayes\"\) @mx)", r"\g<1>-1.0\2", "scales"),
]


@pytest.mark.parametrize(("seed", "pattern", "repl", "names"), EDITS, ids=[e[1][:24] for e in EDITS])
def test_edit_is_refused_before_it_runs(seed: str, pattern: str, repl: str, names: str) -> None:
    text, constants = _seed(f"converted:{seed}:bayes")
    edited, n = re.subn(pattern, repl, text, count=1)
    assert n == 1, pattern
    outcome, detail = run_case(edited, 0, constants=constants)  # type: ignore[arg-type]
    assert outcome in REFUSED, (outcome, detail)
    assert names in detail


def test_without_the_integer_checks_an_edit_fails_at_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The class the checks close: the same edit with verify switched off fails in the module."""
    text, constants = _seed("converted:vision:bayes")
    edited = text.replace("qconv(%conv, %conv,", "qconv(%conv, %quant,", 1)
    monkeypatch.setattr(fuzz_ir, "verify", lambda graph: None)
    outcome, _ = run_case(edited, 0, constants=constants)  # type: ignore[arg-type]
    assert outcome.startswith("verified-but-run-failed: qconv")


def test_table_methods_read_the_codes_they_have_tables_for() -> None:
    op = QLutMethod(method="floor", out=QuantSpec((0.1,)), in_scales=(0.1,), march="bayes")
    with pytest.raises(IRError, match="reads qint8 codes"):
        op.verify([TensorType((2, 3), DType.qint16)])
    with pytest.raises(IRError, match="reads qint8 codes"):
        op.verify([TensorType((2, 3), DType.qint32)])
    assert op.infer_type([TensorType((2, 3), DType.qint8)]) == TensorType((2, 3), DType.qint8, op.out)
    exp = QLutMethod(method="exp", out=QuantSpec((0.1,)), in_scales=(0.1,), march="bayes")
    exp.verify([TensorType((2, 3), DType.qint16)])  # the segmented table


def test_two_hundred_converted_mutations_find_no_bug() -> None:
    result = fuzz_ir.fuzz(200, seed=7, mem_bytes=2 * 2**30, timeout=10.0, only="converted:")
    assert result["counts"].get("ran", 0) > 0
    assert result["bugs"] == 0, fuzz_ir.table(result)


def test_layer_norm_eps_terms_stay_in_the_integer_rules_ranges() -> None:
    """The bounds the op checks are the rule's own (backends.common.math_rules): at the limit it
    verifies, one past it is refused (an E of 2**63 overflowed int64 when run)."""

    x = TensorType((2, 4), DType.qint8)
    state = [TensorType((4,), DType.int64)] * 3

    def ln(f: int, e: int, shape: tuple[int, ...] = (4,)) -> QLayerNorm:
        return QLayerNorm(out=QuantSpec((0.1,)), in_scales=(0.1,), normalized_shape=shape, eps_terms=(("int8", f, e),))

    ln(LN_EPS_MAX_BITS, LN_MAX_SUM // 2 - 1).verify([x, *state])
    ln(0, -1).verify([x, *state])
    for f, e in ((LN_EPS_MAX_BITS + 1, 5), (3, LN_MAX_SUM // 2), (3, 2**63), (-1, 5), (3, -2)):
        with pytest.raises(IRError, match="eps_terms for int8"):
            ln(f, e).verify([x, *state])
    big = (LN_MAX_ELEMENTS + 1,)
    with pytest.raises(IRError, match="1 to 2\\*\\*20 elements"):
        ln(3, 5, big).verify([TensorType((1, *big), DType.qint8), *[TensorType(big, DType.int64)] * 3])
