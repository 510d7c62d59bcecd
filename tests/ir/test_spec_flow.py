"""Codes moved by shape ops keep their QuantSpec in the IR's types: inference carries a
per-tensor spec through reshape / view / flatten / permute / transpose / squeeze / unsqueeze
/ chunk / getitem / cat of one spec (tests/golden/roundtrip/moved_codes.qir), the front end
types a converted model's flatten with it, and the text round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.fuzz_ir import seed_texts
from qir.ir import VerifyError, parse_graph, print_graph, verify
from qir.ir.spec_flow import adopt_specs, carry_spec, operand_spec
from qir.ir.types import DType, QuantSpec, SequenceType, TensorType
from qir.testing.golden import load_golden, run_golden

GOLDEN = Path(__file__).parent.parent / "golden" / "roundtrip" / "moved_codes.qir"
Q = QuantSpec((0.05,))


def test_the_inferred_text_round_trips() -> None:
    printed = run_golden(load_golden(GOLDEN))
    assert "%flat: tensor<2x12xqi8,scale=[0.05]> = flatten" in printed
    again = parse_graph(printed, allow_unbound=True)
    verify(again)
    assert print_graph(again) == printed


def test_a_converted_models_shape_ops_print_their_spec() -> None:
    for name, text, constants in seed_texts():
        if name == "converted:vision:bayes":
            line = next(ln for ln in text.splitlines() if "= flatten(" in ln)
            assert line.startswith("  %flatten: tensor<2x16xqi8,scale=[0.0"), line
            graph = parse_graph(text, constants=constants)
            verify(graph)
            assert print_graph(graph) == text
        if name == "converted:math:bayes":
            for op in ("getitem(%chunk, index=0)", "transpose(", "unsqueeze(", "squeeze(%ap"):
                line = next(ln for ln in text.splitlines() if op in ln)
                assert "qi8,scale=[" in line.split(" = ")[0], line


def test_only_one_per_tensor_spec_flows() -> None:
    x = TensorType((2, 3), DType.qint8, Q)
    other = TensorType((2, 3), DType.qint8, QuantSpec((0.1,)))
    plain = TensorType((2, 3), DType.int8)
    per_channel = TensorType((2, 3), DType.qint8, QuantSpec((0.1, 0.2), axis=0))
    assert operand_spec([x, x]) == Q
    assert operand_spec([x, other]) is None
    assert operand_spec([per_channel]) is None
    assert operand_spec([x, TensorType((4,), DType.int64)]) == Q  # an index operand is not codes
    assert carry_spec([x], TensorType((6,), DType.int8)) == TensorType((6,), DType.qint8, Q)
    assert carry_spec([x], TensorType((6,), DType.float32)) == TensorType((6,), DType.float32)
    pair = SequenceType((plain, plain), "tuple")
    assert carry_spec([x], pair) == SequenceType((x, x), "tuple")
    # the front end's example type takes the spec only where shape and storage agree
    assert adopt_specs(plain, x) == x
    assert adopt_specs(TensorType((3, 2), DType.int8), x) == TensorType((3, 2), DType.int8)


MOVED = ["flat", "view", "perm", "tr", "sq", "unsq", "parts", "first", "rows", "same"]


@pytest.mark.parametrize("node", MOVED)
def test_verify_refuses_another_scale_declared_on_moved_codes(node: str) -> None:
    """A shape op's result holds its operand's codes at their scale: text that declares another
    scale on it (the last one, for a tuple) fails verify naming the node and the spec."""
    printed = run_golden(load_golden(GOLDEN))
    lines = printed.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith(f"  %{node}: "))
    head, body = lines[i].split(" = ", 1)
    cut = head.rindex("scale=[0.05]")
    lines[i] = head[:cut] + "scale=[0.07]" + head[cut + len("scale=[0.05]") :] + " = " + body
    with pytest.raises(
        VerifyError,
        match=rf"^%{node}: quant: declared scale=\[0.07\] qi8(?: at \[1\])? but op '\w+' gives scale=\[0.05\] qi8",
    ):
        verify(parse_graph("\n".join(lines), allow_unbound=True))
    verify(parse_graph(printed, allow_unbound=True))  # the inferred specs verify


def test_a_spec_on_one_side_only_is_not_a_conflict() -> None:
    """A bare integer type on moved codes (the scale is upstream) and a declared spec where the
    operands' scales disagree (a cat of two scales) both still verify."""
    printed = run_golden(load_golden(GOLDEN))
    bare = printed.replace("%flat: tensor<2x12xqi8,scale=[0.05]>", "%flat: tensor<2x12xi8>")
    verify(parse_graph(bare, allow_unbound=True))
    mixed = printed.replace("%mixed: tensor<2x8x1x3xi8>", "%mixed: tensor<2x8x1x3xqi8,scale=[0.1]>")
    verify(parse_graph(mixed, allow_unbound=True))
