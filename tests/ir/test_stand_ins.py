"""Zeros ``parse_graph(allow_unbound=True)`` binds are stand-ins: verify and print read them,
nothing executes them. ``run_graph``, ``emit`` and lowering refuse a graph holding one with a
``StandInError`` naming the constants and the fix; binding real tensors ends it; constants a
pipeline derives from stand-ins are stand-ins too."""

from __future__ import annotations

import pytest
import torch

import passes
from backends.common.lower_ir import lower_ir
from benchmarks.fuzz_ir import run_case, seed_texts
from qir.frontend import emit
from qir.ir import StandInError, parse_graph, print_graph, run_graph, verify

CONV_BN = """graph @m(%x: tensor<1x3x4x4xf32>) {
  %w: tensor<4x3x3x3xf32> = constant(key="conv.weight")
  %b: tensor<4xf32> = constant(key="conv.bias")
  %g: tensor<4xf32> = constant(key="bn.weight")
  %be: tensor<4xf32> = constant(key="bn.bias")
  %m: tensor<4xf32> = constant(key="bn.running_mean", kind="buffer")
  %v: tensor<4xf32> = constant(key="bn.running_var", kind="buffer")
  %n: tensor<i64> = constant(key="bn.num_batches_tracked", kind="buffer")
  %c: tensor<1x4x2x2xf32> = conv2d(%x, %w, %b) @conv
  %y: tensor<1x4x2x2xf32> = batch_norm(%c, %g, %be, %m, %v, %n) @bn
  return %y
}"""


def _lut16_seed() -> tuple[str, dict[str, torch.Tensor]]:
    for name, text, constants in seed_texts():
        if name == "converted:lut16:bayes":
            return text, constants
    raise AssertionError("no converted:lut16:bayes seed")


def test_a_zero_filled_segmented_table_verifies_but_does_not_run() -> None:
    text, constants = _lut16_seed()
    graph = parse_graph(text, allow_unbound=True)
    verify(graph)  # shapes and dtypes: a zero-filled version-2 table16 is not checked
    assert sorted(graph.stand_ins()) == sorted(graph.constants)
    x = torch.randint(-300, 300, (2, 64), dtype=torch.int16).float() * 0.01
    with pytest.raises(StandInError) as e:
        run_graph(graph, x)
    message = str(e.value)
    assert "cannot run" in message and "zero stand-ins bound by parse_graph(allow_unbound=True)" in message
    assert "verify checked their shapes and dtypes, not their values" in message
    assert "parse_graph(text, constants={" in message
    assert set(e.value.keys) == set(graph.constants)
    assert any(k.endswith("table16") for k in e.value.keys)
    assert print_graph(graph) == print_graph(parse_graph(text, constants=constants))  # inspection works
    real = parse_graph(text, constants=constants)
    assert real.stand_ins() == []
    run_graph(real, x)


def test_binding_a_real_tensor_ends_a_stand_in_even_zeros() -> None:
    graph = parse_graph(CONV_BN, allow_unbound=True)
    assert graph.stand_ins() == list(graph.constants)
    for key in list(graph.constants)[:-1]:
        graph.constants[key] = torch.zeros_like(graph.constants[key])
    with pytest.raises(StandInError, match=r"constant\(s\) 'bn.num_batches_tracked' are zero stand-ins"):
        run_graph(graph, torch.zeros(1, 3, 4, 4))
    graph.constants["bn.num_batches_tracked"] = torch.tensor(0)
    assert graph.stand_ins() == []
    assert run_graph(graph, torch.zeros(1, 3, 4, 4)).shape == (1, 4, 2, 2)


def test_emit_and_lowering_refuse_stand_ins() -> None:
    graph = parse_graph(CONV_BN, allow_unbound=True)
    with pytest.raises(StandInError, match="graph @m cannot emit"):
        emit(graph)
    with pytest.raises(StandInError, match="graph @m cannot lower"):
        lower_ir(graph, [torch.zeros(1, 3, 4, 4)], "bayes")


def test_constants_derived_from_stand_ins_are_stand_ins() -> None:
    graph = parse_graph(CONV_BN, allow_unbound=True)
    result = passes.run_pipeline(graph, "absorb-bn,dce")
    folded = result.graph
    assert "batch_norm" not in print_graph(folded)
    assert folded.stand_ins() and folded.stand_ins() == list(folded.constants)
    with pytest.raises(StandInError):
        run_graph(folded, torch.zeros(1, 3, 4, 4))
    # with real tensors the same pipeline's result runs
    real = parse_graph(CONV_BN, constants={k: torch.ones_like(t) for k, t in graph.constants.items()})
    out = passes.run_pipeline(real, "absorb-bn,dce").graph
    assert out.stand_ins() == []
    run_graph(out, torch.zeros(1, 3, 4, 4))


def test_the_fuzzer_counts_a_kept_stand_in_as_refused() -> None:
    outcome, detail = run_case(CONV_BN, 0, keep_stand_in=True)
    assert outcome == "stand-in", (outcome, detail)
    assert run_case(CONV_BN, 0)[0] == "ran"


def test_a_pipeline_reads_its_inputs_stand_ins_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from qir.ir import stand_ins

    graph = parse_graph(CONV_BN, allow_unbound=True)
    calls: list[int] = []
    real_keys = stand_ins.stand_in_keys
    monkeypatch.setattr(stand_ins, "stand_in_keys", lambda c: calls.append(1) or real_keys(c))
    folded = passes.run_pipeline(graph, "absorb-bn,dce,dce,dce").graph
    assert len(calls) == 1  # the input's real tensors, taken before the first pass, not after each
    assert folded.stand_ins() == list(folded.constants)  # what absorb-bn derived is still marked
