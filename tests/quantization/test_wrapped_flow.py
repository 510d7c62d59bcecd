"""The plugin user's whole flow on a model whose ``fx_wrap``-ed post-process calls modules of
its own (tests/real_users/test_wrap_modules.py's RetinaNet: conv, conv + ReLU): calibration,
a checkpoint loaded strictly into a fresh QAT model, training, validation, convert; pickling
(``torch.save`` of the whole model), deep copies, ``.to`` / ``.train`` / ``.eval``; and the
qconfig rules (calibration and QAT kinds, ``module_name`` / ``module_type`` / ``None``) on the
modules the wrapped code calls."""

from __future__ import annotations

import copy
import io
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import qir.nn.qat as qat_nn
import qir.nn.quantized as int_nn
from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    FakeQuantState,
    QATGraphModule,
    QuantStub,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.wrapped_modules import WrappedModuleCall
from qir.quantization.wrapped_self import wrapped_selves
from qir.utils.fx_helper import wrap
from tests.real_users.test_wrap_modules import RetinaNet

WRAPPED = ("iou_tower", "iou")


@pytest.fixture(params=["bayes", "bernoulli2"])
def march(request: pytest.FixtureRequest) -> Iterator[str]:
    torch.manual_seed(0)
    with march_scope(request.param):
        yield request.param


def _images(n: int = 4) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32)


def _equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _reloaded(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)  # type: ignore[no-any-return]


def _train(qat: nn.Module, steps: int = 3) -> None:
    qat.train()
    set_fake_quantize(qat, FakeQuantState.QAT)
    optimizer = torch.optim.SGD(qat.parameters(), lr=1e-3)
    for _ in range(steps):
        box, score, _ = qat(_images())
        (box.mean() - score.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()


def _calibrated_checkpoint() -> dict[str, torch.Tensor]:
    calib = prepare_qat_fx(RetinaNet(), {"": get_default_calib_qconfig()}, (_images(2),))
    calib.eval()
    set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for _ in range(3):
            calib(_images())
    buf = io.BytesIO()
    torch.save(calib.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf)  # type: ignore[no-any-return]


def test_the_seed_flow_calibration_checkpoint_qat_convert(march: str) -> None:
    """The seeds' order: calibrate, save the state dict, a fresh prepare_qat_fx with the QAT qconfig,
    load_state_dict(strict=True), train, validate, convert: validation == converted bit for bit."""
    checkpoint = _calibrated_checkpoint()
    assert "_generated_wrapped_quant_iou.activation_post_process.scale" in checkpoint
    qat = prepare_qat_fx(RetinaNet(), {"": get_default_qat_qconfig()}, (_images(2),))
    qat.load_state_dict(checkpoint, strict=True)
    for path in WRAPPED:  # the calibrated input scales reach the wrapped modules' stubs
        key = f"_generated_wrapped_quant_{path}.activation_post_process.scale"
        assert torch.equal(qat.state_dict()[key], checkpoint[key])
    _train(qat)
    qat.eval()
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    converted = convert_fx(qat)
    for path in WRAPPED:
        assert isinstance(converted.get_submodule(path), int_nn.Conv2d)
    x = _images(8)
    assert _equal(qat(x), converted(x))


def test_torch_save_of_the_prepared_and_converted_model(march: str) -> None:
    """fx pickles a wrapped method call as an import it cannot write; the loaded model must still
    be a QAT model (integer-exact validation), call its own loaded modules, and convert the same."""
    qat = prepare_qat_fx(RetinaNet(), {"": get_default_qat_qconfig()}, (_images(2),))
    _train(qat)
    qat.eval()
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    converted = convert_fx(qat)
    x = _images(8)
    loaded_qat = _reloaded(qat)
    assert isinstance(loaded_qat, QATGraphModule)
    assert _equal(loaded_qat(x), converted(x))
    call = wrapped_selves(loaded_qat)[0].iou
    assert isinstance(call, WrappedModuleCall) and call.module is loaded_qat.get_submodule("iou")
    assert _equal(convert_fx(loaded_qat)(x), converted(x))
    loaded = _reloaded(converted)
    assert _equal(loaded(x), converted(x))
    assert wrapped_selves(loaded)[0].iou.module is loaded.get_submodule("iou")
    # training goes on after a load: the wrapped modules are the loaded model's parameters
    _train(loaded_qat, steps=1)
    assert not torch.equal(loaded_qat.get_submodule("iou").weight, qat.get_submodule("iou").weight)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 8, 3)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.conv2(self.conv(self.quant(x)).relu()))


