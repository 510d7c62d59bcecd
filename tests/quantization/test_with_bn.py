"""with_bn QAT mode: batch norms kept and updated during QAT, folded at convert; validation == converted."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qir.examples import DeployableDigitsNet
from qir.march import march_scope
from qir.nn.qat import QATConvBNBase
from qir.nn.qat.conv import QATConvBase
from qir.qat_mode import QATMode, get_qat_mode, qat_mode_scope, set_qat_mode
from qir.quantization import (
    convert_fx,
    default_calib_8bit_weight_32bit_out_fake_quant_qconfig,
    float_fake_quant,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)

QAT_DICT = {"": get_default_qat_qconfig(), "module_name": {"classifier": get_default_qat_out_qconfig()}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = DeployableDigitsNet()
    g = torch.Generator().manual_seed(5)
    for m in model.modules():  # batch norms with real statistics, so folding is not the identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_(0.0, 0.2, generator=g)
            m.running_var.uniform_(0.5, 2.0, generator=g)
            m.weight.data.uniform_(0.5, 1.5, generator=g)
            m.bias.data.normal_(0.0, 0.1, generator=g)
    return model.eval()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return torch.rand(64, 1, 8, 8, generator=g) - 0.5, torch.randint(0, 10, (64,), generator=g)


def test_mode_names() -> None:
    assert get_qat_mode() is QATMode.FuseBN
    with qat_mode_scope("with_bn"):
        assert get_qat_mode() is QATMode.WithBN
    assert get_qat_mode() is QATMode.FuseBN
    set_qat_mode(QATMode.FuseBN)
    with pytest.raises(ValueError, match="valid: 'fuse_bn', 'with_bn'"):
        set_qat_mode("keep_bn")


def test_prepare_keeps_the_batch_norms_and_starts_where_fuse_bn_starts() -> None:
    model = _model()
    x, _ = _data()
    with march_scope("bayes"):
        fused = prepare_qat_fx(model, QAT_DICT)
        with qat_mode_scope("with_bn"):
            kept = prepare_qat_fx(model, QAT_DICT)
    bns = {n: m for n, m in kept.named_modules() if isinstance(m, QATConvBNBase)}
    assert set(bns) == {"conv0", "add", "conv2"}
    assert type(bns["conv0"]).__name__ == "ConvBNReLU2d" and type(bns["add"]).__name__ == "ConvBNAddReLU2d"
    # the unfolded weight is the float conv's again; the batch norm is a copy of the float one
    assert torch.allclose(bns["conv0"].weight, model.conv0.weight, rtol=1e-6, atol=1e-7)
    assert torch.equal(bns["conv0"].bn.running_var, model.bn0.running_var)
    assert bns["conv0"].bn.running_var is not model.bn0.running_var
    # in eval the with-BN model computes the fuse_bn model's function
    set_fake_quantize(fused, "calibration")
    set_fake_quantize(kept, "calibration")
    fused.eval()
    kept.eval()
    with torch.no_grad():
        assert torch.allclose(fused(x), kept(x), atol=1e-5)


def test_running_stats_update_during_qat_and_convert_folds_them() -> None:
    model = _model()
    x, y = _data()
    with march_scope("bayes"):
        calib = prepare_qat_fx(
            model,
            {
                "": get_default_calib_qconfig(),
                "module_name": {"classifier": default_calib_8bit_weight_32bit_out_fake_quant_qconfig},
            },
        )
        set_fake_quantize(calib, "calibration")
        with torch.no_grad():
            calib(x)
        with qat_mode_scope("with_bn"):
            qat = prepare_qat_fx(calib, QAT_DICT)  # carries the calibrated scales, then keeps the batch norms
    conv0 = qat.get_submodule("conv0")
    assert isinstance(conv0, QATConvBNBase)
    assert torch.equal(conv0.activation_post_process.scale, calib.get_submodule("conv0").activation_post_process.scale)
    before = conv0.bn.running_mean.clone(), conv0.bn.running_var.clone(), int(conv0.bn.num_batches_tracked)
    weight_before = conv0.weight.detach().clone()
    qat.train()
    opt = torch.optim.SGD(qat.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(qat(x), y).backward()
        assert conv0.bn.weight.grad is not None and conv0.weight.grad is not None
        opt.step()
    assert int(conv0.bn.num_batches_tracked) == before[2] + 3
    assert not torch.equal(conv0.bn.running_mean, before[0]) and not torch.equal(conv0.bn.running_var, before[1])
    assert not torch.equal(conv0.weight.detach(), weight_before)
    assert "conv0.bn.running_mean" in qat.state_dict()
    qat.eval()
    set_fake_quantize(qat, "validation")
    with march_scope("bayes"):
        converted = convert_fx(qat)
    assert isinstance(qat.get_submodule("conv0"), QATConvBNBase)  # convert works on a copy
    with torch.no_grad():
        out = converted(x)
        assert torch.equal(qat(x), out)  # validation is the deployed model
    # convert folded the trained batch norm: the same integer model as folding it by hand first
    by_hand = copy.deepcopy(qat)
    for name in ("conv0", "add", "conv2"):
        folded = by_hand.get_submodule(name).fold()
        assert isinstance(folded, QATConvBase) and not isinstance(folded, QATConvBNBase)
        assert not hasattr(folded, "bn")
    with march_scope("bayes"), torch.no_grad():
        assert torch.equal(convert_fx(by_hand)(x), out)
    # the float eval forward of the with-BN model is the folded conv's (the same float operations)
    with torch.no_grad(), float_fake_quant():
        assert torch.equal(qat(x), by_hand(x))


def test_eager_prepare_refuses_with_bn() -> None:
    from qir.quantization import prepare_qat

    model = _model()
    model.qconfig = get_default_qat_qconfig()
    with march_scope("bayes"), qat_mode_scope("with_bn"), pytest.raises(NotImplementedError, match="prepare_qat_fx"):
        prepare_qat(model)
