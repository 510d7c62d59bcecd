"""LSQ / PACT: a learned scale Parameter, its gradient, the flow calibration -> QAT -> convert."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from qir.examples import DeployableDigitsNet
from qir.march import march_scope
from qir.quantization import (
    FakeQuantize,
    LSQFakeQuantize,
    PACTFakeQuantize,
    QuantStub,
    convert_fx,
    default_calib_8bit_weight_32bit_out_fake_quant_qconfig,
    fake_quantize,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    get_default_qconfig,
    prepare_qat_fx,
    qconfig_kind,
    set_fake_quantize,
)


def test_forward_is_the_plain_fake_quant_and_the_gradients_are_lsqs() -> None:
    fq = LSQFakeQuantize()
    fq.start_from_scale(torch.tensor([0.1]))
    assert isinstance(fq.scale, nn.Parameter)
    x = torch.tensor([0.26, -0.04, 0.05, 20.0, -30.0, 0.149], requires_grad=True)
    y = fq(x)
    assert torch.equal(y.detach(), fake_quantize(x.detach(), torch.tensor([0.1])))
    w = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    (y * w).sum().backward()
    assert x.grad is not None and fq.scale.grad is not None
    assert x.grad.tolist() == [1.0, 2.0, 3.0, 0.0, 0.0, 6.0]  # straight through in range, 0 where it clips
    v = x.detach().double() / torch.tensor(0.1, dtype=torch.float32).double()
    q = torch.floor(v + 0.5).clamp(-128, 127)
    inside = torch.floor(v + 0.5) == q
    expected = (w.double() * torch.where(inside, q - v, q)).sum() / math.sqrt(6 * 127)
    assert float(fq.scale.grad) == pytest.approx(float(expected), rel=1e-5)


def test_pact_moves_the_scale_only_for_clipped_values() -> None:
    fq = PACTFakeQuantize()
    fq.start_from_scale(torch.tensor([0.1]))
    fq(torch.tensor([0.26, -30.0, 50.0])).sum().backward()
    assert fq.scale.grad is not None and float(fq.scale.grad) != 0.0
    fq.scale.grad = None
    fq(torch.tensor([0.26, -3.0, 5.0])).sum().backward()
    assert float(fq.scale.grad) == 0.0


def test_the_scale_learns() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g)
    fq = LSQFakeQuantize(averaging_constant=1.0)
    fq(x * 20)  # the first batch (an outlier-ridden one) starts the scale far too coarse for x
    start = float(fq.scale.detach())
    opt = torch.optim.Adam(fq.parameters(), lr=0.01)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = ((fq(x) - x) ** 2).mean()
        loss.backward()
        assert fq.scale.grad is not None and float(fq.scale.grad) != 0.0
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.2 * losses[0] and float(fq.scale.detach()) < 0.5 * start
    assert float(fq.observer.scale) == pytest.approx(start)  # the observer no longer moves the scale


def test_names_and_kinds() -> None:
    for qc in (get_default_qconfig(activation_fake_quant="lsq"), get_default_qat_qconfig(activation_fake_quant="lsq")):
        assert qconfig_kind(qc) == "qat" and type(qc.activation()) is LSQFakeQuantize
        assert type(qc.weight()) is FakeQuantize
    both = get_default_qat_qconfig(activation_fake_quant="pact", weight_fake_quant="lsq")
    assert type(both.activation()) is PACTFakeQuantize and type(both.weight()) is LSQFakeQuantize
    assert both.weight().ch_axis == 0
    with pytest.raises(ValueError, match="valid: fake_quant, lsq, pact"):
        get_default_qat_qconfig(weight_fake_quant="learned")
    # A fixed scale stays fixed: nothing to learn.
    stub = QuantStub(scale=1 / 128).make_fake_quant(get_default_qat_qconfig(activation_fake_quant="lsq"))
    assert not isinstance(stub.scale, nn.Parameter) and not list(stub.parameters())


def test_per_channel_weights_keep_their_parameter_object() -> None:
    fq = LSQFakeQuantize(observer=get_default_qat_qconfig().weight.keywords["observer"], ch_axis=0)
    param = fq.scale
    opt = torch.optim.SGD(fq.parameters(), lr=0.1)
    fq(torch.randn(5, 3, requires_grad=True)).sum().backward()
    assert fq.scale is param and fq.scale.shape == (5,) and fq.zero_point.shape == (5,)
    opt.step()
    assert fq.scale is param
    fq.scale.data.fill_(-1.0)  # a step that overshoots: the next forward clamps to eps
    fq(torch.randn(5, 3))
    assert bool((fq.scale > 0).all())


def _qat(model: nn.Module, calib: bool, fake_quant: str = "lsq") -> tuple[nn.Module, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = [torch.rand(32, 1, 8, 8, generator=g) - 0.5 for _ in range(3)]
    with march_scope("bayes"):
        start = model
        calib_sd: dict[str, torch.Tensor] = {}
        if calib:
            calib_out = default_calib_8bit_weight_32bit_out_fake_quant_qconfig
            start = prepare_qat_fx(model, {"": get_default_calib_qconfig(), "module_name": {"classifier": calib_out}})
            set_fake_quantize(start, "calibration")
            with torch.no_grad():
                for x in batches:
                    start(x)
            calib_sd = start.state_dict()
        lsq = get_default_qat_qconfig(activation_fake_quant=fake_quant, weight_fake_quant=fake_quant)
        out = get_default_qat_out_qconfig(weight_fake_quant=fake_quant)
        qat = prepare_qat_fx(start, {"": lsq, "module_name": {"classifier": out}})
    return qat, calib_sd


def test_calibration_to_lsq_qat_to_convert() -> None:
    torch.manual_seed(0)
    model = DeployableDigitsNet().eval()
    qat, calib_sd = _qat(model, calib=True)
    # The keys of the plain fake quant's QAT model; the calibration checkpoint loads strictly (its
    # histograms are another observer's statistics) and the learned scales start at the calibrated ones.
    assert (
        qat.state_dict().keys()
        == _qat(copy.deepcopy(model), calib=False, fake_quant="fake_quant")[0].state_dict().keys()
    )
    from_ckpt, _ = _qat(copy.deepcopy(model), calib=False)
    from_ckpt.load_state_dict(calib_sd, strict=True)
    for key, value in from_ckpt.state_dict().items():
        if ".observer." not in key:  # carry-over restarts an observer's range at +-amax; a load takes it as is
            assert torch.equal(value, qat.state_dict()[key]), key
    lsq = {n: m for n, m in qat.named_modules() if isinstance(m, LSQFakeQuantize) and isinstance(m.scale, nn.Parameter)}
    assert len(lsq) >= 8
    assert torch.equal(
        lsq["conv0.activation_post_process"].scale.detach(), calib_sd["conv0.activation_post_process.scale"]
    )
    start = {n: m.scale.detach().clone() for n, m in lsq.items()}
    g = torch.Generator().manual_seed(2)
    x, y = torch.rand(64, 1, 8, 8, generator=g) - 0.5, torch.randint(0, 10, (64,), generator=g)
    opt = torch.optim.Adam(qat.parameters(), lr=1e-3)
    qat.train()
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(qat(x), y).backward()
        assert all(m.scale.grad is not None and bool(m.scale.grad.abs().sum() > 0) for m in lsq.values())
        opt.step()
    moved = [n for n, m in lsq.items() if not torch.equal(m.scale.detach(), start[n])]
    assert len(moved) == len(lsq)
    qat.eval()
    set_fake_quantize(qat, "validation")
    with march_scope("bayes"):
        converted = convert_fx(qat)
    with torch.no_grad():
        assert torch.equal(qat(x), converted(x))  # validation is the deployed model, learned scales included
    assert torch.equal(converted.conv0.scale, lsq["conv0.activation_post_process"].scale.detach())
    # A QAT checkpoint loads strictly into a freshly prepared LSQ model and gives the same integer model.
    fresh, _ = _qat(copy.deepcopy(model), calib=False)
    fresh.load_state_dict(qat.state_dict(), strict=True)
    fresh.eval()
    set_fake_quantize(fresh, "validation")
    with torch.no_grad(), march_scope("bayes"):
        assert torch.equal(convert_fx(fresh)(x), converted(x))


def test_a_skipped_first_batch_does_not_start_the_scale() -> None:
    fq = LSQFakeQuantize()
    with pytest.warns(RuntimeWarning):
        fq(torch.tensor([float("nan"), 1.0]))
        set_fake_quantize(nn.Sequential(fq), "qat")
    assert not fq._initialized and float(fq.scale.detach()) == 1.0
    fq(torch.tensor([-2.0, 1.0]))
    assert fq._initialized and float(fq.scale.detach()) == pytest.approx(2.0 / 127.5)
