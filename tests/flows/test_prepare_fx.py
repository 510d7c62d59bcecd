"""prepare_qat_fx: march check, qconfig resolution, functionals, no mutation, calibration carry-over."""

from __future__ import annotations

import copy

import pytest
import torch
from flow_models import ModelForFusion, ResNetish, randomize_bn
from torch import nn

from qir.nn import qat
from qir.quantization import (
    FakeQuantize,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
)
from qir.quantization.fake_quantize import CalibFakeQuantize

QAT = get_default_qat_qconfig()
QAT16 = get_default_qat_qconfig(dtype="qint16")
CALIB = get_default_calib_qconfig()


def test_needs_a_march(monkeypatch: pytest.MonkeyPatch) -> None:
    import qir.quantization.prepare as prep

    monkeypatch.setattr(prep, "get_march", lambda default=None: default)  # as if none was ever set
    with pytest.raises(RuntimeError, match=r"qir\.march\.set_march"):
        prepare_qat_fx(ModelForFusion(), {"": QAT})


def test_swaps_modules_and_generates_functionals() -> None:
    model = ResNetish()
    prepared = prepare_qat_fx(model, {"": QAT})
    mods = dict(prepared.named_modules())
    assert isinstance(mods["quant"], qat.QuantStub)
    assert isinstance(mods["layer1.0._generated_add_0"], qat.ConvAddReLU2d)
    assert isinstance(mods["layer1.0.conv1"], qat.ConvReLU2d)
    assert isinstance(mods["stem"], qat.ConvReLU2d)  # torch.relu fused into the stem conv
    assert isinstance(mods["_generated_cat_0"], qat.FloatFunctional)
    assert isinstance(mods["_generated_mean_0"], qat.FloatFunctional)
    assert isinstance(mods["pool"], qat.MaxPool2d)
    assert isinstance(mods["fc"], qat.Linear)
    # the input is untouched
    assert type(model.stem) is nn.Conv2d and isinstance(model.stem_bn, nn.BatchNorm2d)


def test_prepared_model_trains() -> None:
    prepared = prepare_qat_fx(randomize_bn(ResNetish()), {"": QAT})
    opt = torch.optim.SGD(prepared.parameters(), lr=0.01)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 5, (4,))
    loss = nn.functional.cross_entropy(prepared(x), y)
    loss.backward()
    opt.step()
    assert all(p.grad is not None for p in prepared.parameters() if p.requires_grad)


def test_model_qconfig_attribute_is_used() -> None:
    model = ModelForFusion()
    model.qconfig = QAT  # type: ignore[assignment]
    prepared = prepare_qat_fx(model)
    assert isinstance(prepared.get_submodule("_generated_add_0"), qat.ConvAddReLU2d)


def test_no_qconfig_leaves_float() -> None:
    prepared = prepare_qat_fx(ModelForFusion())
    assert not any(isinstance(m, FakeQuantize) for m in prepared.modules())


def _act_dtype(m: nn.Module) -> str:
    fq = m.activation_post_process
    assert isinstance(fq, FakeQuantize)
    return fq.dtype.name


@pytest.mark.parametrize("form", ["dict", "list"])
def test_module_name_covers_children(form: str) -> None:
    names = {"layer1.1": QAT16}
    qd = {"": QAT, "module_name": names if form == "dict" else list(names.items())}
    prepared = prepare_qat_fx(ResNetish(), qd)
    assert _act_dtype(prepared.get_submodule("layer1.1._generated_add_0")) == "qint16"
    assert _act_dtype(prepared.get_submodule("layer1.1.conv1")) == "qint16"
    assert _act_dtype(prepared.get_submodule("layer1.0._generated_add_0")) == "qint8"


def test_module_name_of_an_absorbed_module_reaches_the_fused_module() -> None:
    prepared = prepare_qat_fx(ModelForFusion(), {"": QAT, "module_name": [("conv", QAT16)]})
    assert _act_dtype(prepared.get_submodule("_generated_add_0")) == "qint16"


def test_module_name_none_keeps_float() -> None:
    prepared = prepare_qat_fx(ResNetish(), {"": QAT, "module_name": {"fc": None}})
    assert type(prepared.get_submodule("fc")) is nn.Linear


def test_module_type() -> None:
    prepared = prepare_qat_fx(ResNetish(), {"": QAT, "module_type": [(nn.Linear, get_default_qat_out_qconfig())]})
    fc = prepared.get_submodule("fc")
    assert isinstance(fc, qat.Linear) and fc.activation_post_process is None


def test_submodule_qconfig_attribute_beats_global() -> None:
    model = ResNetish()
    model.fc.qconfig = get_default_qat_out_qconfig()  # type: ignore[assignment]
    prepared = prepare_qat_fx(model, {"": QAT})
    assert prepared.get_submodule("fc").activation_post_process is None


def test_mixing_calibration_and_qat_names_both() -> None:
    with pytest.raises(ValueError, match=r"cannot be mixed.*'fc'"):
        prepare_qat_fx(ResNetish(), {"": QAT, "module_name": {"fc": CALIB}})


