"""``verify`` checks the values of the state constants an integer layer's kernel trusts, not only
their types: a converted model's real constants with one value edited (a shift of 99, a
multiplier beyond 31 bits, an exp table entry of 0, a NaN scale) is refused naming the node,
the state role and the rule; the unedited constants verify; zeros bound for constants the
text has no tensor for (``allow_unbound``) are stand-ins whose values are not checked."""

from __future__ import annotations

import math
import random

import pytest
import torch

from benchmarks.fuzz_ir import OK_CLASSES, mutate_constants, read_constants, run_case, seed_texts
from qir.ir import VerifyError, parse_graph, verify
from qir.ir.ops.integer_values import check_exp_table, check_linear_state
from qir.ir.types import DType, TensorType


def _seed(name: str) -> tuple[str, dict[str, torch.Tensor]]:
    for n, text, constants in seed_texts():
        if n == name:
            return text, constants
    raise AssertionError(f"no seed {name}")


def _edited(name: str, key: str, index: int, value: float) -> tuple[str, dict[str, torch.Tensor]]:
    text, constants = _seed(name)
    edited = dict(constants)
    t = constants[key].clone()
    t.view(-1)[index] = value
    edited[key] = t
    return text, edited


EDITS = [
    # (seed, constant, index, value, what the refusal names)
    (
        "converted:vision:bayes",
        "conv.shift",
        3,
        99,
        "%conv (module conv): op 'qconv': shift must hold integers in [0, 62]",
    ),
    ("converted:vision:bayes", "conv.shift", 0, -1, "shift must hold integers in [0, 62], got -1 at index 0"),
    ("converted:vision:bayes", "conv.multiplier", 2, 2**40, "multiplier must hold integers in [-2147483647"),
    ("converted:vision:bayes", "_generated_add_0.shift", 0, 63, "op 'qconv': shift must hold integers in [0, 62]"),
    ("converted:vision:bayes", "sm.table", 255, 0, "%sm (module sm): op 'qsoftmax': table entry 255"),
    ("converted:vision:bayes", "sm.table", 7, -3, "op 'qsoftmax': table must hold integers in [0,"),
    ("converted:vision:bayes", "ln.shift", 5, 70, "%ln (module ln): op 'qlayer_norm': shift must hold integers"),
    ("converted:vision:bayes", "ln.multiplier", 0, 2**33, "op 'qlayer_norm': multiplier"),
    ("converted:vision:bayes", "ln.bias", 0, 2**35, "op 'qlayer_norm': bias must hold integers"),
    ("converted:math:bayes", "prelu.neg_shift", 0, 64, "%prelu (module prelu): op 'qprelu': neg_shift"),
    ("converted:math:bayes", "prelu.neg_multiplier", 0, -(2**32), "op 'qprelu': neg_multiplier"),
    ("converted:math:bayes", "ap.shifts", 8, 99, "%ap (module ap): op 'qavg_pool2d': shifts must hold integers"),
    ("converted:math:bayes", "ap.multipliers", 0, 2**50, "op 'qavg_pool2d': multipliers"),
    ("converted:math:bayes", "qkv.shift", 23, 4096, "%qkv (module qkv): op 'qconv': shift"),
]


@pytest.mark.parametrize(("seed", "key", "index", "value", "names"), EDITS, ids=[f"{e[1]}={e[3]}" for e in EDITS])
def test_an_edited_constant_value_is_refused(seed: str, key: str, index: int, value: int, names: str) -> None:
    text, constants = _edited(seed, key, index, value)
    graph = parse_graph(text, constants=constants)
    with pytest.raises(VerifyError) as e:
        verify(graph)
    assert names in str(e.value)
    outcome, detail = run_case(text, 0, constants=constants)
    assert outcome == "verify-error", (outcome, detail)


def test_a_relu6_bound_outside_the_output_codes_is_refused() -> None:
    with pytest.raises(Exception, match=r"relu6_bound must hold integers in \[0, 127\] \(the qint8 code range\)"):
        check_linear_state(
            "qconv", {"relu6_bound": torch.tensor([127, 128])}, TensorType((1, 2), DType.qint8), DType.qint8, relu6=True
        )
    # a layer without ReLU6 never reads it; a qint32 (high-precision) output never requantizes
    check_linear_state("qconv", {"relu6_bound": torch.tensor([-5])}, TensorType((1, 2), DType.qint8), DType.qint8)
    check_linear_state("qconv", {"shift": torch.tensor([99])}, TensorType((1, 2), DType.qint8), DType.qint32)


def test_an_accumulator_that_can_overflow_int64_is_refused() -> None:
    x = TensorType((1, 4096), DType.qint16)
    state = {"weight": torch.full((2, 4096), 32767, dtype=torch.int16), "multiplier": torch.tensor([2**31 - 1] * 2)}
    with pytest.raises(Exception, match="beyond int64"):
        check_linear_state("qconv", state, x, DType.qint16)
    state["multiplier"] = torch.tensor([30000, 30000])
    check_linear_state("qconv", state, x, DType.qint16)


