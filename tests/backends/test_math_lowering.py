"""PReLU, GLU, Softmax and LayerNorm through the whole flow: prepare -> QAT -> convert -> check -> compile.

Per op, the model is QuantStub -> conv -> op -> conv -> DeQuantStub. The converted op is within
its documented bound of the QAT op (in output LSB, on the same input codes); the compiled program
and its artifact equal the converted model bit for bit; check_model accepts the op on Bayes and
refuses it on Bernoulli2; and the integer kernels equal the module library's rules on random
scales and shapes (hypothesis).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qir
from backends.common import numerics
from backends.common.lower_ir import lower_ir
from backends.common.runtime import CompiledModel
from qir.frontend import trace
from qir.frontend.tracer import TraceError
from qir.march import march_scope
from qir.nn import qat, quantized
from qir.quantization import (
    CompileError,
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")

SHAPE = (4, 3, 8, 8)
N_INPUTS = 24
QC = get_default_qat_qconfig()
QC16 = get_default_qat_qconfig(dtype="qint16")

#: op name -> (float op factory, channels the first conv produces)
OPS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "prelu": (lambda: nn.PReLU(4, init=0.2), 4),
    "prelu1": (lambda: nn.PReLU(), 4),
    "glu": (lambda: nn.GLU(1), 8),
    "softmax": (lambda: nn.Softmax(1), 4),
    "softmax_w": (lambda: nn.Softmax(-1), 4),
    "layernorm": (lambda: nn.LayerNorm([8, 8]), 4),
    "layernorm_c": (lambda: nn.LayerNorm([4, 8, 8]), 4),
}
#: documented bound in the op's output LSB (docs/semantics.md)
BOUND = {"glu16": 2}
SPELLING = {
    "prelu": "torch.nn.PReLU",
    "glu": "torch.nn.GLU",
    "softmax": "torch.nn.Softmax",
    "layernorm": "torch.nn.LayerNorm",
}


class Net(nn.Module):
    def __init__(self, op: nn.Module, mid: int) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.c1 = nn.Conv2d(3, mid, 3, padding=1)
        self.op = op
        self.c2 = nn.Conv2d(4, 4, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.c2(self.op(self.c1(self.quant(x)))))


class Functional(nn.Module):
    """The functional spellings on quantized tensors (prepare generates the modules)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], mid: int = 4) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.c1 = nn.Conv2d(3, mid, 3, padding=1)
        self.fn = fn
        self.c2 = nn.Conv2d(4, 4, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.c2(self.fn(self.c1(self.quant(x)))))


