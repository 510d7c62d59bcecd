"""Modules called inside an ``fx_helper.wrap``-ed method are prepared and converted
(qir/quantization/wrapped_modules.py): QAT classes at their own paths, an input QuantStub
recording the input scale, integer modules between quantize / dequantize after convert_fx."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import qir.nn.qat as qat_nn
import qir.nn.quantized as int_nn
from qir.march import march_scope
from qir.nn.quantized import QUANTIZED_MODULE_MAP
from qir.quantization import (
    QuantStub,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.convert import CONVERT_PATH_KEY
from qir.quantization.exact_validation import set_exact_validation
from qir.quantization.integer_grid import integer_grid_report, set_integer_grid
from qir.quantization.wrapped_modules import WrappedModuleCall, quant_stub_path
from qir.quantization.wrapped_self import wrapped_selves
from qir.utils.fx_helper import wrap
from tests.real_users.test_wrap_modules import trained_retinanet


class ConvInWrap(nn.Module):
    """A wrapped method that calls a conv and a ReLU on a graph tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.post_conv = nn.Conv2d(8, 4, 1)
        self.post_relu = nn.ReLU()

    @wrap()
    def post(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_relu(self.post_conv(x)).flatten(1).topk(5, dim=1)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.conv(self.quant(x)))


@pytest.fixture(params=["bayes", "bernoulli2"])
def march(request: pytest.FixtureRequest) -> Iterator[str]:
    torch.manual_seed(0)
    with march_scope(request.param):
        yield request.param


def _trained(model: nn.Module, qconfig: dict | None = None) -> torch.fx.GraphModule:
    x = torch.randn(2, 3, 8, 8)
    qat = prepare_qat_fx(model, qconfig or {"": get_default_qat_qconfig()}, (x,))
    for _ in range(3):
        qat(torch.randn(2, 3, 8, 8) * 2)
    return qat


def test_prepared_in_place_with_graph_module_keys(march: str) -> None:
    model = ConvInWrap()
    float_state = copy.deepcopy(model.state_dict())
    qat = _trained(model)
    assert isinstance(qat.post_conv, qat_nn.Conv2d)
    # the keys a graph conv of the same class has, under the module's own path
    suffixes = {k.removeprefix("conv.") for k in qat.state_dict() if k.startswith("conv.")}
    assert {k.removeprefix("post_conv.") for k in qat.state_dict() if k.startswith("post_conv.")} == suffixes
    stub = quant_stub_path("post_conv")
    assert stub == "_generated_wrapped_quant_post_conv"
    assert f"{stub}.activation_post_process.scale" in qat.state_dict()
    # a ReLU has no scale of its own: it computes the same on float values and stays float
    assert not any(k.startswith("post_relu") for k in qat.state_dict())
    # the wrapped method calls the GraphModule's own modules: trained with it, and the input scale observed
    (bound,) = wrapped_selves(qat)
    call = bound.post_conv
    assert (
        isinstance(call, WrappedModuleCall) and call.module is qat.post_conv and call.quant is qat.get_submodule(stub)
    )
    assert any(p is qat.post_conv.weight for p in qat.parameters())
    qat(torch.randn(2, 3, 8, 8)).sum().backward()
    assert qat.post_conv.weight.grad is not None and qat.post_conv.weight.grad.abs().sum() > 0
    assert float(call.quant.activation_post_process.scale) != 1.0  # observed, not the initial scale
    # the user's model is untouched
    assert type(model.post_conv) is nn.Conv2d
    assert all(torch.equal(v, float_state[k]) for k, v in model.state_dict().items())


def test_qat_fake_quantizes_inside_the_wrapped_method(march: str) -> None:
    model = ConvInWrap()
    kept_float = _trained(copy.deepcopy(model), {"": get_default_qat_qconfig(), "module_name": [("post_conv", None)]})
    assert type(wrapped_selves(kept_float)[0].post_conv) is nn.Conv2d  # qconfig None: float, as before
    assert not any(k.startswith(("post_conv", "_generated_wrapped")) for k in kept_float.state_dict())
    qat = _trained(model)
    x = torch.randn(2, 3, 8, 8)
    seen: list[torch.Tensor] = []
    qat.post_conv.register_forward_hook(lambda m, a, out: seen.append(out))
    qat.train()
    y_qat = qat(x)
    out_scale = qat.post_conv.activation_post_process.scale
    codes = seen[0] / out_scale
    assert torch.equal(codes, codes.round())  # the conv's output is on its fake-quant grid
    # with the same graph part, the float conv inside gives different values
    kept_float.load_state_dict({k: v for k, v in qat.state_dict().items() if k in kept_float.state_dict()})
    wrapped_selves(kept_float)[0].post_conv.load_state_dict(
        {k: v for k, v in qat.post_conv.state_dict().items() if k in ("weight", "bias")}
    )
    kept_float.train()
    assert not torch.equal(kept_float(x), y_qat)


