"""The IR's quantization ops: semantics against qir.ir.numerics, verifier rules, text round trip."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qir.ir import DType, Graph, IRError, QuantSpec, TensorType, parse_graph, print_graph, verify
from qir.ir.interpreter import run_graph
from qir.ir.numerics import dequantize, quantize
from qir.ir.ops.quant import Dequantize, FakeQuant, ObserverSpec, Quantize, Requantize


def _fq_graph(shape: tuple[int, ...], scale: torch.Tensor, spec: ObserverSpec) -> Graph:
    g = Graph("fq")
    x = g.add_input("x", TensorType(shape, DType.float32))
    s = g.add_constant("fq.scale", scale, kind="buffer")
    g.set_output(g.add_node(FakeQuant(spec), [x, s], scope="fq"))
    return g


def test_fake_quant_is_quantize_then_dequantize_per_tensor_and_per_channel() -> None:
    x = torch.randn(2, 3, 4, 4) * 3
    g = _fq_graph((2, 3, 4, 4), torch.tensor([0.02]), ObserverSpec())
    assert torch.equal(run_graph(g, x), dequantize(quantize(x, 0.02, "qint8"), 0.02))
    sc = torch.tensor([0.01, 0.02, 0.04])
    g = _fq_graph((2, 3, 4, 4), sc, ObserverSpec(observer="minmax", dtype=DType.qint16, axis=1))
    verify(g)
    assert torch.equal(run_graph(g, x), dequantize(quantize(x, sc, "qint16", axis=1), sc, axis=1))


def test_fake_quant_rounds_half_up_and_saturates() -> None:
    g = _fq_graph((4,), torch.tensor([1.0]), ObserverSpec())
    assert run_graph(g, torch.tensor([0.5, -0.5, 200.0, -200.0])).tolist() == [1.0, 0.0, 127.0, -128.0]


def test_quantize_dequantize_requantize_chain() -> None:
    g = Graph("q")
    x = g.add_input("x", TensorType((8,), DType.float32))
    spec = QuantSpec((0.05,), DType.qint8)
    q = g.add_node(Quantize(spec), [x])
    out = QuantSpec((0.1,), DType.qint8)
    rq = g.add_node(Requantize(out, (1,), (1,)), [q])  # x / 2, half up
    g.set_output(g.add_node(Dequantize(out), [rq]))
    verify(g)
    assert q.type == TensorType((8,), DType.qint8, spec)
    xs = torch.tensor([0.05, 0.15, -0.05, -0.15, 1.0, 100.0, -100.0, 0.0])
    codes = quantize(xs, 0.05, "qint8").to(torch.int64)
    want = torch.div(codes + 1, 2, rounding_mode="floor").clamp(-128, 127).float() * 0.1
    assert torch.equal(run_graph(g, xs), want)


def test_requantize_per_channel() -> None:
    g = Graph("rq")
    acc_t = TensorType((1, 2, 1, 1), DType.qint32, QuantSpec((1e-4, 2e-4), DType.qint32, axis=1))
    a = g.add_input("acc", acc_t)
    g.set_output(g.add_node(Requantize(QuantSpec((0.1,)), (3, 5), (2, 3), axis=1), [a]))
    verify(g)
    out = run_graph(g, torch.tensor([[[[10]], [[10]]]], dtype=torch.int32))
    assert out.dtype == torch.int8
    assert out.reshape(-1).tolist() == [8, 6]  # (30+2)>>2, (50+4)>>3


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda g, x: g.add_node(Dequantize(QuantSpec((0.5,))), [x]), "must be a quantized tensor"),
        (lambda g, x: g.add_node(Requantize(QuantSpec((0.5,)), (1,), (1,)), [x]), "must be a quantized tensor"),
        (
            lambda g, x: g.add_node(Quantize(QuantSpec((0.5, 0.25), axis=0)), [x]),
            "2 scales but axis 0",
        ),
        (
            lambda g, x: g.add_node(
                FakeQuant(ObserverSpec(), state=("min_val",)), [x, g.add_constant("s", torch.ones(1))]
            ),
            "state must start with 'scale'",
        ),
        (
            lambda g, x: g.add_node(FakeQuant(ObserverSpec()), [x, g.add_constant("s", torch.ones(3))]),
            "need a channel axis",
        ),
    ],
)
def test_verifier_names_the_rule(build: object, message: str) -> None:
    g = Graph("bad")
    x = g.add_input("x", TensorType((4, 2), DType.float32))
    with pytest.raises(IRError, match=message):
        n = build(g, x)  # type: ignore[operator]
        g.set_output(n)
        verify(g)


def test_requantize_refuses_bad_parameters_when_built() -> None:
    with pytest.raises(IRError, match="same, non-zero length"):
        Requantize(QuantSpec((0.5,)), (1, 2), (3,))
    with pytest.raises(IRError, match=r"shifts must be in 0\.\.62"):
        Requantize(QuantSpec((0.5,)), (1,), (99,))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": DType.qint32}, "qint32 is a high-precision output"),
        ({"observer": "not a name"}, "must be an identifier"),
        ({"options": {"k": object()}}, "must be a literal"),
        ({"options": {"k": float("nan")}}, "must be finite"),
    ],
)
def test_observer_spec_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ObserverSpec(**kwargs)  # type: ignore[arg-type]


def test_observer_spec_options_are_order_independent() -> None:
    a = ObserverSpec(options={"b": 1, "a": (1, 2)})
    b = ObserverSpec(options=[("a", (1, 2)), ("b", 1)])
    assert a == b and a.option("a") == (1, 2) and a.option("zz", 3) == 3


_specs = st.builds(
    ObserverSpec,
    observer=st.sampled_from(["minmax", "moving_average_minmax", "percentile", "fixed_scale"]),
    dtype=st.sampled_from([DType.qint8, DType.qint16]),
    axis=st.none(),
    options=st.dictionaries(
        st.sampled_from(["averaging_constant", "percentile", "bins", "symmetric", "name"]),
        st.one_of(
            st.floats(allow_nan=False, allow_infinity=False, width=32),
            st.integers(-(2**40), 2**40),
            st.booleans(),
            st.text("abc_ \"'\\", max_size=5),
        ),
        max_size=3,
    ),
)


@given(spec=_specs, scale=st.floats(2.0**-20, 8.0, width=32), shift=st.integers(0, 31), mult=st.integers(1, 32767))
def test_quant_ops_print_parse_print(spec: ObserverSpec, scale: float, shift: int, mult: int) -> None:
    g = Graph("rt")
    x = g.add_input("x", TensorType((2, 3), DType.float32))
    s = g.add_constant("a.scale", torch.tensor([scale]), kind="buffer")
    fq = g.add_node(FakeQuant(spec), [x, s], scope="a")
    qs = QuantSpec((scale,), spec.dtype)
    q = g.add_node(Quantize(qs), [fq])
    out = QuantSpec((scale * 2,), DType.qint8)
    rq = g.add_node(Requantize(out, (mult,), (shift,)), [q])
    g.set_output(g.add_node(Dequantize(out), [rq]))
    verify(g)
    text = print_graph(g)
    again = parse_graph(text, constants=g.constants)
    assert print_graph(again) == text
    xs = torch.randn(2, 3)
    assert torch.equal(run_graph(again, xs), run_graph(g, xs))
