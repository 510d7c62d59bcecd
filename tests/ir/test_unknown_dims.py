"""Unknown dimensions (``?``): text form, typing at two sizes, what the verifier accepts and refuses."""

from __future__ import annotations

import pytest
import torch

from qir.ir import IRError, VerifyError, parse_graph, verify
from qir.ir.ops.shape import Chunk
from qir.ir.types import UNKNOWN_DIM, DType, QuantSpec, SequenceType, TensorType, dims_agree, parse_type
from qir.ir.unknown_dims import infer_type, merge_types

U = UNKNOWN_DIM


def test_text_form() -> None:
    t = parse_type("tensor<?x3x?x?xqi8,scale=[0.5]>")
    assert t == TensorType((U, 3, U, U), DType.qint8, QuantSpec(0.5))
    assert str(t) == "tensor<?x3x?x?xqi8,scale=[0.5]>"
    for bad in ("tensor<-1x3xf32>", "tensor<+3xf32>", "tensor<??xf32>", "tensor<3_0xf32>"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_type(bad)


def test_type_rules() -> None:
    t = TensorType((U, 4))
    assert t.has_unknown_dims and t.rank == 2
    assert t.admits((7, 4)) and not t.admits((7, 5)) and not t.admits((4,))
    with pytest.raises(ValueError, match="element count is not known"):
        _ = t.numel
    with pytest.raises(ValueError, match="must be >= 0"):
        TensorType((-2, 4))
    with pytest.raises(ValueError, match="a per-channel axis needs its size"):
        TensorType((U, 2), DType.qint8, QuantSpec((0.1, 0.2), DType.qint8, 0))
    assert dims_agree((U, 3), (5, 3)) and dims_agree((5, U), (5, 3)) and not dims_agree((U, 3), (U, 4))


def test_merge_keeps_what_both_sizes_agree_on() -> None:
    a, b = TensorType((840, 4, 1)), TensorType((1680, 4, 1))
    assert merge_types(a, b) == TensorType((U, 4, 1))
    with pytest.raises(IRError, match="how many results"):
        merge_types(SequenceType((a, a)), SequenceType((a,)))
    with pytest.raises(IRError, match="rank or dtype"):
        merge_types(a, TensorType((1, 2)))


def test_conv_and_pool_shapes_propagate_unknowns() -> None:
    g = parse_graph(
        "graph @m(%x: tensor<?x3x?x?xf32>) {\n"
        '  %w: tensor<8x3x3x3xf32> = constant(key="w")\n'
        "  %c = conv2d(%x, %w, stride=(2, 2), padding=(1, 1), bias=False)\n"
        "  %p = adaptive_avg_pool2d(%c, output_size=(1, 1))\n"
        "  %f = flatten(%p, start_dim=1)\n"
        "  return %f\n}",
        constants={"w": torch.zeros(8, 3, 3, 3)},
    )
    verify(g)
    assert [str(n.type) for n in g.nodes][1:] == ["tensor<?x8x?x?xf32>", "tensor<?x8x1x1xf32>", "tensor<?x8xf32>"]


def test_chunk_of_an_unknown_size_is_refused_and_of_a_known_one_typed() -> None:
    with pytest.raises(IRError, match=r"chunk\(2\) along dim 2 of unknown size"):
        infer_type(Chunk(chunks=2, dim=2), [TensorType((U, 4, U))])
    pieces = infer_type(Chunk(chunks=2, dim=1), [TensorType((U, 4, U))])
    assert pieces == SequenceType((TensorType((U, 2, U)), TensorType((U, 2, U))))


def test_verifier_accepts_declared_sizes_where_inference_has_none() -> None:
    # flatten of an unknown spatial size gives ?x?; the graph may know more (a linear's in_features)
    g = parse_graph(
        "graph @m(%x: tensor<?x4x?x?xf32>) {\n"
        '  %w: tensor<2x16xf32> = constant(key="w")\n'
        "  %f: tensor<?x16xf32> = flatten(%x, start_dim=1)\n"
        "  %y: tensor<?x2xf32> = linear(%f, %w, bias=False)\n"
        "  return %y\n}",
        constants={"w": torch.zeros(2, 16)},
    )
    verify(g)
    bad = parse_graph(
        "graph @m(%x: tensor<?x4x?x?xf32>) {\n  %f: tensor<?x16x1xf32> = flatten(%x, start_dim=1)\n  return %f\n}"
    )
    with pytest.raises(
        VerifyError, match="declared type tensor<\\?x16x1xf32> but op 'flatten' gives tensor<\\?x\\?xf32>"
    ):
        verify(bad)