def test_bad_qconfig_dict() -> None:
    with pytest.raises(KeyError, match="valid keys"):
        prepare_qat_fx(ResNetish(), {"object_type": []})
    with pytest.raises(TypeError, match="QConfig"):
        prepare_qat_fx(ResNetish(), {"": "qat"})


def test_hybrid_dict_validation() -> None:
    # hybrid preparation itself: tests/flows/test_hybrid.py
    with pytest.raises(ValueError, match=r"pass prepare_qat_fx\(\.\.\., hybrid=True"):
        prepare_qat_fx(ResNetish(), {"": QAT}, hybrid_dict={"module_name": ["fc"]})
    with pytest.raises(KeyError, match="hybrid_dict"):
        prepare_qat_fx(ResNetish(), {"": QAT}, hybrid_dict={"names": ["fc"]})
    with pytest.raises(TypeError, match="module classes"):
        prepare_qat_fx(ResNetish(), {"": QAT}, hybrid_dict={"module_type": ["fc"]})


def test_does_not_mutate_input() -> None:
    model = randomize_bn(ResNetish())
    before = copy.deepcopy(model.state_dict())
    tree = repr(model)
    prepare_qat_fx(model, {"": QAT})
    assert repr(model) == tree
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_calibration_then_qat_carries_scales() -> None:
    model = randomize_bn(ResNetish()).eval()
    calib = prepare_qat_fx(model, {"": CALIB})
    assert any(isinstance(m, CalibFakeQuantize) for m in calib.modules())
    calib.eval()
    x = torch.randn(8, 1, 8, 8)
    torch.testing.assert_close(calib(x), model(x), rtol=1e-4, atol=1e-5)  # calibration computes in float
    for _ in range(3):
        calib(torch.randn(8, 1, 8, 8))
    qat_model = prepare_qat_fx(calib, {"": QAT, "module_name": [("fc", get_default_qat_out_qconfig())]})
    assert not any(isinstance(m, CalibFakeQuantize) for m in qat_model.modules())
    for name in ("layer1.0._generated_add_0", "_generated_cat_0", "quant"):
        old = calib.get_submodule(name).activation_post_process.scale
        new = qat_model.get_submodule(name).activation_post_process.scale
        torch.testing.assert_close(new, old)
    assert qat_model.get_submodule("fc").activation_post_process is None
    # the calibrated model itself is unchanged and still usable
    assert any(isinstance(m, CalibFakeQuantize) for m in calib.modules())


def test_float_checkpoint_loads_into_qat_model() -> None:
    trained = randomize_bn(ResNetish(), seed=5).eval()
    prepared = prepare_qat_fx(ResNetish(), {"": QAT})
    result = prepared.load_state_dict(trained.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert all(".activation_post_process." in k or "fake_quant" in k for k in result.missing_keys)
    reference = prepare_qat_fx(trained, {"": QAT})
    for k, v in reference.state_dict().items():
        if "weight" in k and "fake_quant" not in k:
            torch.testing.assert_close(prepared.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_prepare_an_already_fused_model() -> None:
    from qir.quantization import fuse_fx

    model = randomize_bn(ResNetish())
    model.fc.qconfig = get_default_qat_out_qconfig()  # type: ignore[assignment]
    direct = prepare_qat_fx(model, {"": QAT})
    via_fused = prepare_qat_fx(fuse_fx(model), {"": QAT})

    def tree(m: nn.Module) -> list[tuple[str, type]]:
        return [(n, type(x)) for n, x in m.named_modules()][1:]  # the roots are distinct GraphModule classes

    assert tree(direct) == tree(via_fused)
    assert via_fused.get_submodule("fc").activation_post_process is None  # the attribute survived fusion
    result = via_fused.load_state_dict(model.state_dict(), strict=False)  # float keys still load
    assert not result.unexpected_keys


def test_prepare_and_convert_restore_the_garbage_collector() -> None:
    """Both pause Python's cyclic GC while they build (linear cost) and restore it, on error too."""
    import gc

    from qir.march import March, march_scope
    from qir.quantization import convert_fx, get_default_qat_qconfig, prepare_qat_fx

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = torch.quantization.QuantStub()
            self.conv = nn.Conv2d(1, 2, 3)
            self.dequant = torch.quantization.DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.conv(self.quant(x)))

    assert gc.isenabled()
    with march_scope(March.BAYES):
        qat = prepare_qat_fx(Net(), {"": get_default_qat_qconfig()})
        assert gc.isenabled()
        qat(torch.randn(2, 1, 6, 6))
        convert_fx(qat)
        assert gc.isenabled()
        with pytest.raises(TypeError):
            prepare_qat_fx(Net(), {"": get_default_qat_qconfig()}, hybrid=True, hybrid_dict=["conv"])  # type: ignore[arg-type]
        assert gc.isenabled()
        gc.disable()
        try:
            prepare_qat_fx(Net(), {"": get_default_qat_qconfig()})
            assert not gc.isenabled()  # a caller's choice is kept
        finally:
            gc.enable()