def test_exp_table_row_sums_fit_int64() -> None:
    table = torch.full((256,), 32767, dtype=torch.int16)
    check_exp_table("qsoftmax", "table", table, 64, 2**31 - 1, 23)
    with pytest.raises(Exception, match="shifted by 50"):
        check_exp_table("qsoftmax", "table", table, 2**16, 2**31 - 1, 50)


@pytest.mark.parametrize("value", [0.0, -0.5, math.nan, math.inf])
def test_a_fake_quant_scale_must_be_positive_and_finite(value: float) -> None:
    text = """graph @m(%x: tensor<2x3xf32>) {
  %s: tensor<1xf32> = constant(key="act.scale", kind="buffer")
  %fq: tensor<2x3xf32> = fake_quant(%x, %s) @act
  return %fq
}"""
    verify(parse_graph(text, constants={"act.scale": torch.tensor([0.25])}))
    graph = parse_graph(text, constants={"act.scale": torch.tensor([value])})
    with pytest.raises(VerifyError, match=r"%fq \(module act\): op 'fake_quant': scale must hold positive finite"):
        verify(graph)


def test_unbound_constants_are_stand_ins_whose_values_are_not_checked() -> None:
    text, _ = _seed("converted:vision:bayes")
    graph = parse_graph(text, allow_unbound=True)  # zeros: a softmax table of zeros, scales of 0
    verify(graph)
    graph.constants["sm.table"] = torch.zeros(256, dtype=torch.int16)  # a real tensor of zeros is data
    with pytest.raises(VerifyError, match="table entry 255"):
        verify(graph)


def test_the_converted_seeds_verify_with_their_real_values() -> None:
    for name in ("converted:vision:bayes", "converted:vision:bernoulli2", "converted:math:bayes"):
        text, constants = _seed(name)
        verify(parse_graph(text, constants=constants))


def test_constant_value_mutations_are_refused_or_run() -> None:
    """200 value mutations of the converted seeds: every one is refused by verify or runs."""
    seeds = [s for s in seed_texts() if s[0].startswith("converted:")]
    rng = random.Random(5)
    outcomes: dict[str, int] = {}
    for i in range(200):
        _, text, constants = seeds[rng.randrange(len(seeds))]
        mutated, _ = mutate_constants(constants, rng, read_constants(text))
        outcome, detail = run_case(text, i, constants=mutated)
        assert outcome in OK_CLASSES, (outcome, detail)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("verify-error", 0) > 20 and outcomes.get("ran", 0) > 20, outcomes


def _qadd(shape: tuple[int, ...], out_scale: float, method: str = "add") -> str:
    dims = "x".join(map(str, shape))
    return f"""graph @m(%x: tensor<{dims}xqi8,scale=[0.05]>, %y: tensor<{dims}xqi8,scale=[0.05]>) {{
  %z: tensor<{dims}xqi8,scale=[{out_scale}]> = qadd(%x, %y, method="{method}", \
out=QuantSpec(scale=({out_scale},)), in_scales=(0.05, 0.05), march="bayes") @add
  return %z
}}"""


@pytest.mark.parametrize("shape", [(2, 8), (1, 64, 512, 512)], ids=["small", "16M elements"])
def test_functional_requant_limits_are_checked_at_any_size(shape: tuple[int, ...]) -> None:
    """The FloatFunctional's scale rules run on operands shrunk to one element per dimension,
    so a 16M-element add is checked like a small one, without allocating it."""
    import qir.nn.quantized  # noqa: F401  (registers the integer modules the probe rebuilds)

    verify(parse_graph(_qadd(shape, 0.1)))
    with pytest.raises(VerifyError, match=r"%z \(module add\): op 'qadd' fails on its operand types"):
        verify(parse_graph(_qadd(shape, 1e-12)))


def test_a_mean_probe_keeps_the_reduced_dims() -> None:
    """``mean`` folds 1/n into its multiplier: the probe keeps the n reduced elements."""
    import qir.nn.quantized  # noqa: F401

    def mean(n: int, out_scale: float) -> str:
        return f"""graph @m(%x: tensor<4x{n}xqi8,scale=[0.05]>) {{
  %z: tensor<4xqi8,scale=[{out_scale}]> = qreduce(%x, method="mean", \
out=QuantSpec(scale=({out_scale},)), in_scales=(0.05,), march="bayes", dim=(1,)) @m
  return %z
}}"""

    # 0.05 / (100000 * 1e-7) = 5 is a fine ratio; over one element (a probe that shrank n) it is not
    verify(parse_graph(mean(100_000, 1e-7)))
    with pytest.raises(VerifyError, match="exceeds the multiplier limit"):
        verify(parse_graph(mean(100_000, 1e-12)))
