"""A checkpoint in horizon_plugin_pytorch's layout around wrapped calls: the plugin's prepared model has
no input stub for a module its wrapped code calls (the QTensor carries the input's scale), so its
state dict holds the module's own keys and nothing under ``_generated_wrapped_quant_<path>``. A strict
load is refused before anything loads, naming the keys and the fix; ``strict=False`` and
``calibrate_wrapped_inputs`` then take the model through QAT, validation, convert and compile."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import torch

from qir.march import march_scope
from qir.quantization import (
    FakeQuantState,
    calibrate_wrapped_inputs,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
    split_wrapped_tail,
)
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.wrapped_self import wrapped_selves
from tests.real_users.test_wrap_modules import RetinaNet

STUBS = ["_generated_wrapped_quant_iou_tower", "_generated_wrapped_quant_iou"]


@pytest.fixture(params=["bayes", "bernoulli2"])
def march(request: pytest.FixtureRequest) -> Iterator[str]:
    torch.manual_seed(0)
    with march_scope(request.param):
        yield request.param


def _images(n: int = 4) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32)


def _plugin_checkpoint() -> dict[str, torch.Tensor]:
    """A trained QAT model's state dict with the keys the plugin's prepared model has: every module at
    its own path (``iou.weight``, ``iou.activation_post_process.scale``), no generated wrapped stubs."""
    trained = prepare_qat_fx(RetinaNet(), {"": get_default_qat_qconfig()}, (_images(2),))
    optimizer = torch.optim.SGD(trained.parameters(), lr=1e-3)
    for _ in range(2):
        box, score, _ = trained(_images())
        (box.mean() - score.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    buf = io.BytesIO()
    torch.save({k: v for k, v in trained.state_dict().items() if not k.startswith("_generated_wrapped_")}, buf)
    buf.seek(0)
    return torch.load(buf)  # type: ignore[no-any-return]


def _states(model: torch.nn.Module) -> list[tuple[object, bool, bool]]:
    return [(m.state, m.observer_enabled, m.fake_quant_enabled) for m in model.modules() if isinstance(m, FakeQuantize)]


def test_the_plugin_checkpoint_through_qat_validation_and_convert(march: str) -> None:
    checkpoint = _plugin_checkpoint()
    assert "iou.activation_post_process.scale" in checkpoint and "iou.weight" in checkpoint
    qat = prepare_qat_fx(RetinaNet(), {"": get_default_qat_qconfig()}, (_images(2),))
    before = qat.iou.weight.detach().clone()
    with pytest.raises(RuntimeError) as err:
        qat.load_state_dict(checkpoint)
    message = str(err.value)
    assert "'_generated_wrapped_quant_iou_tower' (the input of 'iou_tower')" in message
    assert "_generated_wrapped_quant_iou.activation_post_process.scale" in message
    assert "strict=False" in message and "qir.quantization.calibrate_wrapped_inputs(model, batches)" in message
    assert torch.equal(qat.iou.weight, before)  # refused before anything loaded

    result = qat.load_state_dict(checkpoint, strict=False)
    assert not result.unexpected_keys
    assert sorted({k.partition(".")[0] for k in result.missing_keys}) == sorted(STUBS)
    assert torch.equal(qat.iou.weight, checkpoint["iou.weight"])
    states = _states(qat)
    assert calibrate_wrapped_inputs(qat, [_images() for _ in range(3)]) == STUBS
    assert _states(qat) == states and qat.training  # put back as it was
    assert wrapped_selves(qat)[0].training  # the wrapped method's module too
    for stub in STUBS:
        assert float(qat.get_submodule(stub).activation_post_process.scale) > 0

    optimizer = torch.optim.SGD(qat.parameters(), lr=1e-3)
    box, score, _ = qat(_images())
    (box.mean() - score.sum()).backward()
    optimizer.step()
    qat.eval()
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    converted = convert_fx(qat)
    x = _images(8)
    want = converted(x)
    assert all(torch.equal(a, b) for a, b in zip(qat(x), want, strict=True))
    # deployed: the part before the wrapped post-process compiled, the post-process on its outputs
    split = split_wrapped_tail(converted)
    program = compile_model(split.head, [_images(1)])
    assert all(torch.equal(a, b) for a, b in zip(split.run(program, x), want, strict=True))


def test_only_frozen_fake_quants_stay_put_while_the_stubs_observe(march: str) -> None:
    qat = prepare_qat_fx(RetinaNet(), {"": get_default_qat_qconfig()}, (_images(2),))
    qat.load_state_dict(_plugin_checkpoint(), strict=False)
    others = {k: v.clone() for k, v in qat.state_dict().items() if not k.startswith("_generated_wrapped_")}
    calibrate_wrapped_inputs(qat, [(_images(),)])  # a tuple: the forward's arguments
    assert all(torch.equal(qat.state_dict()[k], v) for k, v in others.items())


def test_checkpoints_the_check_leaves_to_torch(march: str) -> None:
    # qir's own checkpoint (with the stubs) loads strictly; a calibration one too
    calib = prepare_qat_fx(RetinaNet(), {"": get_default_calib_qconfig()}, (_images(2),))
    calib(_images())
    qat = prepare_qat_fx(RetinaNet(), {"": get_default_qat_qconfig()}, (_images(2),))
    qat.load_state_dict(calib.state_dict())
    # a float checkpoint holds no fake quant state: torch's own missing-keys error, not the stubs'
    with pytest.raises(RuntimeError) as err:
        qat.load_state_dict(RetinaNet().state_dict())
    assert "Missing key(s)" in str(err.value) and "calibrate_wrapped_inputs" not in str(err.value)


def test_calibrate_wrapped_inputs_refusals(march: str) -> None:
    from tests.quantization.test_wrapped_flow import Plain

    plain = prepare_qat_fx(Plain(), {"": get_default_qat_qconfig()}, (torch.randn(2, 3, 16, 16),))
    with pytest.raises(ValueError, match="no generated input QuantStubs of modules called inside wrapped methods"):
        calibrate_wrapped_inputs(plain, [torch.randn(2, 3, 16, 16)])
    qat = prepare_qat_fx(RetinaNet(), {"": get_default_qat_qconfig()}, (_images(2),))
    with pytest.raises(ValueError, match=r"backbone.0.weight_fake_quant.* have no scale yet: load the checkpoint"):
        calibrate_wrapped_inputs(qat, [_images()])  # nothing loaded: the weights' per-channel scales are unset
    qat.load_state_dict(_plugin_checkpoint(), strict=False)
    with pytest.raises(ValueError, match="gave no batch"):
        calibrate_wrapped_inputs(qat, [])
