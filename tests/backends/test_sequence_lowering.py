"""LSTMCell through the whole flow: prepare -> QAT -> convert -> check -> compile -> artifact.

The cell lowers to existing kernels only (linear, add, lut, mul, rescale, shape_fn); the compiled
program and its artifact equal the converted model bit for bit, with (h, c) from QuantStubs and
with no state (zeros).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
import torch.fx
from torch import nn

import qir
from backends.common.lower import LoweringError
from backends.common.lower_ir import lower_ir
from qir.frontend import trace
from qir.ir import IRError
from qir.ir.ops.core import Call
from qir.march import march_scope
from qir.nn import quantized
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.prepare_checks import UnconvertibleModelError

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")

IN, HID = 6, 8


class Net(nn.Module):
    def __init__(self, state: bool) -> None:
        super().__init__()
        self.state = state
        self.qx, self.qh, self.qc = QuantStub(), QuantStub(), QuantStub()
        self.cell = nn.LSTMCell(IN, HID)
        self.fc = nn.Linear(HID, 4)
        self.dh, self.dc = DeQuantStub(), DeQuantStub()

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hx = (self.qh(h), self.qc(c)) if self.state else None
        h2, c2 = self.cell(self.qx(x), hx)
        return self.dh(self.fc(h2)), self.dc(c2)


def _inputs(seed: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, IN, generator=g),
        0.8 * torch.tanh(torch.randn(n, HID, generator=g)),
        1.5 * torch.randn(n, HID, generator=g),
    )


def _flow(state: bool, march: str = "bayes") -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    torch.manual_seed(0)
    qc = get_default_qat_qconfig()
    with march_scope(march):
        prepared = prepare_qat_fx(Net(state), {"": qc, "module_name": {"qc": get_default_qat_qconfig(dtype="qint16")}})
    prepared.train()
    opt = torch.optim.SGD(prepared.parameters(), lr=1e-3)
    for s in range(3):
        opt.zero_grad()
        h, c = prepared(*_inputs(s))
        (h.square().mean() + c.square().mean()).backward()
        opt.step()
    set_fake_quantize(prepared, "validation")
    prepared.eval()
    with march_scope(march):
        return prepared, convert_fx(prepared)


@pytest.mark.parametrize("state", [True, False], ids=["state", "zeros"])
def test_compiled_and_artifact_bitexact(tmp_path: Path, state: bool) -> None:
    prepared, converted = _flow(state)
    assert isinstance(converted.get_submodule("cell"), quantized.LSTMCell)
    path = tmp_path / "lstm.hbm"
    compiled = compile_model(converted, _inputs(0, 2), hbm=path, opt=1)
    ops = {i.op for i in compiled.program.instructions}
    assert {"linear", "lut", "mul", "rescale"} <= ops and ops <= {
        "linear",
        "lut",
        "mul",
        "rescale",
        "add",
        "shape_fn",
        "quantize",
        "dequantize",
    }
    loaded = qir.load_compiled(path)
    with torch.no_grad():
        for seed in (10, 11):
            x = _inputs(seed)
            want = converted(*x)
            for got in (compiled(*x), loaded(*x)):
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            qat_out = prepared(*x)
            # the converted head stays close to QAT (the cell's bound: docs/semantics.md "LSTMCell")
            assert float((qat_out[1] - want[1]).abs().max()) < 0.05


def test_check_model_verdicts() -> None:
    prepared, converted = _flow(True)
    x = _inputs(0, 1)
    assert check_model(converted, x, march="bayes").ok
    assert check_model(prepared, x, march="bayes").ok
    report = check_model(Net(True), x, march="bernoulli2")
    assert ("unsupported", "cell", "torch.nn.LSTMCell") in [(v.kind, v.node, v.spelling) for v in report.violations]


def test_bernoulli2_refuses_the_qint16_cell_state() -> None:
    with pytest.raises(UnconvertibleModelError, match=r"LSTMCell.*qint16"):  # at prepare, before training
        _flow(True, march="bernoulli2")


def test_the_call_form_is_the_one_converted() -> None:
    _, converted = _flow(True)
    graph = trace(converted, _inputs(0, 2))
    node = next(n for n in graph.nodes if n.scope == "cell")
    assert node.op.name == "qlstm_cell" and node.op.has_state  # the op's form follows its input scales
    x = node.operands[0]
    with pytest.raises(IRError, match=r"converted for calls with \(h, c\) and is called without them"):
        node.op.bind_call([x], {})
    converted.get_submodule("cell").has_state = False
    with pytest.raises(ValueError, match=r"converted for calls without a state and is called with \(h, c\)"):
        converted(*_inputs(0, 2))


def test_a_cell_that_did_not_trace_to_its_op_is_refused_naming_why() -> None:
    _, converted = _flow(True)
    graph = trace(converted, _inputs(0, 2))
    node = next(n for n in graph.nodes if n.scope == "cell")
    # the layer as an opaque module call (an op the front end could not bind): lowering says why
    call = Call(kind="module", target="cell", args=(), kwargs={})
    graph.objects["module:cell"] = converted.get_submodule("cell")
    node.op = call
    node.meta["frontend_note"] = "qlstm_cell: hx must be a pair of graph values (h, c)"
    with pytest.raises(LoweringError, match=r"node 'cell'.*no lowering rule on bayes.*hx must be a pair"):
        lower_ir(graph, _inputs(0, 2), "bayes", opt=1)


# ----------------------------------------------------------------------------- MultiheadAttention

EMBED = 16


class Attn(nn.Module):
    def __init__(self, batch_first: bool, self_attention: bool, weights: str) -> None:
        super().__init__()
        self.self_attention, self.weights = self_attention, weights
        self.q1, self.q2, self.q3 = QuantStub(), QuantStub(), QuantStub()
        self.attn = nn.MultiheadAttention(EMBED, 4, batch_first=batch_first)
        self.d1, self.d2 = DeQuantStub(), DeQuantStub()

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.q1(x)
        kv = (x, x) if self.self_attention else (self.q2(k), self.q3(v))
        need = self.weights != "none"
        o, w = self.attn(x, *kv, need_weights=need, average_attn_weights=self.weights == "mean")
        return (self.d1(o), self.d2(w)) if need else (self.d1(o),)


def _attn_inputs(seed: int, batch_first: bool, n: int = 3) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, 7, EMBED) if batch_first else (7, n, EMBED)
    return tuple(torch.randn(*shape, generator=g) for _ in range(3))


@pytest.mark.parametrize("weights", ["none", "mean", "per_head"])
@pytest.mark.parametrize("self_attention", [True, False], ids=["self", "separate"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_attention_compiled_and_artifact_bitexact(
    tmp_path: Path, batch_first: bool, self_attention: bool, weights: str
) -> None:
    torch.manual_seed(0)
    with march_scope("bayes"):
        prepared = prepare_qat_fx(Attn(batch_first, self_attention, weights), {"": get_default_qat_qconfig()})
    for s in range(3):
        prepared(*_attn_inputs(s, batch_first))
    set_fake_quantize(prepared, "validation")
    prepared.eval()
    with march_scope("bayes"):
        converted = convert_fx(prepared)
    assert isinstance(converted.get_submodule("attn"), quantized.MultiheadAttention)
    x = _attn_inputs(0, batch_first, 1)
    assert check_model(converted, x, march="bayes").ok
    path = tmp_path / "attn.hbm"
    compiled = compile_model(converted, x, hbm=path, opt=1)
    ops = {i.op for i in compiled.program.instructions}
    assert {"linear", "matmul", "softmax"} <= ops
    loaded = qir.load_compiled(path)
    with torch.no_grad():
        for seed in (10, 11):
            xs = _attn_inputs(seed, batch_first)
            want = converted(*xs)
            for got in (compiled(*xs), loaded(*xs)):
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_attention_refused_on_bernoulli2() -> None:
    report = check_model(Attn(True, True, "none"), _attn_inputs(0, True, 1), march="bernoulli2")
    assert ("unsupported", "attn", "torch.nn.MultiheadAttention") in [
        (v.kind, v.node, v.spelling) for v in report.violations
    ]


class MaskedAttn(nn.Module):
    """Masks as graph inputs (float with -inf, or bool) and a bool causal mask held as a buffer."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.q1 = QuantStub()
        self.attn = nn.MultiheadAttention(EMBED, 4, batch_first=True)
        self.d1, self.d2 = DeQuantStub(), DeQuantStub()
        self.register_buffer("causal", torch.ones(7, 7, dtype=torch.bool).triu(1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, kpm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.q1(x)
        if self.mode == "float":
            o, w = self.attn(x, x, x, attn_mask=mask)
        elif self.mode == "bool_kpm":
            o, w = self.attn(x, x, x, attn_mask=mask, key_padding_mask=kpm)
        else:
            o, w = self.attn(x, x, x, attn_mask=self.causal)
        return self.d1(o), self.d2(w)


def _mask_inputs(seed: int, n: int = 3, bool_masks: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input, a float attn_mask with -inf entries (bool: True there) and a key padding mask."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 7, EMBED, generator=g)
    mask = torch.randn(7, 7, generator=g) * 0.5
    mask[torch.rand(7, 7, generator=g) > 0.7] = float("-inf")
    mask[:, 0] = 0.0  # every row keeps one key
    kpm = torch.zeros(n, 7)
    kpm[-1, 4:] = 1.0
    if bool_masks:
        return x, torch.isneginf(mask), kpm > 0.5
    return x, mask, kpm


@pytest.mark.parametrize("mode", ["float", "bool_kpm", "buffer"])
def test_masked_attention_compiled_and_artifact_bitexact(tmp_path: Path, mode: str) -> None:
    torch.manual_seed(0)
    with march_scope("bayes"):
        prepared = prepare_qat_fx(MaskedAttn(mode), {"": get_default_qat_qconfig()})
    bm = mode == "bool_kpm"
    for s in range(3):
        prepared(*_mask_inputs(s, bool_masks=bm))
    set_fake_quantize(prepared, "validation")
    prepared.eval()
    with march_scope("bayes"):
        converted = convert_fx(prepared)
    path = tmp_path / "masked.hbm"
    compiled = compile_model(converted, _mask_inputs(0, 1, bm), hbm=path, opt=1)
    assert "masked_softmax" in {i.op for i in compiled.program.instructions}
    loaded = qir.load_compiled(path)
    with torch.no_grad():
        for seed in (10, 11):
            xs = _mask_inputs(seed, bool_masks=bm)
            want = converted(*xs)
            for got in (compiled(*xs), loaded(*xs)):
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            # masked entries get exactly zero weight, as in QAT
            w_qat = prepared(*xs)[1]
            assert torch.equal(want[1] == 0, w_qat == 0) or mode == "float"


class WholeState(nn.Module):
    """The second cell reads the first cell's whole output ``hx`` (one tuple value, not ``(h, c)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = QuantStub()
        self.fc = nn.Linear(4, IN)
        self.cell0, self.cell1 = nn.LSTMCell(IN, HID), nn.LSTMCell(IN, HID)
        self.head = nn.Linear(HID, 3)
        self.dq, self.dqc = DeQuantStub(), DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(self.q(x))
        hx = self.cell0(x[0])
        h, c = self.cell1(x[1], hx)
        return self.dq(self.head(h)), self.dqc(c)


def _whole_state(flow: str) -> tuple[nn.Module, nn.Module]:
    from qir.quantization import convert, prepare_qat

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    with march_scope("bayes"):
        if flow == "fx":
            qat = prepare_qat_fx(WholeState(), {"": get_default_qat_qconfig()}, example_inputs=(torch.randn(2, 3, 4),))
        else:
            base = WholeState()
            base.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
            qat = prepare_qat(base)
        opt = torch.optim.SGD(qat.parameters(), lr=0.05)
        for _ in range(2):
            out = qat(torch.randn(2, 3, 4, generator=g) * 2)
            opt.zero_grad()
            (out[0].square().mean() + out[1].square().mean()).backward()
            opt.step()
        set_fake_quantize(qat.eval(), "validation")
        return qat, (convert_fx(qat) if flow == "fx" else convert(qat))


@pytest.mark.parametrize("flow", ["fx", "eager"])
def test_a_cell_reading_another_cells_whole_output_compiles_bitexact(tmp_path: Path, flow: str) -> None:
    from qir.ir import parse_graph, print_graph

    qat, converted = _whole_state(flow)
    x0 = torch.randn(2, 3, 4)
    graph = trace(converted, (x0,))
    cell1 = next(n for n in graph.nodes if n.scope == "cell1")
    assert cell1.op.name == "qlstm_cell" and cell1.op.whole_hx and cell1.op.num_inputs() == 2
    assert cell1.operands[1] is next(n for n in graph.nodes if n.scope == "cell0")  # the whole (h', c')
    text = print_graph(graph)
    assert "whole_hx=True" in text
    assert print_graph(parse_graph(text, constants=graph.constants, objects=graph.objects)) == text
    assert check_model(converted, (x0,), march="bayes").ok
    path = tmp_path / "whole.hbm"
    compiled = compile_model(converted, (x0,), hbm=path, opt=1)
    loaded = qir.load_compiled(path)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(5, 3, 4, generator=g) * 2
            want = converted(x)
            assert all(torch.equal(a, b) for a, b in zip(qat(x), want, strict=True))  # validation == converted
            for got in (compiled(x), loaded(x)):
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_whole_state_form_needs_a_state_and_a_pair() -> None:
    _, converted = _flow(True)
    graph = trace(converted, _inputs(0, 2))
    node = next(n for n in graph.nodes if n.scope == "cell")
    assert not node.op.whole_hx
    with pytest.raises(IRError, match=r"whole_hx.*true only for a cell converted for calls with a state"):
        attrs.evolve(next(n for n in graph.nodes if n.scope == "cell").op, in_scales=(0.1,), whole_hx=True)
    whole = attrs.evolve(node.op, whole_hx=True)
    x = node.operands[0]
    with pytest.raises(IRError, match=r"hx must be a pair \(h, c\)"):
        whole.verify([x.type, x.type, *(v.type for v in node.operands[3:])])