def _integer_inputs(converted: nn.Module, x: torch.Tensor) -> list[torch.dtype]:
    dtypes: list[torch.dtype] = []
    handle = converted.post_conv.register_forward_hook(lambda m, a, out: dtypes.append(a[0].dtype))
    converted(x)
    handle.remove()
    return dtypes


def test_converted_equals_qat_validation_on_both_paths(march: str) -> None:
    qat = _trained(ConvInWrap())
    before = copy.deepcopy(qat.state_dict())
    by_pass = convert_fx(qat)
    assert by_pass.meta[CONVERT_PATH_KEY] == "quantize pass"
    swapped = convert_fx(qat, mapping=dict(QUANTIZED_MODULE_MAP))
    assert swapped.meta[CONVERT_PATH_KEY].startswith("module swap")
    assert all(torch.equal(v, before[k]) for k, v in qat.state_dict().items())  # the QAT model is untouched
    for c in (by_pass, swapped):
        assert isinstance(c.post_conv, int_nn.Conv2d)
        assert isinstance(c.get_submodule(quant_stub_path("post_conv")), int_nn.QuantStub)
        assert wrapped_selves(c)[0] is not wrapped_selves(qat)[0]
    x = torch.randn(4, 3, 8, 8) * 2
    assert _integer_inputs(by_pass, x) == [torch.int8]
    sp, ss = by_pass.state_dict(), swapped.state_dict()
    assert list(sp) == list(ss) and all(torch.equal(sp[k], ss[k]) for k in sp)
    assert torch.equal(by_pass(x), swapped(x))
    qat.eval()
    set_fake_quantize(qat, "validation")
    assert torch.equal(qat(x), by_pass(x))  # the integer twin: bit for bit
    # against float fake quantization: the conv's requantization, 1 LSB of its output
    set_exact_validation(qat, False)
    lsb = float(by_pass.post_conv.scale)
    assert (qat(x) - by_pass(x)).abs().max() <= 2 * lsb + 1e-6


def test_deep_copies_call_their_own_modules(march: str) -> None:
    qat = _trained(ConvInWrap())
    copied = copy.deepcopy(qat)
    assert wrapped_selves(copied)[0].post_conv.module is copied.post_conv
    assert wrapped_selves(qat)[0].post_conv.module is qat.post_conv
    with torch.no_grad():
        copied.post_conv.weight.mul_(0.5)
    x = torch.randn(2, 3, 8, 8)
    assert not torch.equal(qat(x), copied(x))
    converted = convert_fx(copied)
    assert wrapped_selves(converted)[0].post_conv.module is converted.post_conv


def test_calibration_then_qat_carries_the_input_scale(march: str) -> None:
    calib = _trained(ConvInWrap(), {"": get_default_calib_qconfig()})
    stub = quant_stub_path("post_conv")
    calib_scale = calib.get_submodule(stub).activation_post_process.scale.clone()
    qat = prepare_qat_fx(calib, {"": get_default_qat_qconfig()})
    assert isinstance(qat.post_conv, qat_nn.Conv2d)
    assert torch.equal(qat.get_submodule(stub).activation_post_process.scale, calib_scale)
    assert isinstance(wrapped_selves(qat)[0].post_conv, WrappedModuleCall)


