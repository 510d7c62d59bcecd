"""Tracing: scopes, constants, types, dynamic arguments, modes, inputs, and error messages."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from fe_helpers import op_names, roundtrip
from torch import nn

from qir.frontend import TraceError, emit, trace
from qir.ir import Graph, Ref, ScalarType, SequenceType, TensorType, run_graph


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(3)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn1(self.conv1(x)) + x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(Block(), Block())
        self.fc = nn.Linear(3, 2)
        self.register_buffer("scale", torch.tensor(2.0))
        self.register_buffer("offset", torch.tensor(0.5), persistent=False)
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer1(x) * self.scale + self.offset
        y = y.mean((2, 3))
        return self.fc(y.reshape(y.size(0), -1))


def test_scopes_constants_and_types() -> None:
    m = Net().eval()
    x = torch.randn(2, 3, 5, 5)
    g = roundtrip(m, x)
    by = {n.name: n for n in g.nodes}
    convs = [n for n in g.nodes if n.op.name == "conv2d"]
    assert [n.scope for n in convs] == ["layer1.0.conv1", "layer1.1.conv1"]
    assert convs[0].operands[1].op.key == "layer1.0.conv1.weight"  # type: ignore[attr-defined]
    # every state-dict key is a constant, unused ones too, in state-dict order
    assert [k for k in g.constants if k != "offset"] == list(m.state_dict())
    kinds = {n.op.key: n.op.kind for n in g.nodes if n.op.name == "constant"}  # type: ignore[attr-defined]
    assert kinds["scale"] == "buffer" and kinds["offset"] == "buffer_np" and kinds["fc.weight"] == "parameter"
    # types from the example run
    assert by["size"].type == ScalarType("int")
    assert convs[0].type == TensorType((2, 3, 5, 5))
    # x.reshape(x.size(0), -1): the size is an operand referenced from the attribute
    reshape = by["reshape"]
    assert reshape.operands[1] is by["size"] and reshape.op.shape == (Ref(1), -1)  # type: ignore[attr-defined]
    assert g.training is False


def test_emit_keeps_state_kinds_order_and_mode() -> None:
    m = Net().train()
    x = torch.randn(2, 3, 5, 5)
    g = trace(m, x)
    gm = emit(g)
    assert gm.training and gm.get_submodule("layer1.0.bn1").training
    assert list(gm.state_dict()) == list(m.state_dict())
    assert dict(gm.named_buffers())["offset"] is m.offset
    assert "offset" not in gm.state_dict()
    assert gm.get_submodule("fc").weight is m.fc.weight  # shared, not copied
    assert dict(gm.named_parameters()).keys() == dict(m.named_parameters()).keys()
    m.eval()
    gm.eval()
    torch.testing.assert_close(gm(x), m(x))


def test_trace_does_not_change_the_module() -> None:
    m = Net().train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    trace(m, torch.randn(2, 3, 5, 5))
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert m.training


def test_emit_does_not_change_the_graph() -> None:
    g = trace(Net().eval(), torch.randn(2, 3, 5, 5))
    before = [(n.name, n.op, n.scope, tuple(v.name for v in n.operands)) for n in g.nodes]
    keys = list(g.constants)
    emit(g)
    emit(g)
    assert [(n.name, n.op, n.scope, tuple(v.name for v in n.operands)) for n in g.nodes] == before
    assert list(g.constants) == keys


def test_cat_list_and_sequence_types() -> None:
    class M(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
            parts = torch.split(torch.cat([a, b], 1), 2, dim=1)
            return parts[0], a.shape

    g = roundtrip(M(), torch.randn(1, 2, 3), torch.randn(1, 2, 3))
    split = next(n for n in g.nodes if n.op.name == "split")
    assert isinstance(split.type, SequenceType) and len(split.type.elements) == 2
    assert op_names(g) == ["cat", "split", "getitem", "getattr"]


def test_accepts_graph_module_and_defaults() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor, k: int = 3) -> torch.Tensor:
            return x * 2

    gm = torch.fx.symbolic_trace(M())
    g = trace(gm, torch.ones(2))
    assert isinstance(g, Graph)
    torch.testing.assert_close(run_graph(g, torch.ones(2)), torch.full((2,), 2.0))


def test_missing_example_inputs_is_an_error() -> None:
    with pytest.raises(TraceError, match="example_inputs"):
        trace(Net())


def test_untraceable_model_names_module_line_and_wrap() -> None:
    class Gate(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow
                return x
            return -x

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = Gate()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gate(x) + 1

    with pytest.raises(TraceError) as info:
        trace(Outer(), torch.randn(2))
    msg = str(info.value)
    assert "module 'gate' (Gate)" in msg
    assert "test_fe_trace.py" in msg and "if x.sum() > 0" in msg
    assert "qir.utils.fx_helper.wrap" in msg


def test_fused_modules_keep_one_state_dict_entry_per_tensor() -> None:
    import passes
    from qir.examples import DigitsNet
    from qir.frontend import emit, trace

    m = DigitsNet().eval()
    x = torch.randn(2, 1, 28, 28)
    gm = emit(passes.run_pipeline(trace(m, (x,)), "absorb-bn,fuse").graph)
    sd = gm.state_dict()
    ptrs = [t.data_ptr() for t in sd.values() if t.numel()]
    assert len(ptrs) == len(set(ptrs)), list(sd)
    torch.testing.assert_close(gm(x), m(x), atol=1e-5, rtol=1e-5)
