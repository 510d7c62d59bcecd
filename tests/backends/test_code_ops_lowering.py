"""compile_model of the ops on codes (abs, clamp, comparisons, pads, max / min, arg-reductions, topk,
gather, shuffles): the artifact, written and loaded again, equals the converted model bit for bit
(torch.equal on codes, booleans and indices); legality on both marches; lowering errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from bitexact_models import fx_converted
from torch import nn
from torch.ao.quantization import DeQuantStub

import qir
from backends.common.kernels.base import get_kernel
from backends.common.program import Instruction
from qir.march import march_scope
from qir.quantization import QuantStub, check_model, compile_model, convert, get_default_qat_qconfig, prepare_qat
from qir.quantization.compile import CompileError

SHAPE = (2, 3, 8, 8)
N_INPUTS = 100


class Net(nn.Module):
    """QuantStub -> conv -> ``op(self, x)``; channels 1 and 2 equal (ties across channels)."""

    def __init__(self, op: Callable[[Net, torch.Tensor], Any]) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        with torch.no_grad():
            self.conv.weight[2] = self.conv.weight[1]
            self.conv.bias[2] = self.conv.bias[1]
        self.dq = DeQuantStub()
        self.dq2 = DeQuantStub()
        self.op = op
        self.register_buffer("index", torch.randint(0, 4, (2, 2, 8, 8), generator=torch.Generator().manual_seed(3)))
        self.cpad = nn.ConstantPad2d((1, 0, 2, 1), 0.25)
        self.rpad = nn.ReplicationPad2d((1, 2, 0, 1))
        self.zpad = nn.ZeroPad2d(1)
        self.shuffle = nn.Sequential(nn.ChannelShuffle(2), nn.PixelUnshuffle(2), nn.PixelShuffle(2))

    def forward(self, x: torch.Tensor) -> Any:
        return self.op(self, self.conv(self.quant(x)))


CASES: dict[str, Callable[[Net, torch.Tensor], Any]] = {
    "abs_clamp": lambda s, x: s.dq(torch.clamp(torch.abs(x), max=0.5)),
    "clamp_both": lambda s, x: s.dq(x.clip(-0.3, 0.2)),
    "compare_number": lambda s, x: (x > 0.1, 0.2 >= x, x == 0.0, x != 0.0, torch.less(x, -0.05)),
    "compare_tensors": lambda s, x: (torch.gt(x, x.flip(1)), x == torch.roll(x, 1, dims=3)),
    "max_dim": lambda s, x: (s.dq(torch.max(x, 1)[0]), torch.max(x, 1)[1]),
    "min_dim_values_attr": lambda s, x: (s.dq(x.min(dim=1, keepdim=True).values), x.min(dim=1).indices),
    "max_min_whole": lambda s, x: (s.dq(torch.max(x)), s.dq2(x.min())),
    "max_two_tensors": lambda s, x: s.dq(torch.max(x, x.flip(1) * 0.5)),
    "argmax_argmin": lambda s, x: (torch.argmax(x, 1), x.argmin(dim=1, keepdim=True), x.argmax()),
    "topk": lambda s, x: (s.dq(torch.topk(x, 2, dim=1)[0]), torch.topk(x, 3, dim=1, largest=False).indices),
    "gather_buffer": lambda s, x: s.dq(torch.gather(x, 1, s.index)),
    "gather_topk": lambda s, x: s.dq(x.gather(1, torch.topk(x, 2, dim=1)[1])),
    "pad_functional": lambda s, x: (
        s.dq(F.pad(x, (1, 1, 2, 0), value=0.37)),
        s.dq2(F.pad(x, (1, 1, 1, 1), "replicate")),
    ),
    "pad_modules": lambda s, x: s.dq(s.rpad(s.zpad(s.cpad(x)))),
    "shuffle_modules": lambda s, x: s.dq(s.shuffle(x)),
    "shuffle_functions": lambda s, x: s.dq(F.pixel_shuffle(F.channel_shuffle(x, 2), 2)),
}


def _outputs(v: Any) -> tuple[Any, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def _assert_same(got: Any, want: Any) -> None:
    for g, w in zip(_outputs(got), _outputs(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_artifact_equals_the_converted_model(tmp_path: Path, name: str) -> None:
    converted = fx_converted(Net(CASES[name]), SHAPE, "bayes", batches=2)
    path = tmp_path / "m.hbm"
    compile_model(converted, [torch.randn(*SHAPE)], hbm=path, march="bayes", opt=1)
    run = qir.load_compiled(path)  # every kernel attribute survives the artifact file
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N_INPUTS, *SHAPE[1:], generator=g) * 2
    with torch.no_grad():
        _assert_same(run(x), converted(x))


def test_reflect_pad_compiles_but_is_illegal_on_bayes(tmp_path: Path) -> None:
    converted = fx_converted(Net(lambda s, x: s.dq(F.pad(x, (1, 1, 1, 1), mode="reflect"))), SHAPE, "bayes")
    with pytest.raises(CompileError, match=r"mode = 'reflect' violates"):
        compile_model(converted, [torch.randn(*SHAPE)], march="bayes")
    run = compile_model(converted, [torch.randn(*SHAPE)], march="bayes", check=False)
    x = torch.randn(*SHAPE)
    _assert_same(run(x), converted(x))


class _EagerNet(nn.Module):
    """Tensor-method spellings through the eager flow (the lowering sees call_method nodes)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.dequant = DeQuantStub()
        self.shuffle = nn.PixelShuffle(2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.conv(self.quant(x))
        values, indices = y.max(1, keepdim=True)
        top = y.topk(2, dim=1)
        return (
            self.dequant(self.shuffle(values.expand(-1, 4, -1, -1))),
            indices,
            y.argmin(dim=1),
            y.gt(y.flip((1,))),
            y.gather(1, top.indices),
            y.min(dim=1).values,
        )


def test_eager_converted_model_with_tensor_methods_compiles_bit_exact() -> None:
    with march_scope("bayes"):
        model = _EagerNet()
        model.qconfig = get_default_qat_qconfig()
        prepare_qat(model, inplace=True)
        model(torch.randn(*SHAPE))
        converted = convert(model.eval(), inplace=False)
        run = compile_model(converted, [torch.randn(*SHAPE)], opt=1, check=False)
    x = torch.randn(N_INPUTS, *SHAPE[1:])
    with torch.no_grad():
        _assert_same(run(x), converted(x))


# ---------------------------------------------------------------------------------------------
# legality: Bernoulli2's table refuses what it does not run; the converted model's integer forms
# are checked as the ops they compute


B2_UNSUPPORTED: dict[str, Callable[[Net, torch.Tensor], Any]] = {
    "torch.abs": lambda s, x: s.dq(torch.abs(x)),
    "torch.clamp": lambda s, x: s.dq(torch.clamp(x, 0.0, 1.0)),
    "torch.greater": lambda s, x: x > 0.5,
    "torch.eq": lambda s, x: x == x.flip(1),
    "torch.gather": lambda s, x: s.dq(torch.gather(x, 1, s.index)),
    "torch.topk": lambda s, x: s.dq(torch.topk(x, 2, dim=1)[0]),
    "torch.nn.functional.pad": lambda s, x: s.dq(F.pad(x, (1, 1))),
}


@pytest.mark.parametrize("spelling", sorted(B2_UNSUPPORTED))
def test_bernoulli2_refuses_ops_its_table_does_not_run(spelling: str) -> None:
    op = B2_UNSUPPORTED[spelling]
    x = torch.randn(*SHAPE)
    converted = fx_converted(Net(op), SHAPE, "bayes")  # the integer model exists; bernoulli2 cannot run it
    for model in (Net(op).eval(), converted):
        b2 = check_model(model, x, march="bernoulli2")
        assert not b2.ok and spelling in {v.spelling for v in b2.unsupported}, str(b2)
        bayes = check_model(model, x, march="bayes")
        assert bayes.ok and spelling not in {v.spelling for v in bayes.violations}, str(bayes)


def test_compile_for_bernoulli2_refuses_abs() -> None:
    with march_scope("bernoulli2"):
        net = Net(lambda s, x: s.dq(torch.abs(x)))
        converted = fx_converted(net, SHAPE, "bernoulli2")
        with pytest.raises(CompileError, match=r"torch\.abs is not supported on bernoulli2"):
            compile_model(converted, [torch.randn(*SHAPE)])


def test_shuffles_are_legal_on_both_marches() -> None:
    for march in ("bayes", "bernoulli2"):
        converted = fx_converted(Net(CASES["shuffle_modules"]), SHAPE, march)
        report = check_model(converted, torch.randn(*SHAPE), march=march)
        assert report.ok, str(report)


# ---------------------------------------------------------------------------------------------
# kernels


def test_compare_kernel_bounds_beyond_the_dtype_are_exact() -> None:
    k = get_kernel("compare")
    x = torch.arange(-128, 128, dtype=torch.int8)
    run = lambda attrs: k.run(Instruction("compare", ("x",), ("y",), attrs), [x], None)[0]
    assert not run({"op": "gt", "lo": 128, "hi": None}).any()  # no int8 code reaches 128 (no wrap to -128)
    assert run({"op": "le", "lo": None, "hi": 200}).all()
    assert torch.equal(run({"op": "ne", "lo": 3, "hi": 3, "negate": True}), x != 3)


def test_abs_kernel_saturates_the_most_negative_code() -> None:
    k = get_kernel("abs")
    for dt in (torch.int8, torch.int16):
        lo = torch.iinfo(dt).min
        x = torch.tensor([lo, lo + 1, 0, 5], dtype=dt)
        got = k.run(Instruction("abs", ("x",), ("y",), {}), [x], None)[0]
        assert got.tolist() == [-(lo + 1), -(lo + 1), 0, 5] and got.dtype == dt


def test_picture_knows_the_scales_of_codes_ops_keep(tmp_path: Path) -> None:
    from qir.quantization import visualize_model

    net = Net(lambda s, x: (s.dq(torch.topk(x, 2, dim=1)[0]), s.dq2(torch.max(torch.abs(x), 1)[0]), x > 0.1))
    converted = fx_converted(net, SHAPE, "bayes")
    visualize_model(converted, torch.randn(*SHAPE), save_path=tmp_path / "m.svg", march="bayes")
    svg = (tmp_path / "m.svg").read_text()
    assert "qint8 2x2x8x8 scale 0." in svg and "scale ?" not in svg


@pytest.mark.parametrize("name", ["abs_clamp", "compare_number", "pad_modules", "topk", "max_dim"])
def test_qint16_codes_compile_bit_exact(name: str) -> None:
    qd = {"": get_default_qat_qconfig("qint16")}
    converted = fx_converted(Net(CASES[name]), SHAPE, "bayes", batches=2, qconfig_dict=qd)
    run = compile_model(converted, [torch.randn(*SHAPE)], march="bayes", opt=1, check=False)
    x = torch.randn(N_INPUTS, *SHAPE[1:]) * 2
    with torch.no_grad():
        _assert_same(run(x), converted(x))
