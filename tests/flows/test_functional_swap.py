"""prepare_qat_fx swaps functional ops with their own output scale (bilinear interpolate, LUT ops) for modules."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qir.nn
from qir.nn import qat, quantized
from qir.nn.qat.activation import LUT_FLOAT_CLASSES
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.functional_swap import FUNCTIONAL_MODULES

SHAPE = (4, 3, 8, 8)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        up = F.interpolate(self.conv(x), scale_factor=2, mode="bilinear", align_corners=False)
        return torch.sigmoid(up), up.exp(), torch.tanh(x), up


class Net(nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.extra = nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU()) if extra else None
        self.head = Head()
        self.dequant = nn.ModuleList([DeQuantStub() for _ in range(5)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.conv(self.quant(x))
        if self.extra is not None:
            x = self.extra(x) + torch.sigmoid(x)  # an unrelated layer, and a sigmoid at the root
        s, e, t, up = self.head(x)
        near = F.interpolate(x, scale_factor=2, mode="nearest")  # scale-preserving: stays functional
        outs = (s, e, t, up, near)
        return tuple(dq(o) for dq, o in zip(self.dequant, outs, strict=True))


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*SHAPE, generator=g) for _ in range(n)]


def _flow(model: nn.Module) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Calibration (a few batches) -> QAT (a few steps) -> frozen scales; (qat model, converted)."""
    calib = prepare_qat_fx(model, {"": get_default_calib_qconfig()}, example_inputs=torch.randn(*SHAPE))
    calib.eval()
    with torch.no_grad():
        for x in _batches(3):
            calib(x)
    qat_model = prepare_qat_fx(calib, {"": get_default_qat_qconfig()})
    opt = torch.optim.SGD(qat_model.parameters(), lr=0.01)
    qat_model.train()
    for x in _batches(3):
        loss = sum(o.square().mean() for o in qat_model(x))
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    qat_model.eval()
    set_fake_quantize(qat_model, "validation")
    return qat_model, convert_fx(qat_model)


GENERATED = {
    "head._generated_interpolate_0": (qir.nn.Interpolate, qat.Interpolate, quantized.Interpolate),
    "head._generated_sigmoid_0": (nn.Sigmoid, qat.UnaryLUT, quantized.UnaryLUT),
    "head._generated_exp_0": (qir.nn.Exp, qat.UnaryLUT, quantized.UnaryLUT),
    "head._generated_tanh_0": (nn.Tanh, qat.UnaryLUT, quantized.UnaryLUT),
}


def test_calibrate_qat_convert() -> None:
    model = Net()
    qat_model, converted = _flow(model)
    float_model = qat_model.meta["qir.prepare_record"].float_model
    for path, (float_cls, qat_cls, q_cls) in GENERATED.items():
        assert type(float_model.get_submodule(path)) is float_cls, path
        assert type(qat_model.get_submodule(path)) is qat_cls, path
        assert type(converted.get_submodule(path)) is q_cls, path
    up = float_model.get_submodule("head._generated_interpolate_0")
    assert (up.scale_factor, up.mode, up.align_corners) == (2, "bilinear", False)
    assert "interpolate" in qat_model.code and "nearest" in qat_model.code  # nearest stays functional
    # each output's scale: the generated module's fake quant; the nearest output keeps the conv's
    outputs = [
        "head._generated_sigmoid_0",
        "head._generated_exp_0",
        "head._generated_tanh_0",
        "head._generated_interpolate_0",
        "conv",
    ]
    x = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        q_outs, f_outs = converted(x), qat_model(x)
    for path, q, f in zip(outputs, q_outs, f_outs, strict=True):
        s = float(qat_model.get_submodule(path).activation_post_process.scale.max())
        assert q.shape == f.shape
        assert float((q - f).abs().max()) <= 2 * s + 1e-6, path  # within a few LSB of the output scale
    with pytest.warns(torch.jit.TracerWarning):
        traced = torch.jit.trace(converted, x)
    for a, b in zip(traced(x), q_outs, strict=True):
        assert torch.equal(a, b)


def test_input_model_not_mutated() -> None:
    model = Net()
    before = copy.deepcopy(model.state_dict())
    tree = repr(model)
    _flow(model)
    assert repr(model) == tree
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(n.startswith("_generated") or "._generated" in n for n, _ in model.named_modules())


def test_names_stable_when_a_layer_is_added() -> None:
    def generated(m: nn.Module) -> set[str]:
        gm = prepare_qat_fx(m, {"": get_default_qat_qconfig()})
        return {n for n, _ in gm.named_modules() if n.rpartition(".")[2].startswith("_generated_")}

    plain, extended = generated(Net()), generated(Net(extra=True))
    assert set(GENERATED) <= plain
    assert plain <= extended
    assert extended - plain == {"_generated_sigmoid_0", "_generated_add_0"}


