"""``qat_functional``: a prepared model's FloatFunctional method calls are typed QAT ops.

Every method family (two tensors, a tensor and a number, a list, a reduction, matmul with and
without an output fake quant) traces to one ``qat_functional`` node per call, keeps the QAT
contract (tests/ir/qat_family.py), and the verifier names a field a method does not take.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qir
from qir.frontend import trace
from qir.ir import IRError
from qir.ir.ops.core import Call
from qir.ir.ops.qat import FakeQuantSpec
from qir.ir.ops.qat_functional import QATFunctional
from qir.ir.ops.quant import ObserverSpec
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
)
from tests.ir.qat_family import assert_qat_contract


class Methods(nn.Module):
    """Generated FloatFunctionals (``+``, ``cat``, ...) and user ones (``self.mm``, ``self.mx``)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)
        self.mm, self.mx, self.dv = FloatFunctional(), FloatFunctional(), FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        y, w = self.a(x), self.b(x)
        z = torch.cat([y - w, y], dim=1)
        z = z * y.mean(dim=1, keepdim=True) + z.sum(dim=(2, 3), keepdim=True)
        z = torch.stack([z, z * 0.5 + 1.0], dim=1).sum(dim=1)
        m = self.mx.maximum(y, self.mm.matmul(y, w, y_trans=True))
        return self.dequant(torch.cat([z, self.dv.div(m, torch.relu(w) + 1.0)], dim=1))


def _prepared(march: str, qconfig: dict[str, object] | None = None) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    torch.manual_seed(0)
    qir.set_march(march)
    x = torch.randn(2, 3, 6, 6)
    qat = prepare_qat_fx(Methods(), qconfig or {"": get_default_qat_qconfig()}, example_inputs=(x,))
    for _ in range(2):
        qat(torch.randn(2, 3, 6, 6))
    return qat, x


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_method_calls_are_qat_functional_ops_keeping_the_contract(march: str) -> None:
    qat, x = _prepared(march)
    g = assert_qat_contract(qat, x, lambda: torch.randn(2, 3, 6, 6) * 3)
    ops = [n.op for n in g.nodes if isinstance(n.op, QATFunctional)]
    assert [op.method for op in ops] == [
        "sub", "cat", "mean", "mul", "sum", "add", "mul_scalar", "add_scalar", "stack", "sum", "matmul", "maximum",
        "add_scalar", "div", "cat",
    ]  # fmt: skip
    cat, mean, matmul = ops[1], ops[2], ops[10]
    assert (cat.count, cat.dim) == (2, 1)
    assert (mean.dim, mean.keepdim) == (1, True)
    assert (matmul.x_trans, matmul.y_trans) == (False, False)  # prepare spells y_trans=True as a transpose
    assert ops[6].scalar == 0.5 and ops[12].scalar == 1.0
    node = next(n for n in g.nodes if isinstance(n.op, QATFunctional) and n.op.method == "cat")
    assert [v.op.key for v in node.operands[2:4]] == [  # type: ignore[attr-defined]
        f"{node.scope}.activation_post_process.scale",
        f"{node.scope}.activation_post_process.zero_point",
    ]


def test_a_high_precision_matmul_has_no_output_fake_quant() -> None:
    qc = {"": get_default_qat_qconfig(), "module_name": {"mm": get_default_qat_out_qconfig()}}

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant, self.mm = QuantStub(), DeQuantStub(), FloatFunctional()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.quant(x)
            return self.dequant(self.mm.matmul(x, x.transpose(-2, -1)))

    qir.set_march("bayes")
    x = torch.randn(2, 3, 5)
    qat = prepare_qat_fx(Head(), qc, example_inputs=(x,))
    qat(x)
    g = assert_qat_contract(qat, x, lambda: torch.randn(2, 3, 5))
    (mm,) = [n for n in g.nodes if isinstance(n.op, QATFunctional)]
    assert mm.op.out_fq is None and len(mm.operands) == 2


def test_a_run_time_number_is_an_operand() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.quant(x) * (1.0 / x.shape[-1]))

    qir.set_march("bayes")
    x = torch.randn(2, 3, 4)
    qat = prepare_qat_fx(Scaled(), {"": get_default_qat_qconfig()}, example_inputs=(x,))
    qat(x)
    g = trace(qat, (x,))
    (mul,) = [n for n in g.nodes if isinstance(n.op, QATFunctional)]
    assert mul.op.method == "mul_scalar" and mul.op.scalar is None and mul.op.num_inputs() == 2
    assert_qat_contract(qat, x, lambda: torch.randn(2, 3, 4))


def test_a_fake_quant_without_a_data_form_keeps_the_call_opaque_and_says_why() -> None:
    from qir.quantization.lsq import LSQFakeQuantize
    from qir.quantization.qconfig import QConfig

    qc = get_default_qat_qconfig()
    lsq = QConfig(activation=LSQFakeQuantize.with_args(dtype="qint8"), weight=qc.weight)
    qat, x = _prepared("bayes", {"": qc, "module_name": {"mx": lsq}})
    g = trace(qat, (x,))
    (opaque,) = [n for n in g.nodes if isinstance(n.op, Call) and n.scope]
    assert opaque.scope == "mx" and "LSQFakeQuantize" in opaque.meta["frontend_note"]


_FQ = FakeQuantSpec(ObserverSpec())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "pow"}, "method must be one of"),
        ({"method": "add", "dim": 1}, "add takes no dim"),
        ({"method": "cat", "keepdim": True, "dim": 0}, "cat takes no keepdim"),
        ({"method": "cat"}, "cat needs an integer dim"),
        ({"method": "mean", "dim": (1, "a")}, "dim must be None or integers"),
        ({"method": "add", "out_fq": None}, "only matmul may have none"),
        ({"method": "add", "out_fq": FakeQuantSpec(ObserverSpec(axis=1))}, "must be per tensor"),
        ({"method": "add_scalar", "scalar": float("inf")}, "scalar must be a finite number"),
        ({"method": "stack", "count": 0, "dim": 0}, r"count must be an integer in \[1, 65536\]"),
        ({"method": "matmul", "x_trans": 1}, "x_trans must be a boolean"),
    ],
)
def test_bad_fields_are_refused_naming_them(fields: dict[str, object], message: str) -> None:
    with pytest.raises(IRError, match=message):
        QATFunctional(**{"out_fq": _FQ, **fields})  # type: ignore[arg-type]


def test_verify_names_the_bad_operand() -> None:
    qat, x = _prepared("bayes")
    g = trace(qat, (x,))
    cat = next(n for n in g.nodes if isinstance(n.op, QATFunctional) and n.op.method == "cat")
    types = [v.type for v in cat.operands]
    with pytest.raises(IRError, match=r"takes 8 operands \(2 inputs"):
        cat.op.verify(types[1:])
    with pytest.raises(IRError, match="rejects its operand shapes"):
        QATFunctional(method="cat", out_fq=cat.op.out_fq, count=2, dim=4).verify(types)