def _qat(model: nn.Module, march: str = "bayes", op_qconfig: Any = None, steps: int = 3) -> torch.fx.GraphModule:
    """prepare -> a few QAT steps (SGD) -> validation state (frozen scales)."""
    torch.manual_seed(0)
    qd: dict[str, Any] = {"": QC}
    if op_qconfig is not None:
        qd["module_name"] = {"op": op_qconfig}
    with march_scope(march):
        prepared = prepare_qat_fx(model, qd)
    prepared.train()
    opt = torch.optim.SGD(prepared.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        out = prepared(torch.randn(*SHAPE, generator=g) * 1.5)
        out.square().mean().backward()
        opt.step()
    set_fake_quantize(prepared, "validation")
    return prepared.eval()


def _flow(name: str, march: str = "bayes", op_qconfig: Any = None) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    make, mid = OPS[name]
    prepared = _qat(Net(make(), mid), march, op_qconfig)
    with march_scope(march):
        return prepared, convert_fx(prepared)


def _inputs(seed: int, n: int = N_INPUTS) -> torch.Tensor:
    return torch.randn(n, *SHAPE[1:], generator=torch.Generator().manual_seed(seed)) * 1.5


@pytest.mark.parametrize("out16", [False, True], ids=["qint8", "qint16"])
@pytest.mark.parametrize("name", list(OPS))
def test_converted_op_within_bound_of_qat(name: str, out16: bool) -> None:
    prepared, converted = _flow(name, op_qconfig=QC16 if out16 else None)
    seen: dict[str, torch.Tensor] = {}
    converted.get_submodule("c1").register_forward_hook(lambda m, a, out: seen.__setitem__("x", out))
    converted.get_submodule("op").register_forward_hook(lambda m, a, out: seen.__setitem__("y", out))
    with torch.no_grad():
        converted(_inputs(3))
        q_op = converted.get_submodule("op")
        qat_op = prepared.get_submodule("op")
        fq = qat_op.activation_post_process
        want = numerics.quantize(qat_op(numerics.dequantize(seen["x"], q_op.input_scale_0)), fq.scale, fq.dtype)
    got = seen["y"]
    assert got.dtype == (torch.int16 if out16 else torch.int8)
    base = {"prelu1": "prelu", "softmax_w": "softmax", "layernorm_c": "layernorm"}.get(name, name)
    bound = BOUND.get(base + ("16" if out16 else ""), 1)
    assert int((got.to(torch.int64) - want.to(torch.int64)).abs().max()) <= bound


@pytest.mark.parametrize("out16", [False, True], ids=["qint8", "qint16"])
@pytest.mark.parametrize("name", list(OPS))
def test_compiled_and_artifact_bitexact(tmp_path: Path, name: str, out16: bool) -> None:
    _, converted = _flow(name, op_qconfig=QC16 if out16 else None)
    path = tmp_path / f"{name}.hbm"
    compiled = compile_model(converted, [_inputs(0, 2)], hbm=path, opt=1)
    loaded = qir.load_compiled(path)
    assert {i.op for i in loaded.program.instructions} == {i.op for i in compiled.program.instructions}
    with torch.no_grad():
        for seed in (10, 11):
            x = _inputs(seed)  # 24 inputs per batch; the batch size is free
            want = converted(x)
            assert torch.equal(compiled(x), want) and torch.equal(loaded(x), want)
        x1 = _inputs(12, 1)
        assert torch.equal(loaded(x1), converted(x1))


@pytest.mark.parametrize("name", ["prelu", "glu", "softmax", "layernorm"])
def test_check_model_verdicts(name: str) -> None:
    make, mid = OPS[name]
    prepared, converted = _flow(name)
    x = _inputs(0, 1)
    assert check_model(converted, x, march="bayes").ok
    assert check_model(prepared, x, march="bayes").ok
    qat_report = check_model(prepared, x, march="bernoulli2")
    assert [(v.kind, v.node, v.spelling) for v in qat_report.violations] == [("unsupported", "op", SPELLING[name])]
    report = check_model(Net(make(), mid), x, march="bernoulli2", advice=True)
    assert not report.ok
    (v,) = report.violations
    assert (v.kind, v.node, v.module, v.spelling) == ("unsupported", "op", "op", SPELLING[name])
    assert any("hybrid=True" in a and "'op'" in a for a in v.advice)
    _, converted_b2 = _flow(name, march="bernoulli2")
    assert not check_model(converted_b2, x, march="bernoulli2").ok
    with pytest.raises(CompileError, match=rf"(?s)not legal on bernoulli2.*op \(op: {SPELLING[name]}\)"):
        compile_model(converted_b2, [x], march="bernoulli2")


def test_layer_norm_table_rules_read_the_converted_module() -> None:
    """The Bayes row bounds H * W and the normalized H * W; a converted LayerNorm reports both facts."""
    shape = (1, 3, 129, 128)
    with march_scope("bayes"):
        prepared = prepare_qat_fx(Net(nn.LayerNorm([129, 128]), 4), {"": QC})
        prepared(torch.randn(*shape))
        converted = convert_fx(prepared.eval())
    report = check_model(converted, torch.randn(*shape), march="bayes")
    rules = sorted((v.node, v.rule, v.actual) for v in report.violations)
    assert rules == [("op", "H * W <= 16384", 16512), ("op", "normalized_shape H * W < 16384", 16512)]
    with pytest.raises(CompileError, match=r"(?s)not legal on bayes.*normalized_h\*normalized_w = 16512 violates"):
        compile_model(converted, [torch.randn(*shape)])


@pytest.mark.parametrize("name", ["prelu", "glu", "softmax", "layernorm"])
def test_qat_backward_step(name: str) -> None:
    make, mid = OPS[name]
    with march_scope("bayes"):
        prepared = prepare_qat_fx(Net(make(), mid), {"": QC})
    prepared.train()
    before = {k: v.detach().clone() for k, v in prepared.named_parameters()}
    opt = torch.optim.SGD(prepared.parameters(), lr=0.1)
    for seed in range(3):
        opt.zero_grad()
        out = prepared(_inputs(seed, 4))
        assert bool(torch.isfinite(out).all())
        out.square().mean().backward()
        for k, p in prepared.named_parameters():
            assert p.grad is not None and bool(torch.isfinite(p.grad).all()), k
        opt.step()
    changed = [k for k, v in prepared.named_parameters() if not torch.equal(v, before[k])]
    assert "c1.weight" in changed
    if name in ("prelu", "layernorm"):
        assert "op.weight" in changed


@pytest.mark.parametrize(
    ("fn", "cls", "mid"),
    [
        (lambda x: F.softmax(x, dim=1), qat.Softmax, 4),
        (lambda x: torch.softmax(x, -1), qat.Softmax, 4),
        (lambda x: x.softmax(dim=2), qat.Softmax, 4),
        (lambda x: F.glu(x, 1), qat.GLU, 8),
    ],
    ids=["F.softmax", "torch.softmax", "Tensor.softmax", "F.glu"],
)
def test_functional_forms_become_modules(fn: Callable[[torch.Tensor], torch.Tensor], cls: type, mid: int) -> None:
    prepared = _qat(Functional(fn, mid))
    generated = [m for n, m in prepared.named_modules() if "_generated_" in n and isinstance(m, cls)]
    assert len(generated) == 1
    with march_scope("bayes"):
        converted = convert_fx(prepared)
    compiled = compile_model(converted, [_inputs(0, 2)], opt=1)
    x = _inputs(5)
    with torch.no_grad():
        assert torch.equal(compiled(x), converted(x))


def test_qint16_input_to_a_table_op_is_refused_naming_the_node() -> None:
    with march_scope("bayes"):
        prepared = prepare_qat_fx(Net(nn.Softmax(1), 4), {"": QC, "module_name": {"c1": QC16}})
    prepared(_inputs(0, 2))
    with march_scope("bayes"):
        converted = convert_fx(prepared.eval())
    # compile traces the model on the example input first: the module's own refusal names the node
    with pytest.raises(TraceError, match=r"node op .*Softmax: only qint8 input.*qint8 qconfig"):
        compile_model(converted, [_inputs(0, 2)], check=False, opt=1)
    with pytest.raises(NotImplementedError, match="Softmax: only qint8 input"):
        converted(_inputs(0, 2))


# ----------------------------------------------------------------------------- kernels vs rules


class _One(nn.Module):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(x)


def _compiled(q: nn.Module, example: torch.Tensor) -> CompiledModel:
    """One quantized module lowered on its own: integer codes in, codes out."""
    return CompiledModel(lower_ir(trace(_One(q), (example,)), [example], "bayes", opt=1))


def _codes(shape: tuple[int, ...], dtype: torch.dtype, seed: int, spread: int) -> torch.Tensor:
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(seed)
    center = torch.randint(info.min // 2, info.max // 2, (1,), generator=g)
    q = center + torch.randint(-spread, spread + 1, shape, generator=g)
    return q.clamp(info.min, info.max).to(dtype)


def _quantized(float_mod: nn.Module, s_in: float, x: torch.Tensor, qconfig: Any) -> nn.Module:
    m = type(float_mod)
    qat_mod: Any = {nn.PReLU: qat.PReLU, nn.GLU: qat.GLU, nn.Softmax: qat.Softmax, nn.LayerNorm: qat.LayerNorm}[m]
    qm = qat_mod.from_float(float_mod, qconfig)
    qm(numerics.dequantize(x, s_in))  # observe: the output scale follows the input
    qcls: Any = {
        qat.PReLU: quantized.PReLU,
        qat.GLU: quantized.GLU,
        qat.Softmax: quantized.Softmax,
        qat.LayerNorm: quantized.LayerNorm,
    }[type(qm)]
    return qcls.from_qat(qm, [torch.tensor([s_in])], "bayes")


scales = st.floats(min_value=-9.0, max_value=1.0).map(lambda e: float(torch.tensor(2.0**e * 1.37)))
shapes = st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 6), st.integers(2, 7))