class Spellings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        y = x.sigmoid() + F.sigmoid(x) + x.tanh() + F.gelu(x, approximate="tanh") + F.silu(x) + F.hardswish(x)
        y = y + F.leaky_relu(x, 0.2) + torch.log(x) + x**0.5 + torch.special.erf(x)
        y = y + F.upsample_bilinear(x, scale_factor=2)[..., ::2, ::2]
        return torch.sigmoid(self.dequant(y))  # on a float tensor: stays a float op


@pytest.mark.filterwarnings("ignore:`nn.functional.upsample_bilinear` is deprecated")
def test_spellings() -> None:
    gm = prepare_qat_fx(Spellings(), {"": get_default_qat_qconfig()})
    fm = gm.meta["qir.prepare_record"].float_model
    kinds = {n: type(m) for n, m in fm.named_modules() if n.startswith("_generated_") and "add" not in n}
    assert kinds == {
        "_generated_sigmoid_0": nn.Sigmoid,
        "_generated_sigmoid_1": nn.Sigmoid,
        "_generated_tanh_0": nn.Tanh,
        "_generated_gelu_0": nn.GELU,
        "_generated_silu_0": nn.SiLU,
        "_generated_hardswish_0": nn.Hardswish,
        "_generated_leaky_relu_0": nn.LeakyReLU,
        "_generated_log_0": qir.nn.HardLog,
        "_generated_pow_0": qir.nn.Pow,
        "_generated_erf_0": qir.nn.Erf,
        "_generated_interpolate_0": qir.nn.Interpolate,
    }
    assert fm.get_submodule("_generated_gelu_0").approximate == "tanh"
    assert fm.get_submodule("_generated_leaky_relu_0").negative_slope == 0.2
    assert fm.get_submodule("_generated_pow_0").exponent == 0.5
    assert fm.get_submodule("_generated_interpolate_0").align_corners is True
    assert "torch.sigmoid(dequant)" in gm.code
    x = torch.rand(2, 3, 8, 8) + 0.1
    torch.testing.assert_close(fm(x), Spellings()(x))  # the float model computes what the user's did
    gm.train()
    gm(x)
    gm.eval()
    set_fake_quantize(gm, "validation")
    assert convert_fx(gm)(x).shape == (2, 3, 8, 8)


def test_module_type_qconfig_names_the_torch_function() -> None:
    """A ``module_type`` key may be the replaced function: the generated Exp gets that qconfig."""
    from qir.quantization import get_default_qat_out_qconfig

    qd = {"": get_default_qat_qconfig(), "module_type": {torch.exp: get_default_qat_out_qconfig()}}
    with pytest.raises((TypeError, ValueError), match="UnaryLUT"):  # exp has no high-precision form
        prepare_qat_fx(Net(), qd)


class RuntimeSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.dequant(F.interpolate(self.quant(x), size=y.shape[-2:], mode="bilinear"))


def test_runtime_size_is_passed_to_the_generated_module() -> None:
    """``size=y.shape[-2:]`` (a run-time size) becomes the generated module's call argument: QAT
    resizes to each call's size and fake-quantizes, the converted module resizes codes to it."""
    gm = prepare_qat_fx(RuntimeSize(), {"": get_default_qat_qconfig()})
    assert [n for n, _ in gm.named_children() if "_generated_interpolate" in n] == ["_generated_interpolate_0"]
    x = torch.randn(1, 2, 4, 4)
    gm(x, torch.randn(1, 2, 8, 8))
    gm.eval()
    converted = convert_fx(gm)
    for h, w in ((8, 8), (6, 10)):
        y = torch.randn(1, 2, h, w)
        q, c = gm(x, y), converted(x, y)
        assert q.shape == c.shape == (1, 2, h, w)
        assert (c - q).abs().max() <= 2 * float(gm._generated_interpolate_0.activation_post_process.scale) + 1e-6


def test_table_matches_the_library() -> None:
    """Every table entry builds a module QAT_MODULE_MAP maps; every LUT class of the library has a spelling."""
    from qir.ir.op import OP_REGISTRY  # type: ignore[attr-defined]

    built: set[type] = set()
    for name, factory in FUNCTIONAL_MODULES.items():
        op_cls = OP_REGISTRY[name]
        op = (
            op_cls(other=2.0)
            if name == "pow"
            else op_cls(scale_factor=2, mode="bilinear")
            if name == "interpolate"
            else op_cls()
        )
        m = factory(op)
        assert m is not None and type(m) in qir.nn.QAT_MODULE_MAP, name
        built.add(type(m))
    # qir.nn.Selu is torch's nn.SELU as a functional (F.selu); Pow covers x ** c and square
    lut = {*qir.nn.UNARY_MODULES.values(), *LUT_FLOAT_CLASSES} - {qir.nn.Selu}
    assert lut <= built, lut - built


@pytest.mark.parametrize("cls", [nn.Sigmoid, nn.Tanh, nn.SiLU, nn.GELU, nn.Hardsigmoid, nn.Hardswish])
def test_torch_activation_modules_map(cls: type[nn.Module]) -> None:
    assert qir.nn.QAT_MODULE_MAP.get(cls) is qat.UnaryLUT
