"""What verify accepts runs: dtype agreement, operand shapes and kinds, defaults, opaque calls.

Each text here verified before these rules and then failed inside torch at run time.
The property test draws random verified graphs, mutates them, and checks verify-ok => run-ok.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qir.ir import DType, Graph, IRError, TensorType, Value, VerifyError, parse_graph, run_graph, verify
from qir.ir.types import ScalarType
from qir.testing import graphs, inputs_for

_CONV = """graph @m(%x: tensor<1x3x4x4xf32>) {{
  %w: tensor<4x3x3x3xf32> = constant(key="w")
  %b: {bias} = constant(key="b")
  %y: tensor<1x4x4x4xf32> = conv2d(%x, %w, %b, padding=(1, 1))
  return %y
}}"""

_BN = """graph @m(%x: tensor<1x4x2x2xf32>) {{
  %g: tensor<4xf32> = constant(key="g")
  %b: tensor<4xf32> = constant(key="b")
  %m: {mean} = constant(key="m", kind="buffer")
  %v: tensor<4xf32> = constant(key="v", kind="buffer")
  %n: tensor<i64> = constant(key="n", kind="buffer")
  %y: tensor<1x4x2x2xf32> = batch_norm(%x, %g, %b, %m, %v, %n)
  return %y
}}"""


def _verify_then_run(text: str) -> Any:
    g = parse_graph(text, allow_unbound=True)
    verify(g)
    g.constants.update({k: torch.zeros_like(t) for k, t in g.constants.items()})  # data, not stand-ins
    return run_graph(g, *[torch.zeros(a.type.shape) for a in g.inputs if isinstance(a.type, TensorType)])


def test_good_conv_and_batch_norm_run() -> None:
    _verify_then_run(_CONV.format(bias="tensor<4xf32>"))
    _verify_then_run(_BN.format(mean="tensor<4xf32>"))


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ("tensor<3xf32>", r"bias is tensor<3xf32> but the weight tensor<4x3x3x3xf32> gives 4 output channels"),
        ("tensor<4x1xf32>", "gives 4 output channels"),
        ("tensor<4xbool>", "bias is tensor<4xbool> but the input is f32"),
        ("tensor<4xf64>", "needs the same float dtype"),
    ],
)
def test_conv_bias_length_and_dtype(bias: str, message: str) -> None:
    with pytest.raises(VerifyError, match=message) as e:
        verify(parse_graph(_CONV.format(bias=bias), allow_unbound=True))
    assert e.value.node == "y"


@pytest.mark.parametrize(
    ("mean", "message"),
    [("tensor<3xf32>", "running_mean is tensor<3xf32> but the input has 4 channels"), ("tensor<4xi8>", "same float")],
)
def test_batch_norm_state_length_and_dtype(mean: str, message: str) -> None:
    with pytest.raises(VerifyError, match=message):
        verify(parse_graph(_BN.format(mean=mean), allow_unbound=True))


def test_conv_input_channels_come_from_meta_inference() -> None:
    text = _CONV.format(bias="tensor<4xf32>").replace("1x3x4x4xf32>)", "1x5x4x4xf32>)")
    with pytest.raises(VerifyError, match="rejects its operand types"):
        verify(parse_graph(text, allow_unbound=True))


def test_elementwise_does_not_mix_quantized_and_float() -> None:
    text = (
        "graph @m(%x: tensor<4xf32>, %q: tensor<4xqi8,scale=[0.5]>) {\n"
        "  %y: tensor<4xf32> = add(%x, %q)\n  return %y\n}"
    )
    with pytest.raises(VerifyError, match="mixes quantized and float tensors"):
        verify(parse_graph(text))


def test_operand_of_the_wrong_kind() -> None:
    text = 'graph @m(%x: tensor<4xf32>, %s: !str = "a") {\n  %y: tensor<4xf32> = relu(%s)\n  return %y\n}'
    with pytest.raises(VerifyError, match="operand 0 must be a tensor"):
        verify(parse_graph(text))
    text = "graph @m(%x: tensor<4xf32>, %s: float) {\n  %y: tensor<4xf32> = minimum(%x, %s, other=%s)\n  return %y\n}"
    with pytest.raises(VerifyError, match="rejects its operand kinds: TypeError"):
        verify(parse_graph(text))


def test_input_default_must_match_its_type() -> None:
    text = "graph @m(%x: tensor<4xf32>, %s: float = (0.5,)) {\n  return %x\n}"
    with pytest.raises(VerifyError, match=r"%s: default \(0.5,\) is not a value of the declared type float"):
        verify(parse_graph(text))
    for ok in ("float = 1", "int = 2", "bool = True", "tuple<int,float> = (1, 2.0)", "!NoneType = None"):
        verify(parse_graph(f"graph @m(%x: tensor<4xf32>, %s: {ok}) {{\n  return %x\n}}"))
    with pytest.raises(VerifyError):
        verify(parse_graph("graph @m(%x: tensor<4xf32>, %s: int = True) {\n  return %x\n}"))


def test_sequence_results_are_compared_element_by_element() -> None:
    text = (
        "graph @m(%x: tensor<2x6xf32>) {\n"
        "  %c: tuple<tensor<2x2xf32>,tensor<2x2xf32>,tensor<2x2xf32>> = chunk(%x, chunks=2, dim=-1)\n"
        "  return %c\n}"
    )
    with pytest.raises(VerifyError, match="3 elements declared, 2 produced"):
        verify(parse_graph(text))
    tensor_for_tuple = "graph @m(%x: tensor<2x6xf32>) {\n  %c: tensor<2x6xf32> = topk(%x, k=1)\n  return %c\n}"
    with pytest.raises(VerifyError, match="declared type tensor<2x6xf32>"):
        verify(parse_graph(tensor_for_tuple))


def test_sizes_read_from_static_shapes_make_checks_exact() -> None:
    text = (
        "graph @m(%x: tensor<2x5x8xf32>) {\n"
        '  %s: size<int,int,int> = getattr(%x, attr="shape")\n'
        "  %n: int = getitem(%s, index=0)\n"
        "  %r: tensor<2x40xf32> = reshape(%x, %n, shape=(%n, LAST))\n"
        "  return %r\n}"
    )
    verify(parse_graph(text.replace("LAST", "-1")))
    with pytest.raises(VerifyError, match=r"%r: op 'reshape' rejects its operands: RuntimeError: shape '\[2, 3\]'"):
        verify(parse_graph(text.replace("LAST", "3")))


def test_getitem_of_a_sequence_needs_an_int_or_slice() -> None:
    text = (
        'graph @m(%x: tensor<2x5xf32>) {\n  %s: size<int,int> = getattr(%x, attr="shape")\n'
        "  %n: int = getitem(%s, index=(0,))\n  return %n\n}"
    )
    with pytest.raises(VerifyError, match="takes an int or slice index"):
        verify(parse_graph(text))


def test_attribute_of_the_wrong_kind_is_a_verify_error() -> None:
    text = (
        "graph @m(%a: tensor<1x3x2x2xqi32,scale=[0.1,0.1,0.1],axis=1>) {\n"
        "  %y: tensor<1x3x2x2xqi8,scale=[0.5]> = requantize(%a, spec=QuantSpec(scale=(0.5,)), "
        "multiplier=(1, 1, 1), shift=(1, 1, 1), axis=0.0)\n  return %y\n}"
    )
    with pytest.raises(VerifyError, match="rejects its attributes: TypeError"):
        verify(parse_graph(text))


def test_opaque_calls_of_torch_functions_run_on_meta() -> None:
    text = (
        "graph @m(%x: tensor<4x6xf32>) {\n"
        '  %y: tensor<4x6xf32> = call(%x, %x, kind="function", target="torch.addcmul", args=(%x, %x, %1), '
        'kwargs={"value": {value}})\n  return %y\n}'
    )
    verify(parse_graph(text.replace("{value}", "-0.5")))
    with pytest.raises(VerifyError, match="without overflow"):
        verify(parse_graph(text.replace("{value}", "1e308")))
    missing_receiver = (
        'graph @m(%x: tensor<2xf32>) {\n  %y: tensor<2xf32> = call(%x, kind="method", target="add_")\n  return %y\n}'
    )
    with pytest.raises(VerifyError, match="needs its receiver as args"):
        verify(parse_graph(missing_receiver))
    wrong_shape = (
        "graph @m(%x: tensor<2x3xf32>) {\n"
        '  %y: tensor<2x3xf32> = call(%x, kind="function", target="torch.flatten", args=(%x,))\n  return %y\n}'
    )
    with pytest.raises(VerifyError, match=r"declared type tensor<2x3xf32> but op 'call' gives tensor<6xf32>"):
        verify(parse_graph(wrong_shape))


def test_user_functions_are_never_run_by_verify() -> None:
    calls: list[Any] = []
    text = (
        "graph @m(%x: tensor<2xf32>) {\n"
        '  %y: tensor<2xf32> = call(%x, kind="function", target="mine", args=(%x,))\n  return %y\n}'
    )
    verify(parse_graph(text, objects={"mine": lambda x: calls.append(x) or x}))
    assert calls == []


def test_constant_dtype_must_match_its_declaration() -> None:
    text = 'graph @m(%x: tensor<2xf32>) {\n  %w: tensor<2xf32> = constant(key="w")\n  %y = add(%x, %w)\n  return %y\n}'
    with pytest.raises(VerifyError, match=r"has dtype torch\.int64, declared tensor<2xf32>"):
        verify(parse_graph(text, {"w": torch.zeros(2, dtype=torch.long)}))


# ----------------------------------------------------------------------------- verify-ok => run-ok

_DTYPES = [DType.float32, DType.float64, DType.float16, DType.int64, DType.int8, DType.bool, DType.qint8]


def _retype(g: Graph, v: Value, t: TensorType) -> None:
    v.type = t
    if getattr(v, "op", None) is not None and v.op.name == "constant":  # type: ignore[attr-defined]
        key = v.op.key  # type: ignore[attr-defined]
        g.constants[key] = torch.ones(t.shape, dtype=t.dtype.to_torch())


def mutate_graph(g: Graph, data: st.DataObject) -> str:
    """One edit a careless hand or a hostile file could make; returns what it did."""
    values = [*g.inputs, *g.nodes]
    tensors = [v for v in values if isinstance(v.type, TensorType)]
    nodes = list(g.nodes)
    kind = data.draw(st.sampled_from(("dtype", "shape", "rewire", "rank", "scalar")))
    if kind in ("dtype", "shape", "rank"):
        v = data.draw(st.sampled_from(tensors))
        t = v.type
        assert isinstance(t, TensorType)
        if kind == "dtype":
            d = data.draw(st.sampled_from(_DTYPES))
            quant = None
            if d.is_quantized:
                from qir.ir import QuantSpec

                quant = QuantSpec((0.5,), d)
            _retype(g, v, TensorType(t.shape, d, quant))
        elif kind == "shape" and t.shape:
            i = data.draw(st.integers(0, len(t.shape) - 1))
            shape = list(t.shape)
            shape[i] = max(1, shape[i] + data.draw(st.sampled_from((-1, 1, 2))))
            _retype(g, v, TensorType(tuple(shape), t.dtype))
        else:
            _retype(g, v, TensorType(t.shape[1:] if t.shape else (2,), t.dtype))
        return f"{kind} of %{v.name}"
    if kind == "rewire" and nodes:
        n = data.draw(st.sampled_from([n for n in nodes if n.operands] or nodes))
        if n.operands:
            i = data.draw(st.integers(0, len(n.operands) - 1))
            earlier = [v for v in values if v is not n and values.index(v) < values.index(n)]
            n.set_operand(i, data.draw(st.sampled_from(earlier)))
        return f"rewire %{n.name}"
    # a scalar input where a tensor was
    x = g.inputs[0]
    x.type = ScalarType(data.draw(st.sampled_from(("int", "float", "bool"))))
    return "scalar input"


@given(
    graphs(ops=("conv2d", "batch_norm", "add", "mul", "relu", "linear", "cat", "matmul", "max_pool2d"), max_nodes=5),
    st.data(),
)
def test_verified_mutants_run(g: Graph, data: st.DataObject) -> None:
    verify(g)
    what = mutate_graph(g, data)
    try:
        verify(g)
    except VerifyError:
        return
    inputs = data.draw(inputs_for(g))
    try:
        run_graph(g, *inputs)
    except IRError as e:
        raise AssertionError(f"after {what}, verify accepted a graph that fails to run: {e}\n{g}") from None


def test_matmul_operands_share_a_float_dtype() -> None:
    text = "graph @m(%a: tensor<2x3xf32>, %b: tensor<3x2xDT>) {\n  %y: tensor<2x2xf32> = matmul(%a, %b)\n  return %y\n}"
    verify(parse_graph(text.replace("DT", "f32")))
    with pytest.raises(VerifyError, match=r"needs operands of one dtype .* f32, f64"):
        verify(parse_graph(text.replace("DT", "f64")))


def test_a_tuple_where_an_op_takes_a_tensor_is_refused() -> None:
    """``matmul(%chunk, ...)``: the chunks' tuple, not one chunk (found by fuzz_ir)."""
    text = """graph @m(%a: tensor<2x4xf32>, %b: tensor<2x2xf32>) {
  %c: tuple<tensor<2x2xf32>,tensor<2x2xf32>> = chunk(%a, chunks=2, dim=1)
  %p: tensor<2x2xf32> = getitem(%c, index=0)
  %y: tensor<2x2xf32> = matmul(%X, %b)
  return %y
}"""
    verify(parse_graph(text.replace("%X", "%p")))
    with pytest.raises(VerifyError, match=r"%y: op 'matmul' rejects its operand kinds: TypeError: .*not tuple"):
        verify(parse_graph(text.replace("%X", "%c")))


def test_a_tensor_read_where_the_op_gives_none_is_refused() -> None:
    """An attention layer without weights returns ``(output, None)``: element -1 is None."""
    text = """graph @m(%x: tensor<2x3xf32>) {
  %t: tuple<tensor<2x3xf32>,!NoneType> = call(%x, kind="function", target="mypkg.pair", args=(%x,))
  %w: TYPE = getitem(%t, index=INDEX)
  return %w
}"""

    def pair(x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x, None

    def parse(index: str, t: str) -> Graph:
        return parse_graph(text.replace("INDEX", index).replace("TYPE", t), objects={"mypkg.pair": pair})

    verify(parse("0", "tensor<2x3xf32>"))
    verify(parse("-1", "!NoneType"))
    for index in ("1", "-1"):
        with pytest.raises(VerifyError, match=r"declared type tensor<2x3xf32> but op 'getitem' gives !NoneType"):
            verify(parse(index, "tensor<2x3xf32>"))