@settings(deadline=None)
@given(
    kind=st.sampled_from(["prelu", "prelu1", "glu", "softmax", "layernorm", "layernorm2"]),
    s_in=scales,
    shape=shapes,
    out16=st.booleans(),
    in16=st.booleans(),
    spread=st.sampled_from([1, 8, 300, 40000]),
    seed=st.integers(0, 2**16),
)
def test_kernels_equal_the_module_rules(
    kind: str, s_in: float, shape: tuple[int, int, int, int], out16: bool, in16: bool, spread: int, seed: int
) -> None:
    torch.manual_seed(seed)
    n, c, h, w = shape
    if kind in ("glu", "softmax"):
        in16 = False  # table ops take qint8 codes
    if kind == "glu":
        c *= 2
    fl: nn.Module = {
        "prelu": lambda: nn.PReLU(c, init=0.0),
        "prelu1": lambda: nn.PReLU(),
        "glu": lambda: nn.GLU(1),
        "softmax": lambda: nn.Softmax(int(seed % 4) - 4),
        "layernorm": lambda: nn.LayerNorm([w]),
        "layernorm2": lambda: nn.LayerNorm([h, w], eps=1e-3),
    }[kind]()
    with torch.no_grad():
        for p in fl.parameters():
            p.uniform_(-2, 2)
    x = _codes((n, c, h, w), torch.int16 if in16 else torch.int8, seed, spread)
    q = _quantized(fl, s_in, x, QC16 if out16 else QC)
    with torch.no_grad():
        want = q(x)
        got = _compiled(q, x)(x)
    assert got.dtype == want.dtype and torch.equal(got, want)
