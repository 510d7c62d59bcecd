"""Types: text form round trip (hypothesis), validation errors, torch dtype mapping."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qir.ir.types import (
    UNKNOWN_DIM,
    DType,
    ObjectType,
    QuantSpec,
    ScalarType,
    SequenceType,
    TensorType,
    Type,
    format_type,
    parse_type,
    type_of,
)

_scales = st.floats(min_value=1e-12, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def tensor_types(draw: Callable[[st.SearchStrategy[Any]], Any]) -> TensorType:
    shape = tuple(draw(st.lists(st.integers(UNKNOWN_DIM, 9), max_size=4)))  # -1: an unknown dimension
    dtype = draw(st.sampled_from(list(DType)))
    if not dtype.is_quantized or not draw(st.booleans()):
        return TensorType(shape, dtype)
    axes = [a for a, n in enumerate(shape) if n > 0]
    if axes and draw(st.booleans()):  # per-channel along an axis
        axis = draw(st.sampled_from(axes))
        scales = draw(st.lists(_scales, min_size=shape[axis], max_size=shape[axis]))
        return TensorType(shape, dtype, QuantSpec(scales, dtype, axis))
    return TensorType(shape, dtype, QuantSpec(draw(_scales), dtype))


types: st.SearchStrategy[Type] = st.recursive(
    st.one_of(
        tensor_types(),
        st.sampled_from([ScalarType("int"), ScalarType("float"), ScalarType("bool")]),
        st.sampled_from([ObjectType("NoneType"), ObjectType("torch.device"), ObjectType("dtype")]),
    ),
    lambda inner: st.builds(
        SequenceType, st.lists(inner, max_size=3).map(tuple), st.sampled_from(["tuple", "list", "size"])
    ),
    max_leaves=6,
)


@given(types)
def test_format_parse_round_trip(t: Type) -> None:
    text = format_type(t)
    assert " " not in text  # the graph text relies on types being one word
    assert parse_type(text) == t
    assert format_type(parse_type(text)) == text


def test_quantized_per_channel_text() -> None:
    t = TensorType((2, 3), DType.qint8, QuantSpec([0.1, 0.25], DType.qint8, axis=0))
    assert format_type(t) == "tensor<2x3xqi8,scale=[0.1,0.25],axis=0>"
    assert parse_type("tensor<2x3xqint8,scale=[0.1,0.25],axis=0>") == t  # enum names also accepted


def test_scale_text_is_exact() -> None:
    s = 1 / 3 * 1e-7
    t = TensorType((1,), DType.qint16, QuantSpec(s, DType.qint16))
    parsed = parse_type(format_type(t))
    assert isinstance(parsed, TensorType) and parsed.quant is not None
    (back,) = parsed.quant.scale
    assert back == s


def test_scalar_and_sequences() -> None:
    assert format_type(TensorType((), DType.int64)) == "tensor<i64>"
    assert format_type(SequenceType((TensorType((1,)), ScalarType("int")), "list")) == "list<tensor<1xf32>,int>"
    assert parse_type("tuple<>") == SequenceType((), "tuple")


@pytest.mark.parametrize(
    "text, message",
    [
        ("tensor<2xf33>", "unknown dtype"),
        ("tensor<2xf32", "expected >"),
        ("tensor<2xf32,zp=[1]>", "unknown tensor field"),
        ("tensor<2xf32> junk", "trailing"),
        ("blob", "unexpected"),
    ],
)
def test_parse_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_type(text)


def test_quant_spec_validation() -> None:
    with pytest.raises(ValueError, match="must be quantized"):
        QuantSpec(0.1, DType.float32)
    with pytest.raises(ValueError, match="zero_point"):
        QuantSpec(0.1, DType.qint8, zero_point=3)
    with pytest.raises(ValueError, match="set axis"):
        QuantSpec([0.1, 0.2], DType.qint8)
    with pytest.raises(ValueError, match="positive"):
        QuantSpec(-1.0, DType.qint8)
    with pytest.raises(ValueError, match="positive"):
        QuantSpec(math.nan, DType.qint8)
    with pytest.raises(ValueError, match="3 scales but axis 0 has 2"):
        TensorType((2, 2), DType.qint8, QuantSpec([1.0, 1.0, 1.0], DType.qint8, 0))
    with pytest.raises(ValueError, match="disagrees"):
        TensorType((2,), DType.qint16, QuantSpec(1.0, DType.qint8))


def test_dtype_mapping() -> None:
    assert DType.qint8.to_torch() is torch.int8
    assert DType.from_torch(torch.float32) is DType.float32
    assert DType.qint16.qrange == (-32768, 32767)
    with pytest.raises(ValueError, match="not a quantized dtype"):
        _ = DType.float32.qrange
    with pytest.raises(ValueError, match="no IR dtype"):
        DType.from_torch(torch.complex64)


def test_type_of_runtime_values() -> None:
    assert type_of(torch.zeros(2, 3)) == TensorType((2, 3))
    assert type_of(True) == ScalarType("bool")
    assert type_of((1, 2.0)) == SequenceType((ScalarType("int"), ScalarType("float")), "tuple")
    assert type_of(torch.Size([4])) == SequenceType((ScalarType("int"),), "size")
    assert type_of(None) == ObjectType("NoneType")