def test_torch_save_keeps_integer_exact_validation_without_wrapped_calls(march: str) -> None:
    """fx's own pickling reloads a plain GraphModule: its validation ran the float simulation, not
    the integer twin, and its meta (prepare record, integer-grid switch) was empty."""
    qat = prepare_qat_fx(Plain(), {"": get_default_qat_qconfig()}, (torch.randn(2, 3, 16, 16),))
    for _ in range(3):
        qat(torch.randn(4, 3, 16, 16))
    qat.eval()
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    loaded = _reloaded(qat)
    assert isinstance(loaded, QATGraphModule) and loaded.meta.keys() == qat.meta.keys()
    x = torch.randn(8, 3, 16, 16) * 3
    assert torch.equal(loaded(x), convert_fx(qat)(x))


@pytest.mark.filterwarnings("ignore:GraphModule runs under eval")  # eval() in QAT state: the wrapped code runs
def test_deep_copies_modes_and_devices_follow(march: str) -> None:
    qat = prepare_qat_fx(RetinaNet(), {"": get_default_qat_qconfig()}, (_images(2),))
    _train(qat, steps=1)
    converted = convert_fx(qat)
    for model in (qat, converted):
        copied = copy.deepcopy(model)
        bound = wrapped_selves(copied)[0]
        for path in WRAPPED:
            assert bound.get_submodule(path).module is copied.get_submodule(path)
            assert bound.get_submodule(path).quant is copied.get_submodule(f"_generated_wrapped_quant_{path}")
        moved = copied.to(torch.device("cpu"))
        assert moved is copied
        for mode in (True, False):
            copied.train(mode)
            copied(_images(1))
            assert wrapped_selves(copied)[0].training is mode
            assert all(m.training is mode for m in wrapped_selves(copied)[0].iou.modules())


def test_mixed_calibration_and_qat_qconfigs_are_refused_on_wrapped_modules(march: str) -> None:
    calib, qat = get_default_calib_qconfig(), get_default_qat_qconfig()
    for graph, inner in ((calib, qat), (qat, calib)):
        with pytest.raises(ValueError, match=r"calibration and QAT qconfigs cannot be mixed.*'iou"):
            prepare_qat_fx(RetinaNet(), {"": graph, "module_name": [("iou", inner), ("iou_tower", inner)]})
    # one kind everywhere, or None inside: prepared
    kept = prepare_qat_fx(RetinaNet(), {"": calib, "module_name": [("iou", None), ("iou_tower", None)]})
    assert isinstance(wrapped_selves(kept)[0].iou, nn.Conv2d)


def test_module_type_module_name_and_attributes_reach_wrapped_modules(march: str) -> None:
    qat_qc = get_default_qat_qconfig()
    by_type = prepare_qat_fx(RetinaNet(), {"module_type": [(nn.Conv2d, qat_qc)]})
    assert all(isinstance(by_type.get_submodule(p), qat_nn.Conv2d) for p in WRAPPED)
    by_name = prepare_qat_fx(RetinaNet(), {"": qat_qc, "module_name": [("iou", None)]})
    assert isinstance(by_name.get_submodule("iou_tower"), qat_nn.Conv2d)
    assert "iou.weight" not in by_name.state_dict() and "iou_tower.weight" in by_name.state_dict()
    model = RetinaNet()
    model.qconfig = qat_qc  # the plugin's set-qconfig style: an attribute on the owner
    by_attr = prepare_qat_fx(model)
    assert all(isinstance(by_attr.get_submodule(p), qat_nn.Conv2d) for p in WRAPPED)
    # the module's own path: the plugin's state-dict keys
    assert {"iou.weight", "iou.bias", "iou_tower.weight", "iou.activation_post_process.scale"} <= set(
        by_attr.state_dict()
    )


class Branches(nn.Module):
    """Seed 001's RetinaNet computes losses under ``if self.training`` in its wrapped post-process."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.post_conv = nn.Conv2d(8, 4, 1)
        self.modes: list[bool] = []

    @wrap()
    def post(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.training)
        return self.post_conv(x).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.conv(self.quant(x)))


def test_eval_reaches_the_wrapped_code_before_convert_runs_it(march: str) -> None:
    """convert_fx runs the QAT model's wrapped code for typing, outside its forward: after a training
    step and eval(), that run saw self.training True (the training branch, which needs targets)."""
    qat = prepare_qat_fx(Branches(), {"": get_default_qat_qconfig()}, (torch.randn(2, 3, 8, 8),))
    qat.train()
    qat(torch.randn(2, 3, 8, 8))
    qat.eval()
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    (bound,) = wrapped_selves(qat)
    assert bound.training is False  # before any call
    bound.modes.clear()
    converted = convert_fx(qat)
    assert bound.modes and not any(bound.modes)
    (bound_converted,) = wrapped_selves(converted)
    converted.train()
    assert bound_converted.training is True
