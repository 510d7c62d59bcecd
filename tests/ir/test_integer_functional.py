"""Converted FloatFunctional calls are integer ops: ``self.ff.add(x, y)`` traces to ``qadd``.

Each method family is one op with the call site's scales as attributes; the interpreter and
emit call the method on a QFunctional rebuilt from them, so results and state-dict keys are
the converted model's; the text form round-trips; legality reads them as the float op.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.ao.quantization import DeQuantStub, QuantStub

import qir
from qir.frontend import emit, trace
from qir.ir import IRError, parse_graph, print_graph, run_graph
from qir.ir.ops.integer_functional import QAdd, QCat, QFunctionalOp, QMatmul, QReduce
from qir.ir.types import DType, QuantSpec, TensorType
from qir.nn.quantized import FloatFunctional
from qir.quantization import check_model, convert_fx, get_default_qat_qconfig, prepare_qat_fx


class Arith(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 1)
        names = ["add", "add_relu", "sub", "add_scalar", "mul", "mul_scalar", "cat", "stack"]
        names += ["maximum", "minimum", "sum", "mean", "matmul", "exp"]
        self.ff = nn.ModuleDict({k: FloatFunctional() for k in names})
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.quant(x)
        y = self.conv(x)
        f = self.ff
        a = f["add"].add(x[:, :3], y[:, :3])
        b = f["add_relu"].add_relu(a, x)
        c = f["sub"].sub(b, a)
        d = f["add_scalar"].add_scalar(c, 0.25)
        e = f["mul"].mul(d, b)
        g = f["mul_scalar"].mul_scalar(e, -1.5)
        h = f["cat"].cat([g, y], dim=1)
        i = f["stack"].stack([g, a], dim=2)
        j = f["maximum"].maximum(a, b)
        k = f["minimum"].minimum(j, c)
        s = f["sum"].sum(k, dim=1, keepdim=True)
        m = f["mean"].mean(h, dim=(2, 3))
        mm = f["matmul"].matmul(y, y, x_trans=True)
        ex = f["exp"].exp(m)
        return tuple(self.dequant(t) for t in (h, i, s, ex, mm))


def _converted(march: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    qir.set_march(march)
    x = torch.randn(2, 3, 4, 4)
    qat = prepare_qat_fx(Arith(), {"": get_default_qat_qconfig()}, example_inputs=(x,))
    for _ in range(3):
        qat(torch.randn(2, 3, 4, 4))
    return convert_fx(qat), x


def _equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_every_method_is_an_integer_op_that_runs_exactly() -> None:
    conv, x = _converted("bayes")
    g = trace(conv, (x,))
    ops = {n.scope: n.op for n in g.nodes if isinstance(n.op, QFunctionalOp)}
    assert {k.removeprefix("ff."): v.name for k, v in ops.items()} == {
        "add": "qadd",
        "add_relu": "qadd",
        "sub": "qadd",
        "add_scalar": "qadd_scalar",
        "mul": "qmul",
        "mul_scalar": "qmul_scalar",
        "cat": "qcat",
        "stack": "qcat",
        "maximum": "qminmax",
        "minimum": "qminmax",
        "sum": "qreduce",
        "mean": "qreduce",
        "matmul": "qmatmul",
        "exp": "qlut_method",
    }
    assert not [n for n in g.nodes if n.op.name == "call" and n.scope and n.scope.startswith("ff.")]
    cat = ops["ff.cat"]
    assert isinstance(cat, QCat) and (cat.count, cat.dim) == (2, 1)
    mm = ops["ff.matmul"]
    assert isinstance(mm, QMatmul)  # prepare spells x_trans as a transpose of the codes before it
    red = ops["ff.mean"]
    assert isinstance(red, QReduce) and red.dim == (2, 3) and not red.keepdim
    assert ops["ff.mul_scalar"].scalar == -1.5  # type: ignore[attr-defined]
    want = conv(x)
    assert _equal(run_graph(g, x), want)
    back = emit(g)
    assert _equal(back(x), want)
    assert sorted(back.state_dict()) == sorted(conv.state_dict())


def test_text_form_round_trips() -> None:
    conv, x = _converted("bayes")
    g = trace(conv, (x,))
    text = print_graph(g)
    assert "qadd_scalar(" in text and "scalar=0.25" in text
    g2 = parse_graph(text, constants=g.constants, objects=g.objects)
    assert print_graph(g2) == text
    assert _equal(run_graph(g2, x), conv(x))


def test_verify_and_construction_errors_name_the_field() -> None:
    spec = QuantSpec((0.1,))
    with pytest.raises(IRError, match="method must be one of"):
        QAdd(method="mul", out=spec, in_scales=(0.1, 0.1), march="bayes")
    with pytest.raises(IRError, match="need as many input scales"):
        QAdd(method="add", out=spec, in_scales=(0.1,), march="bayes")
    op = QAdd(method="add", out=spec, in_scales=(0.1, 0.2), march="bayes")
    t8 = TensorType((1, 4), DType.int8)
    op.verify([t8, t8])
    with pytest.raises(IRError, match="integer codes"):
        op.verify([t8, TensorType((1, 4), DType.float32)])
    with pytest.raises(IRError, match="takes 2 operands"):
        op.verify([t8])


def test_legality_checks_them_as_the_float_ops() -> None:
    conv, x = _converted("bayes")
    report = check_model(conv, (x,))
    unknown = {v.node for v in report.unknown}
    assert not unknown & {"add", "sub", "mul", "cat", "maximum", "minimum", "sum", "mean", "matmul"}
