"""Integer ops for LSTMCell and MultiheadAttention.

A converted model's quantized LSTM cells (with and without a state) and attention layers (self
and cross attention, sequence-first and batch-first, returned weights averaged, per head or not
at all, float / bool masks as inputs or buffers) trace to ``qlstm_cell`` /
``qmultihead_attention`` with tuple results typed by their QuantSpecs instead of opaque module
calls; run_graph and emit compute exactly what the converted model does with the same
state-dict keys; the text form round-trips; bad fields and operands are refused naming the op;
the legality reports equal those of the same model traced with the modules kept opaque; the
compiled program equals the model.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch import nn

from qir.frontend import trace
from qir.ir import IRError, print_graph
from qir.ir.ops.integer_sequence import QLstmCell, QMultiheadAttention
from qir.ir.types import DType, QuantSpec, SequenceType, TensorType
from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from tests.ir.integer_family import assert_check_model_unchanged, assert_round_trips, assert_runs_and_emits_as, same

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")

E = 8
OPS = {
    "cell": "qlstm_cell",
    "cell0": "qlstm_cell",
    "self_attn": "qmultihead_attention",
    "cross": "qmultihead_attention",
    "masked": "qmultihead_attention",
    "causal": "qmultihead_attention",
}
FAMILY = (QLstmCell, QMultiheadAttention)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qx, self.qh, self.qc, self.qs, self.qt = QuantStub(), QuantStub(), QuantStub(), QuantStub(), QuantStub()
        self.cell = nn.LSTMCell(6, E)
        self.cell0 = nn.LSTMCell(6, E)
        self.self_attn = nn.MultiheadAttention(E, 2, batch_first=True)
        self.cross = nn.MultiheadAttention(E, 4)
        self.masked = nn.MultiheadAttention(E, 2, batch_first=True)
        self.causal = nn.MultiheadAttention(E, 2, batch_first=True)
        self.register_buffer("causal_mask", torch.ones(5, 5, dtype=torch.bool).triu(1))
        self.dq = nn.ModuleList(DeQuantStub() for _ in range(9))

    def forward(
        self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, s: torch.Tensor, mask: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        qx = self.qx(x)
        h1, c1 = self.cell(qx, (self.qh(h), self.qc(c)))
        h0, _ = self.cell0(qx)
        seq = self.qs(s)
        a, w = self.self_attn(seq, seq, seq)
        t = self.qt(t)  # sequence first
        b, wh = self.cross(t, t, t, average_attn_weights=False)
        m, _ = self.masked(seq, seq, seq, attn_mask=mask, need_weights=False)
        k, _ = self.causal(seq, seq, seq, attn_mask=self.causal_mask)
        outs = (h1, c1, h0, a, w, b, wh, m, k)
        return tuple(dq(o) for dq, o in zip(self.dq, outs, strict=True))


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.randn(5, 5, generator=g) * 0.5
    mask[torch.rand(5, 5, generator=g) > 0.7] = float("-inf")
    mask[:, 0] = 0.0  # every row keeps one key
    return (
        torch.randn(3, 6, generator=g),
        0.8 * torch.tanh(torch.randn(3, E, generator=g)),
        1.5 * torch.randn(3, E, generator=g),
        torch.randn(3, 5, E, generator=g),
        mask,
        torch.randn(5, 3, E, generator=g),
    )


def _converted(march: str) -> nn.Module:
    torch.manual_seed(0)
    qc = get_default_qat_qconfig()
    with march_scope(march):
        qat = prepare_qat_fx(Net(), {"": qc, "module_name": {"qc": get_default_qat_qconfig(dtype="qint16")}})
        for i in range(2):
            qat(*_inputs(i))
        set_fake_quantize(qat, "validation")
        return convert_fx(qat.eval())


@pytest.fixture(scope="module")
def converted() -> nn.Module:
    return _converted("bayes")


def test_layers_trace_to_integer_ops_that_run_exactly(converted: nn.Module) -> None:
    x = _inputs(5)
    g = trace(converted, x)
    by_scope = {n.scope: n for n in g.nodes if n.scope in OPS}
    assert {s: n.op.name for s, n in by_scope.items()} == OPS
    assert not [n for n in g.nodes if n.op.name == "call"]
    cell = by_scope["cell"]
    assert cell.op.has_state and not by_scope["cell0"].op.has_state
    assert isinstance(cell.type, SequenceType)
    h, c = cell.type.elements
    assert (
        isinstance(h, TensorType) and h.quant == cell.op.out and isinstance(c, TensorType) and c.quant == cell.op.cell
    )
    assert c.dtype is DType.qint16
    assert by_scope["masked"].op.attn_mask and not by_scope["masked"].op.need_weights
    assert not by_scope["cross"].op.average_attn_weights and not by_scope["cross"].op.batch_first
    assert_runs_and_emits_as(g, converted, _inputs, x)


def test_text_form_round_trips(converted: nn.Module) -> None:
    x = _inputs(1)
    g = trace(converted, x)
    text = print_graph(g)
    assert "qlstm_cell(%qx, %qh, %qc, %cell_ih_weight" in text and '("c8", ' in text
    assert_round_trips(g, converted, x)


def test_compiled_program_equals_the_converted_model(converted: nn.Module) -> None:
    compiled = compile_model(converted, list(_inputs(0)), opt=1)
    ops = {i.op for i in compiled.program.instructions}
    assert {"linear", "lut", "mul", "rescale", "matmul", "softmax", "masked_softmax", "reduce_sum"} <= ops
    with torch.no_grad():
        for seed in (7, 8):
            assert same(compiled(*_inputs(seed)), converted(*_inputs(seed)))


def _lstm(**kw: object) -> QLstmCell:
    spec8 = QuantSpec((0.05,), DType.qint8)
    base: dict[str, object] = {
        "out": spec8,
        "in_scales": (0.1, 0.05, 0.01),
        "march": "bayes",
        "cell": QuantSpec((0.01,), DType.qint16),
        "input_size": 6,
        "hidden_size": 8,
        "ih_out": spec8,
        "hh_out": spec8,
        "gates_add": (False, 10, 300, 17000, 20),
        "cell_add": (True, 12, 900, 16000, 15),
        "requant": (
            ("c8", 1, 2, DType.qint8),
            ("fc", 3, 4, DType.qint16),
            ("h", 5, 6, DType.qint8),
            ("ig", 7, 8, DType.qint16),
        ),
    }
    return QLstmCell(**(base | kw))  # type: ignore[arg-type]


def test_verify_names_the_op_and_the_fault(converted: nn.Module) -> None:
    op = _lstm()
    with pytest.raises(IRError, match="hh_out, gates_add and cell_add are set exactly when"):
        _lstm(in_scales=(0.1,))
    with pytest.raises(IRError, match=r"requant must hold exactly the steps \['c8', 'fc', 'h', 'ig'\]"):
        _lstm(requant=op.requant[:2])
    with pytest.raises(IRError, match="requant\\['c8'\\] rescales the cell onto the qint8"):
        _lstm(requant=(("c8", 1, 2, DType.qint16), *op.requant[1:]))
    with pytest.raises(IRError, match="gates_add qscale must be an integer"):
        _lstm(gates_add=(False, 10, 40000, 1, 1))
    with pytest.raises(IRError, match="ih_out must be a per-tensor qint8 spec"):
        _lstm(ih_out=QuantSpec((0.1,), DType.qint16))
    with pytest.raises(IRError, match="march must be one of"):
        _lstm(march="x3")
    g = trace(converted, _inputs(0))
    node = next(n for n in g.nodes if n.scope == "cell")
    types = [v.type for v in node.operands]
    node.op.verify_(types)
    with pytest.raises(IRError, match=r"qlstm_cell takes \(batch, 6\)"):
        node.op.verify_([TensorType((3, 5), DType.qint8), *types[1:]])
    with pytest.raises(IRError, match=r"c must be \(batch, 8\) codes"):
        node.op.verify_([types[0], types[1], TensorType((3, 7), DType.qint16), *types[3:]])
    with pytest.raises(IRError, match="h must be qint8 / qint16 codes"):
        node.op.verify_([types[0], TensorType((3, 8), DType.qint32), *types[2:]])
    with pytest.raises(IRError, match=r"ih.weight must be \(32, 6\) integer codes"):
        node.op.verify_([*types[:3], TensorType((32, 5), DType.int8), *types[4:]])
    with pytest.raises(IRError, match="sigmoid_table must hold 256 integer entries"):
        node.op.verify_([*types[:-3], TensorType((255,), DType.int8), *types[-2:]])
    attn = next(n for n in g.nodes if n.scope == "masked")
    atypes = [v.type for v in attn.operands]
    attn.op.verify_(atypes)
    with pytest.raises(IRError, match="embed_dim 8 is not divisible by 3 heads"):
        attrs.evolve(attn.op, num_heads=3)
    with pytest.raises(IRError, match="scores must be a per-tensor qint8 spec"):
        attrs.evolve(attn.op, scores=QuantSpec((0.1,), DType.qint16))
    with pytest.raises(IRError, match=r"query must be 3-dimensional codes \(\.\.\., 8\)"):
        attn.op.verify_([TensorType((3, 5, 6), DType.qint8), *atypes[1:]])
    with pytest.raises(IRError, match="a mask must be a bool or float tensor"):
        attn.op.verify_([*atypes[:3], TensorType((5, 5), DType.qint8), *atypes[4:]])
    with pytest.raises(IRError, match="takes 25 operands"):
        attn.op.verify_(atypes[:-1])


def test_check_model_reports_what_the_opaque_calls_reported() -> None:
    # Bernoulli2 converts neither layer (no qint16 cell state, no attention in its tables)
    march = "bayes"
    conv = _converted(march)
    x = _inputs(2)
    assert_check_model_unchanged(conv, x, march, FAMILY, expect=set(OPS.values()), gone=set(OPS.values()))
