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


def _int16_linear(weights: list[torch.Tensor], bias: list[int], mult: list[int], shift: list[int]) -> dict:
    return {
        "weight": torch.stack(weights).to(torch.int8),
        "bias": torch.tensor(bias, dtype=torch.int32),
        "multiplier": torch.tensor(mult),
        "shift": torch.tensor(shift),
    }


def test_the_int64_bound_pairs_each_channel_with_its_own_multiplier() -> None:
    """A channel of large weights with a small multiplier next to one of small weights with a
    31-bit multiplier (a large int16 layer): the worst weights times the worst multiplier would
    pass 2**63, but no channel's own accumulator times its own multiplier does."""
    x = TensorType((1, 4096), DType.qint16)
    big, small = torch.full((4096,), -128), torch.ones(4096)
    # channel 0: 4096 * 128 * 2**15 = 2**34 (x 2**20: 2**54); channel 1: 4096 * 2**15 = 2**27 (x 2**31: 2**58)
    check_linear_state("qconv", _int16_linear([big, small], [0, 0], [2**20, 2**31 - 1], [40, 40]), x, DType.qint16)
    with pytest.raises(Exception, match=r"output channel 0: .* beyond int64"):
        check_linear_state("qconv", _int16_linear([big, small], [0, 0], [2**31 - 1, 2**20], [40, 40]), x, DType.qint16)


@pytest.mark.parametrize(
    ("bias", "shift", "fits"),
    [(2, 0, True), (3, 0, False), (2, 1, True), (2, 2, False)],
    ids=["2**63-2", "2**63+2**31-3", "2**63-2 + half 1", "2**63-2 + half 2"],
)
def test_the_int64_bound_is_exact_at_2_63(bias: int, shift: int, fits: bool) -> None:
    """acc <= 1024 * 128 * 2**15 + bias = 2**32 + bias; times 2**31 - 1 plus the rounding half
    2**(shift - 1): 2**63 - 2 (+1) fits, one more (bias 3, or a half of 2) does not."""
    x = TensorType((1, 1024), DType.qint16)
    state = _int16_linear([torch.full((1024,), -128)], [bias], [2**31 - 1], [shift])
    if fits:
        check_linear_state("qconv", state, x, DType.qint16)
    else:
        with pytest.raises(Exception, match=r"output channel 0: the accumulator \(<= 42949672\d\d"):
            check_linear_state("qconv", state, x, DType.qint16)


def test_a_grouped_transposed_conv_sums_each_output_channels_own_weights() -> None:
    """conv_transpose2d weights are (in, out / groups, kh, kw): output channel g * (out / groups) + j
    reads group g's input channels through column j, and only those count in its bound."""
    from qir.ir.ops.integer_values import _channel_l1

    w = torch.randint(-128, 128, (6, 2, 3, 3), generator=torch.Generator().manual_seed(0)).to(torch.int8)
    got = _channel_l1(w, out_axis=1, groups=3)
    want = [int(w[g * 2 : g * 2 + 2, j].to(torch.int64).abs().sum()) for g in range(3) for j in range(2)]
    assert got.tolist() == want
    assert _channel_l1(w, out_axis=0, groups=3).tolist() == [int(r.to(torch.int64).abs().sum()) for r in w]


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


def _mean(n: int, out_scale: float) -> str:
    return f"""graph @m(%x: tensor<4x{n}xqi8,scale=[0.05]>) {{
  %z: tensor<4xqi8,scale=[{out_scale}]> = qreduce(%x, method="mean", \
out=QuantSpec(scale=({out_scale},)), in_scales=(0.05,), march="bayes", dim=(1,)) @m
  return %z
}}"""


def test_a_mean_probe_keeps_the_reduced_dims() -> None:
    """``mean`` folds 1/n into its multiplier: the probe keeps the n reduced elements."""
    import qir.nn.quantized  # noqa: F401

    mean = _mean
    # 0.05 / (100000 * 1e-7) = 5 is a fine ratio; over one element (a probe that shrank n) it is not
    verify(parse_graph(mean(100_000, 1e-7)))
    with pytest.raises(VerifyError, match="exceeds the multiplier limit"):
        verify(parse_graph(mean(100_000, 1e-12)))


@pytest.mark.parametrize("n", [2**20 + 1, 2**30])
def test_a_mean_over_more_than_2_20_elements_is_still_checked(n: int) -> None:
    """Past the probe's element limit the mean's rules run on meta tensors of the kept shape:
    the ratio 0.05 / (n * s_out) is checked for the real ``n``, on both sides of the limit,
    without allocating the reduced elements."""
    import qir.nn.quantized  # noqa: F401

    fine = 0.05 / n  # ratio 1: a fine multiplier for this n, but 2**20+ too big over one element
    verify(parse_graph(_mean(n, fine)))
    too_small = 0.05 / n / 40_000  # ratio 40,000 > the 32,767 multiplier limit
    with pytest.raises(VerifyError, match=r"%z \(module m\): .*exceeds the multiplier limit"):
        verify(parse_graph(_mean(n, too_small)))
