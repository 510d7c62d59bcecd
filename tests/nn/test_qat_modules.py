"""QAT modules: from_float copies without sharing, equals the float module with fake quant off, trains."""

from __future__ import annotations

import copy

import pytest
import torch
from nn_cases import ALL_CASES, CONV_CASES, Case
from nn_helpers import QC8, codes, storages
from torch import nn

import qir.nn as qnn
from qir.nn import QAT_MODULE_MAP, qat
from qir.nn.intrinsic import FUSED_CLASSES
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    disable_fake_quant,
    get_default_qat_out_qconfig,
)


def _inputs(case: Case, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [codes(s, sc, gen)[1] for s, sc in zip(case.shapes, case.scales, strict=True)]


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_from_float_copies_and_leaves_float_untouched(case: Case) -> None:
    torch.manual_seed(0)
    fl = case.make()
    before = copy.deepcopy(fl.state_dict())
    m = QAT_MODULE_MAP[type(fl)].from_float(fl, QC8)  # type: ignore[attr-defined]
    assert not (storages(fl) & storages(m)), "QAT module shares a tensor with the float module"
    m(*_inputs(case))
    after = fl.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    if case.has_weight:
        assert torch.equal(m.weight, fl.conv.weight if hasattr(fl, "conv") else fl.weight)


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_equals_float_with_fake_quant_disabled(case: Case) -> None:
    torch.manual_seed(1)
    fl = case.make().eval()
    m = QAT_MODULE_MAP[type(fl)].from_float(fl, QC8).eval()  # type: ignore[attr-defined]
    disable_fake_quant(m)
    xs = _inputs(case, 1)
    assert torch.equal(m(*xs), fl(*xs))


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_gradients_flow(case: Case) -> None:
    torch.manual_seed(2)
    fl = case.make()
    m = QAT_MODULE_MAP[type(fl)].from_float(fl, QC8)  # type: ignore[attr-defined]
    xs = [x.clone().requires_grad_(True) for x in _inputs(case, 2)]
    m(*xs).sum().backward()
    assert xs[0].grad is not None
    if case.has_weight:
        assert m.weight.grad is not None and bool(m.weight.grad.abs().sum() > 0)


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: c.name)
def test_conv_fake_quants(case: Case) -> None:
    fl = case.make()
    m = QAT_MODULE_MAP[type(fl)].from_float(fl, QC8)  # type: ignore[attr-defined]
    m(*_inputs(case))
    axis = 1 if "ConvTranspose" in case.name else 0
    assert m.weight_fake_quant.ch_axis == axis
    assert m.weight_fake_quant.scale.numel() == m.weight.shape[axis]
    assert m.activation_post_process is not None
    hp = QAT_MODULE_MAP[type(fl)].from_float(fl, get_default_qat_out_qconfig())  # type: ignore[attr-defined]
    assert hp.activation_post_process is None


def test_fixed_scale_quant_stub() -> None:
    fixed = qat.QuantStub.from_float(QuantStub(scale=1 / 128), QC8)
    assert fixed.has_fixed_scale and float(fixed.activation_post_process.scale) == 1 / 128
    fixed(torch.randn(4) * 10)
    assert float(fixed.activation_post_process.scale) == 1 / 128  # never observed
    observed = qat.QuantStub.from_float(QuantStub(), QC8)
    observed(torch.tensor([-2.55, 1.0]))
    assert float(observed.activation_post_process.scale) == pytest.approx(2.55 / 127.5)
    assert isinstance(qat.DeQuantStub.from_float(DeQuantStub()), qat.DeQuantStub)


def test_torch_stubs_and_functional_are_mapped() -> None:
    from torch.ao.nn.quantized import FloatFunctional as TorchFF
    from torch.ao.quantization import DeQuantStub as TorchDeQuant
    from torch.ao.quantization import QuantStub as TorchQuant

    assert QAT_MODULE_MAP[TorchQuant] is qat.QuantStub
    assert QAT_MODULE_MAP[TorchDeQuant] is qat.DeQuantStub
    assert QAT_MODULE_MAP[TorchFF] is qat.FloatFunctional
    stub = qat.QuantStub.from_float(TorchQuant(), QC8)
    assert stub.activation_post_process is not None


def test_map_covers_every_fused_class_and_unary_module() -> None:
    for fused in FUSED_CLASSES.values():
        assert fused in QAT_MODULE_MAP
    for cls in qnn.UNARY_MODULES.values():
        assert QAT_MODULE_MAP[cls] is qat.UnaryLUT
    for cls in (
        nn.Conv1d,
        nn.Conv2d,
        nn.Conv3d,
        nn.ConvTranspose2d,
        nn.Linear,
        nn.ReLU,
        nn.ReLU6,
        nn.MaxPool2d,
        nn.AvgPool2d,
        nn.AdaptiveAvgPool2d,
        nn.Identity,
        nn.Dropout,
        qnn.Interpolate,
        qnn.Div,
        qnn.quantized.FloatFunctional,
        QuantStub,
        DeQuantStub,
    ):
        assert cls in QAT_MODULE_MAP


def test_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="needs a qconfig"):
        qat.Conv2d.from_float(nn.Conv2d(1, 1, 1))
    with pytest.raises(TypeError, match="takes a Conv2d"):
        qat.Conv2d.from_float(nn.Conv1d(1, 1, 1), QC8)
    with pytest.raises(ValueError, match="output fake quant"):
        qat.AvgPool2d.from_float(nn.AvgPool2d(2), get_default_qat_out_qconfig())
    m = qat.ConvAdd2d.from_float(qnn.intrinsic.ConvAdd2d(nn.Conv2d(1, 1, 1)), QC8)
    with pytest.raises(TypeError, match="addend"):
        m(torch.zeros(1, 1, 2, 2))


def test_float_module_qconfig_attribute_is_used() -> None:
    conv = nn.Conv2d(2, 2, 1)
    conv.qconfig = QC8  # type: ignore[assignment]
    assert qat.Conv2d.from_float(conv).qconfig is QC8


def test_pow_exponent_is_a_constant() -> None:
    p = qnn.Pow(2.0)
    assert torch.equal(p(torch.tensor([3.0])), torch.tensor([9.0]))
    with pytest.raises(ValueError, match="exponent"):
        p(torch.tensor([3.0]), 3.0)


def test_dropout_keeps_its_kind() -> None:
    m = qat.Dropout.from_float(nn.Dropout2d(0.5))
    torch.manual_seed(0)
    y = m(torch.ones(4, 16, 3, 3))
    per_channel = y.reshape(4, 16, 9)
    assert bool(((per_channel == 0).all(-1) | (per_channel != 0).all(-1)).all())  # whole channels dropped
    assert torch.equal(m.eval()(torch.ones(2, 3)), torch.ones(2, 3))


def test_fused_module_takes_its_conv_childs_qconfig() -> None:
    conv = nn.Conv2d(2, 2, 1)
    conv.qconfig = QC8  # type: ignore[assignment]
    fused = qnn.intrinsic.ConvReLU2d(conv)
    assert qat.ConvReLU2d.from_float(fused).qconfig is QC8


def test_scale_preserving_flags() -> None:
    assert qat.Interpolate.from_float(qnn.Interpolate(scale_factor=2, mode="nearest")).is_scale_preserving
    assert not qat.Interpolate.from_float(qnn.Interpolate(scale_factor=2, mode="bilinear"), QC8).is_scale_preserving
    assert qat.ReLU.from_float(nn.ReLU()).is_scale_preserving
    assert not qat.AvgPool2d.from_float(nn.AvgPool2d(2), QC8).is_scale_preserving
