"""Lowering: engines agree exactly, jit-traced input, legality refusal, clear errors, inputs untouched."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from bitexact_models import Stubbed, digits_net, fx_converted
from torch import nn

import backends.common.lower as lower_mod
from backends.common.kernels.base import get_kernel
from backends.common.lower import KernelPolicy, get_kernel_policy
from backends.common.program import Instruction, Program, ProgramError
from qir.march import march_scope
from qir.quantization import CompileError, compile_model, convert_fx, get_default_qat_qconfig, prepare_qat_fx

SHAPE = (2, 1, 28, 28)


@pytest.fixture(scope="module")
def digits() -> nn.Module:
    return fx_converted(digits_net(width=4), SHAPE, "bayes", batches=2)


@pytest.mark.parametrize("engine", ["int_mm", "int_mm_t", "f32", "f64"])
def test_each_conv_engine_is_exact(digits: nn.Module, engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    base = get_kernel_policy("bayes")
    policy = KernelPolicy(conv2d=(engine, "f64"), linear=base.linear, code_dtypes=base.code_dtypes)
    # opt=1 takes the first offered engine; f64 is offered only where nothing else is exact
    monkeypatch.setitem(lower_mod._POLICIES, "bayes", policy)
    compiled = compile_model(digits, [torch.randn(*SHAPE)], opt=1, check=False)
    engines = {i.attrs["engine"] for i in compiled.program.instructions if i.op == "conv2d"}
    assert engine in engines
    x = torch.randn(50, 1, 28, 28) * 2
    assert torch.equal(compiled(x), digits(x))


def test_chunked_float32_engine_matches_float64() -> None:
    # 512 input channels of +-127 weights: sums reach 75e6 > 2**24, so float32 needs chunks
    g = torch.Generator().manual_seed(0)
    w = torch.where(torch.rand(8, 512, 3, 3, generator=g) > 0.5, 127, -127).to(torch.int8)
    consts = {
        "w": w,
        "b": torch.randint(-1000, 1000, (8,), dtype=torch.int32, generator=g),
        "m": torch.full((8,), 1234, dtype=torch.int64),
        "s": torch.full((8,), 24, dtype=torch.int64),
        "r6": torch.full((8,), 100, dtype=torch.int64),
    }
    from backends.common.lower_rules import _chunks

    chunks = _chunks(w, 128)
    assert chunks is not None and len(chunks) > 1
    x = torch.randint(-128, 128, (2, 512, 9, 9), dtype=torch.int8, generator=g)
    outs = []
    for engine in ("f32_chunked", "f64", "int_mm"):
        inst = Instruction(
            "conv2d",
            ("x",),
            ("y",),
            {
                "kind": "conv2d",
                "out_dtype": "qint8",
                "act": "relu",
                "has_add": False,
                "requant": "f64",
                "stride": [1, 1],
                "padding": [1, 1],
                "dilation": [1, 1],
                "groups": 1,
                "padding_mode": "zeros",
                "reversed_padding": [1, 1, 1, 1],
                "kernel_size": [3, 3],
                "engine": engine,
                "chunks": chunks,
            },
            {"weight": "w", "bias": "b", "multiplier": "m", "shift": "s", "relu6_bound": "r6"},
            "probe",
        )
        k = get_kernel("conv2d")
        outs.append(k.run(inst, [x], k.prepare(inst, consts))[0])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    assert outs[0].dtype == torch.int8 and bool((outs[0] > 0).any())


def test_measured_engines_are_recorded(digits: nn.Module) -> None:
    compiled = compile_model(digits, [torch.randn(*SHAPE)], opt=2, check=False)
    convs = [i for i in compiled.program.instructions if i.op == "conv2d"]
    assert convs and all("timings_us" in i.attrs for i in convs)
    assert all(i.attrs["engine"] == min(i.attrs["timings_us"], key=i.attrs["timings_us"].get) for i in convs)


def test_jit_traced_model_compiles_to_the_same_program(digits: nn.Module, tmp_path: Path) -> None:
    x = torch.randn(2, 1, 28, 28)
    traced = torch.jit.trace(digits, x)
    a = compile_model(traced, [x], opt=1)
    b = compile_model(digits, [x], opt=1)
    assert [i.op for i in a.program.instructions] == [i.op for i in b.program.instructions]
    y = torch.randn(20, 1, 28, 28)
    assert torch.equal(a(y), traced(y)) and torch.equal(a(y), digits(y))


def test_jit_trace_without_live_module_is_refused() -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("k", torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.k

    traced = torch.jit.trace(Tiny(), torch.ones(1))
    traced = copy.deepcopy(traced)  # fresh tensors: nothing alive shares them
    with pytest.raises(CompileError, match="no longer alive"):
        compile_model(traced, [torch.ones(1)], march="bayes", check=False)


def test_input_model_is_not_mutated(digits: nn.Module) -> None:
    before = {k: v.clone() for k, v in digits.state_dict().items()}
    code = digits.code
    compile_model(digits, [torch.randn(*SHAPE)], opt=1)
    after = digits.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert digits.code == code


def test_illegal_model_is_refused() -> None:
    # a Linear head is unsupported on Bernoulli2
    body = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(1), nn.Linear(4 * 26 * 26, 3))
    converted = fx_converted(Stubbed(body), SHAPE, "bernoulli2")
    with pytest.raises(CompileError, match=r"(?s)not legal on bernoulli2.*Linear"):
        compile_model(converted, [torch.randn(*SHAPE)], march="bernoulli2")
    compiled = compile_model(converted, [torch.randn(*SHAPE)], march="bernoulli2", check=False, opt=1)
    x = torch.randn(10, 1, 28, 28)
    assert torch.equal(compiled(x), converted(x))


def test_float_tail_ops_compile_and_an_unsupported_one_names_the_node() -> None:
    class FloatTail(nn.Module):
        def __init__(self, keep: bool) -> None:
            super().__init__()
            self.net = Stubbed(nn.Conv2d(1, 3, 3))
            self.keep = keep

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            p = torch.softmax(self.net(x), dim=1)  # the float part: a float_fn instruction
            return torch.nonzero(p > 0.5) if self.keep else p

    x = torch.randn(*SHAPE)
    for keep in (False, True):
        with march_scope("bayes"):
            prepared = prepare_qat_fx(FloatTail(keep), {"": get_default_qat_qconfig()})
            prepared(torch.randn(*SHAPE))
            converted = convert_fx(prepared.eval())
        if not keep:
            compiled = compile_model(converted, [x], check=False)
            assert torch.equal(compiled(x), converted(x))
            continue
        with pytest.raises(CompileError, match=r"node 'nonzero': function .*nonzero has no lowering rule.*float part"):
            compile_model(converted, [x], check=False)


def test_batch_size_is_free(digits: nn.Module) -> None:
    compiled = compile_model(digits, [torch.randn(1, 1, 28, 28)], opt=1, check=False)
    for n in (1, 3, 17):
        x = torch.randn(n, 1, 28, 28)
        assert torch.equal(compiled(x), digits(x))


def test_program_validation_names_the_problem() -> None:
    bad = Program("bayes", ["x"], "y", [Instruction("clamp", ("z",), ("y",), {"min": 0}, {}, "relu")], {})
    with pytest.raises(ProgramError, match=r"instruction 0 \(clamp, from 'relu'\) uses 'z' before it is defined"):
        bad.validate()
    bad = Program("bayes", ["x"], "y", [Instruction("lut", ("x",), ("y",), {}, {"table": "t"}, "exp")], {})
    with pytest.raises(ProgramError, match="names constant 't'"):
        bad.validate()


def test_float64_requantization_only_where_exact() -> None:
    """The fused conv + add's 31-bit multipliers shrink the accumulator range the float64 path takes."""
    from backends.common.lower import requant_mode

    zero = torch.zeros(4, dtype=torch.int32)
    assert requant_mode(2**30, zero) == "f64"  # M <= 32767 assumed: 2**30 * 2**15 < 2**52
    assert requant_mode(2**30, zero, torch.tensor([32767]), torch.tensor([24])) == "f64"
    assert requant_mode(2**25, zero, torch.tensor([2**31 - 1]), torch.tensor([33])) == "i64"
    assert requant_mode(2**20, zero, torch.tensor([2**30]), torch.tensor([33])) == "f64"
    assert requant_mode(2**20, zero, torch.tensor([2**30]), torch.tensor([60])) == "i64"
    assert requant_mode(2**20, torch.tensor([2**23]), torch.tensor([2**30]), torch.tensor([33])) == "i64"