class TwoArgs(ConvInWrap):
    @wrap()
    def post(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_conv(x, x)  # type: ignore[call-arg]


def test_a_call_that_is_not_one_float_tensor_is_refused_by_name(march: str) -> None:
    qat = prepare_qat_fx(TwoArgs(), {"": get_default_qat_qconfig()})
    with pytest.raises(TypeError, match=r"module 'post_conv' \(Conv2d\) is called inside a wrapped method"):
        qat(torch.randn(2, 3, 8, 8))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.Conv2d(8, 8, 3, padding=1)
        self.extra = nn.Sequential(nn.Conv2d(8, 2, 1))

    @wrap()
    def decode(self, f: torch.Tensor) -> torch.Tensor:
        return self.extra(f).sigmoid()

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return self.decode(self.tower(f))


class Nested(nn.Module):
    """The wrapped method belongs to a submodule: paths are the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(self.quant(x)))


def test_a_submodule_s_wrapped_method_by_module_name(march: str) -> None:
    qat = _trained(Nested())
    assert isinstance(qat.get_submodule("head.extra.0"), qat_nn.Conv2d)
    assert "head.extra.0.weight" in qat.state_dict()
    assert f"{quant_stub_path('head.extra.0')}.activation_post_process.scale" in qat.state_dict()
    off = _trained(Nested(), {"": get_default_qat_qconfig(), "module_name": [("head.extra", None)]})
    assert "head.extra.0.weight" not in off.state_dict()
    converted = convert_fx(qat)
    assert isinstance(converted.get_submodule("head.extra.0"), int_nn.Conv2d)
    x = torch.randn(2, 3, 8, 8)
    qat.eval()
    set_fake_quantize(qat, "validation")
    assert torch.equal(qat(x), converted(x))


class CallsGraphConv(ConvInWrap):
    @wrap()
    def post(self, x: torch.Tensor) -> torch.Tensor:
        assert self.conv.out_channels == 8  # attributes read the float module's
        return self.post_conv(x) + self.conv(torch.zeros(1, 3, 8, 8))


def test_a_graph_module_called_inside_is_refused_by_name(march: str) -> None:
    qat = prepare_qat_fx(CallsGraphConv(), {"": get_default_qat_qconfig()})
    with pytest.raises(RuntimeError, match=r"module 'conv' \(Conv2d\) is called by the traced graph.*its own module"):
        qat(torch.randn(2, 3, 8, 8))


def test_retinanet_by_the_pass_equals_module_swap(march: str) -> None:
    """tests/real_users/test_wrap_modules.py's RetinaNet (an IoU conv branch in its wrapped
    post-process): both convert paths give the same integer model."""
    qat = trained_retinanet()
    by_pass = convert_fx(qat)
    assert by_pass.meta[CONVERT_PATH_KEY] == "quantize pass"
    swapped = convert_fx(qat, mapping=dict(QUANTIZED_MODULE_MAP))
    x = torch.randn(8, 3, 32, 32)
    assert all(torch.equal(a, b) for a, b in zip(by_pass(x), swapped(x), strict=True))
    sp, ss = by_pass.state_dict(), swapped.state_dict()
    assert list(sp) == list(ss) and all(torch.equal(sp[k], ss[k]) for k in sp)
    assert "_generated_wrapped_dequant_iou.scale" in sp


def test_trains_on_the_integer_grid_of_its_input_stub(march: str) -> None:
    qat = _trained(ConvInWrap())
    report = integer_grid_report(qat)
    assert report["post_conv"] == "grid"  # bound to its input QuantStub's fake quant, ran on the grid
    assert report["conv"] == "grid"
    set_integer_grid(qat, False)
    assert integer_grid_report(qat)["post_conv"] == "integer grid off"
    set_integer_grid(qat, True)
    qat(torch.randn(2, 3, 8, 8))
    assert integer_grid_report(qat)["post_conv"] == "grid"


class WideInWrap(ConvInWrap):
    def __init__(self) -> None:
        super().__init__()
        self.post_conv = nn.Conv2d(8, 16, 3, padding=1)


def test_a_training_forward_on_the_grid_equals_the_converted_module(march: str) -> None:
    """With the observers frozen, the QAT conv inside the wrapped method computes in training what
    the converted one computes (float fake quantization differed in 1 (bayes) / 279 (bernoulli2)
    of these 8192 outputs)."""
    from qir.quantization.fake_quantize import FakeQuantize

    qat = _trained(WideInWrap())
    for m in qat.modules():
        if isinstance(m, FakeQuantize):
            m.disable_observer()
    converted = convert_fx(qat)
    outs: list[list[torch.Tensor]] = [[], []]
    for model, seen in zip((qat, converted), outs, strict=True):
        wrapped_selves(model)[0].post_conv.register_forward_hook(lambda m, a, out, seen=seen: seen.append(out))
    x = torch.randn(8, 3, 8, 8) * 2
    qat.train()
    assert torch.equal(qat(x), converted(x))
    assert torch.equal(outs[0][0], outs[1][0])
