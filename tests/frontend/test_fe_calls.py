"""FloatFunctional as single nodes, fx_helper.wrap, and explicit opaque calls."""

from __future__ import annotations

import pytest
import torch
from fe_helpers import op_names, roundtrip
from torch import nn
from torch.ao.nn.quantized import FloatFunctional
from torch.ao.quantization import DeQuantStub, QuantStub

from qir.frontend import emit, trace
from qir.ir import run_graph
from qir.utils.fx_helper import wrap


class WithFF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(2, 2, 1)
        self.add = FloatFunctional()
        self.cat = FloatFunctional()
        self.ops = FloatFunctional()
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        y = self.add.add(self.conv(x), x)
        y = self.ops.mul_scalar(self.ops.add_scalar(y, 1.0), 0.5)
        y = self.ops.add_relu(y, self.ops.mul(y, x))
        y = self.cat.cat([y, self.ops.matmul(y, x)], dim=1)
        return self.dequant(y)


def test_float_functional_calls_are_single_nodes() -> None:
    m = WithFF().eval()
    g = roundtrip(m, torch.randn(1, 2, 3, 3))
    ff = [n for n in g.nodes if n.scope in ("add", "cat", "ops")]
    assert [(n.op.name, n.scope, n.meta["float_functional"]) for n in ff] == [
        ("add", "add", "add"),
        ("add", "ops", "add_scalar"),
        ("mul", "ops", "mul_scalar"),
        ("mul", "ops", "mul"),
        ("call", "ops", "add_relu"),
        ("matmul", "ops", "matmul"),
        ("cat", "cat", "cat"),
    ]
    stubs = [n for n in g.nodes if n.op.name == "call" and n.op.kind == "module"]  # type: ignore[attr-defined]
    assert [n.op.target for n in stubs] == ["quant", "dequant"]  # type: ignore[attr-defined]
    gm = emit(g)
    code = gm.code
    for call in ("add.add(", "ops.add_scalar(", "ops.mul_scalar(", "ops.add_relu(", "ops.matmul(", "cat.cat("):
        assert call.split("(")[0].split(".")[1] + "(" in code, call
    assert isinstance(gm.ops, FloatFunctional) and gm.ops is m.ops


def test_float_functional_after_text_round_trip() -> None:
    parser = pytest.importorskip("qir.ir.parser")
    printer = pytest.importorskip("qir.ir.printer")
    m = WithFF().eval()
    x = torch.randn(1, 2, 3, 3)
    g = trace(m, x)
    g2 = parser.parse_graph(printer.print_graph(g), constants=g.constants, objects=g.objects)
    gm = emit(g2)
    torch.testing.assert_close(gm(x), m(x))
    assert "ops.add_scalar(" in gm.code and "cat.cat(" in gm.code


@wrap
def plain_helper(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.sum() > 0:  # untraceable on purpose
        return x * k
    return x - k


@wrap()
def called_helper(x: torch.Tensor) -> torch.Tensor:
    return x.numpy().clip(0, 1).sum() + x  # numpy: untraceable


def late_helper(x: torch.Tensor) -> torch.Tensor:
    return x if bool(x.mean() > 0) else x * 2


wrap(late_helper)  # rebinds the module-level name, like torch.fx.wrap


class UsesWrap(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 3)
        self.child = Child()

    @wrap()
    def _post(self, y: torch.Tensor) -> torch.Tensor:
        if self.training or y.max() > 10:
            return y
        return self.head(y) * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = plain_helper(x, 2) + called_helper(x) + late_helper(x)
        return self._post(self.child(y))


class Child(nn.Module):
    @wrap
    def forward_part(self, y: torch.Tensor) -> torch.Tensor:
        return y if y.sum() > 0 else -y

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.forward_part(y)


def test_wrap_functions_and_methods_stay_one_node() -> None:
    m = UsesWrap().eval()
    g = roundtrip(m, torch.randn(2, 3))
    calls = [n.op.target for n in g.nodes if n.op.name == "call"]  # type: ignore[attr-defined]
    assert calls == [
        f"{__name__}.plain_helper",
        f"{__name__}.called_helper",
        f"{__name__}.late_helper",
        "self.child.forward_part",
        "self._post",
    ]
    assert "linear" not in op_names(g)  # the method body was not traced
    assert plain_helper(torch.ones(1), 3).item() == 3.0  # wrapped functions still run eagerly


def test_unknown_function_method_and_module_become_opaque_calls() -> None:
    class Odd(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.odd = nn.Bilinear(3, 3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.cumsum(x, 1).new_ones(2, 3) + torch.cumsum(x, dim=1)
            return self.odd(y, x.masked_fill(x > 0, 0.0))

    m = M().eval()
    g = roundtrip(m, torch.randn(2, 3))
    calls = [(n.op.kind, n.op.target) for n in g.nodes if n.op.name == "call"]  # type: ignore[attr-defined]
    assert calls == [
        ("function", "torch.cumsum"),
        ("method", "new_ones"),
        ("function", "torch.cumsum"),
        ("method", "masked_fill"),
        ("module", "odd"),
    ]
    assert "odd.weight" in emit(g).state_dict()
    torch.testing.assert_close(run_graph(g, torch.ones(2, 3)), m(torch.ones(2, 3)))


def test_stubs_and_fused_modules_are_leaves() -> None:
    from torch.ao.nn.intrinsic import ConvReLU2d

    stubs = pytest.importorskip("qir.quantization")

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = stubs.QuantStub()
            self.fused = ConvReLU2d(nn.Conv2d(2, 2, 1), nn.ReLU())
            self.dequant = stubs.DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.fused(self.quant(x)))

    m = M().eval()
    g = roundtrip(m, torch.randn(1, 2, 3, 3))
    # the stubs are opaque module calls unless some registered op claims their class
    assert [n.scope for n in g.nodes if n.op.name != "constant"] == ["quant", "fused", "dequant"]
    fused = next(n for n in g.nodes if n.scope == "fused")
    assert (fused.op.name, fused.op.kind) == ("call", "module")  # type: ignore[attr-defined]
    assert emit(g).get_submodule("fused") is m.fused


def str_helper(x: torch.Tensor) -> torch.Tensor:
    return x if x.sum() > 0 else -x


wrap("str_helper")  # the torch.fx.wrap spelling: rebinds the name in this module


def test_wrap_by_name_and_errors() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return str_helper(x) * 2

    g = roundtrip(M(), torch.randn(3))
    assert [n.op.target for n in g.nodes if n.op.name == "call"] == [f"{__name__}.str_helper"]  # type: ignore[attr-defined]
    with pytest.raises(NameError, match="no function named 'nope'"):
        wrap("nope")
    with pytest.raises(TypeError, match="expects a function"):
        wrap(3)
