"""QAT training on the integer grid: each training step's forward equals convert_fx of the model's
state after that step's observer updates, gradients flow straight through, training converges."""

from __future__ import annotations

import copy
import itertools
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from backends.common import numerics
from qir.examples.digits_deploy import DeployableDigitsNet
from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    convert_fx,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    integer_grid_report,
    prepare_qat,
    prepare_qat_fx,
    set_integer_grid,
)
from qir.quantization.convert import ConvertError
from qir.quantization.fake_quantize import float_fake_quant
from qir.quantization.integer_grid import grid_requantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from bitexact_models import Stubbed, chain, digits_net, randomize_bn

_LAYER = st.tuples(
    st.sampled_from(["conv", "convbn", "convbnrelu", "convrelu", "residual", "maxpool", "avgpool"]),
    st.integers(2, 12),
    st.sampled_from([1, 3]),
    st.sampled_from([1, 2]),
)


def _prepared(model: nn.Module, march: str) -> nn.Module:
    with march_scope(march):
        return prepare_qat_fx(model, {"": get_default_qat_qconfig()}).train()


def _deployable_digits() -> nn.Module:
    """The demo's 8x8 digits net (conv + add + ReLU, avg pool), its classifier with a qint32 output."""
    model = randomize_bn(DeployableDigitsNet(width=8))
    qconfig = {"": get_default_qat_qconfig(), "module_name": {"classifier": get_default_qat_out_qconfig()}}
    with march_scope("bayes"):
        return prepare_qat_fx(model, qconfig).train()


def _steps_equal_converted(qat: nn.Module, march: str, shape: tuple[int, ...], steps: int, seed: int) -> int:
    """Train ``steps`` SGD steps; every step's forward must equal convert_fx of the state it left.
    Returns how many steps were compared (a ratio Bernoulli2 cannot express skips a step)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(qat.parameters(), lr=0.05, momentum=0.9)
    compared = 0
    for _ in range(steps):
        x = torch.randn(*shape, generator=g)
        y = qat(x)
        try:
            with march_scope(march):
                converted = convert_fx(qat)
        except ConvertError:
            converted = None
        if converted is not None:
            assert torch.equal(y, converted(x)), f"max |diff| {(y - converted(x)).abs().max().item()}"
            compared += 1
        opt.zero_grad()
        y.square().mean().backward()
        opt.step()
    return compared


@settings(max_examples=5, deadline=None)
@given(
    spec=st.lists(_LAYER, min_size=1, max_size=5),
    head=st.sampled_from(["linear", "conv"]),
    march=st.sampled_from(["bayes", "bernoulli2"]),
    seed=st.integers(0, 1000),
)
def test_each_training_step_is_the_converted_model(spec: list, head: str, march: str, seed: int) -> None:
    if head == "linear" and march == "bernoulli2":
        head = "conv"  # no Linear on Bernoulli2
    torch.manual_seed(seed)
    qat = _prepared(randomize_bn(chain(spec, 3, head), seed), march)
    assert set(integer_grid_report(qat).values()) == {"grid"}
    _steps_equal_converted(qat, march, (3, 3, 12, 12), steps=3, seed=seed)


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_conv_bn_residual_net_steps_are_exact(march: str) -> None:
    torch.manual_seed(1)
    spec = [("convbnrelu", 8, 3, 1), ("residual", 8, 3, 1), ("avgpool", 8, 3, 2), ("convbn", 6, 3, 1)]
    qat = _prepared(randomize_bn(chain(spec, 3, "conv"), 1), march)
    assert _steps_equal_converted(qat, march, (4, 3, 12, 12), steps=4, seed=1) >= 3


def test_high_precision_output_and_fused_add_in_the_digits_net() -> None:
    torch.manual_seed(0)
    qat = _deployable_digits()
    report = integer_grid_report(qat)
    assert report and set(report.values()) == {"grid"}, report
    assert _steps_equal_converted(qat, "bayes", (8, 1, 8, 8), steps=3, seed=0) == 3
    qat = _prepared(digits_net(), "bayes")  # the 28x28 net: conv + add fused, adaptive pool
    assert _steps_equal_converted(qat, "bayes", (4, 1, 28, 28), steps=2, seed=0) == 2


def test_wide_reductions_are_summed_exactly_in_chunks() -> None:
    """A 3x3 conv over 600 channels with saturated weights: partial sums exceed 2**24, so the
    accumulator is summed over input-channel chunks (and float64 for the grouped conv)."""
    torch.manual_seed(0)

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Conv2d(600, 8, 3, padding=1)
            self.b = nn.Conv2d(8, 8, 3, padding=1, groups=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    model = Wide()
    with torch.no_grad():
        model.a.weight.copy_(torch.sign(torch.randn_like(model.a.weight)))  # every code at +-127
        model.b.weight.mul_(1000.0)
    qat = _prepared(Stubbed(model), "bayes")
    x = torch.rand(2, 600, 5, 5) * 4
    y = qat(x)
    with march_scope("bayes"):
        assert torch.equal(y, convert_fx(qat)(x))


@settings(max_examples=60, deadline=None)
@given(
    march=st.sampled_from(["bayes", "bernoulli2"]),
    ratio=st.floats(1e-6, 100.0),
    seed=st.integers(0, 2**31 - 1),
    relu=st.booleans(),
)
def test_float64_requantization_is_numerics_requantize(march: str, ratio: float, seed: int, relu: bool) -> None:
    lim = numerics.requant_limits(march)
    r = torch.tensor([ratio, ratio * 0.37, ratio * 1.9], dtype=torch.float64)
    r = r.clamp(max=lim.max_multiplier)
    mult, shift = numerics.multiplier_shift(r, lim.max_multiplier, lim.max_shift)
    g = torch.Generator().manual_seed(seed)
    acc = torch.randint(-(2**24) + 1, 2**24, (4, 3, 5), generator=g).to(torch.float32)
    acc[0, :, 0] = 2**24 - 1  # the accumulator extremes
    acc[1, :, 0] = -(2**24) + 1
    bias = torch.randint(-(2**20), 2**20, (3,), generator=g)
    lo, hi = (0 if relu else -128), 127
    got = grid_requantize(acc, bias, mult, shift, lo, hi, axis=1)
    want = numerics.requantize(acc.to(torch.int64) + bias[:, None], mult, shift, "qint32", axis=1).clamp(lo, hi)
    assert torch.equal(got, want.to(torch.float32))


def test_gradients_flow_straight_through_like_the_float_fake_quant() -> None:
    torch.manual_seed(0)
    qat = _deployable_digits()
    x = torch.rand(16, 1, 8, 8) - 0.5
    reference = copy.deepcopy(qat)
    loss = qat(x).square().mean()
    loss.backward()
    with float_fake_quant():  # the float fake-quant forward of the same state
        reference(x).square().mean().backward()
    for (name, p), (_, q) in zip(qat.named_parameters(), reference.named_parameters(), strict=True):
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
        cos = torch.nn.functional.cosine_similarity(p.grad.reshape(-1), q.grad.reshape(-1), dim=0)
        assert cos > 0.95, (name, float(cos))


def test_loss_decreases_on_digits_as_with_float_fake_quant() -> None:
    from qir.examples.digits_data import load_digits_arrays

    images, labels = load_digits_arrays()
    x = torch.tensor(images[:256], dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0 - 0.5
    y = torch.tensor(labels[:256], dtype=torch.int64)
    finals = []
    for grid in (True, False):
        torch.manual_seed(0)
        qat = set_integer_grid(_deployable_digits(), grid)
        assert (set(integer_grid_report(qat).values()) == {"grid"}) is grid
        opt = torch.optim.Adam(qat.parameters(), lr=0.02)
        losses = []
        for _ in range(15):
            loss = nn.functional.cross_entropy(qat(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < 0.97 * losses[0] and all(b < a for a, b in itertools.pairwise(losses)), losses
        finals.append(losses[-1])
    assert abs(finals[0] - finals[1]) < 0.02, finals  # the grid trains like the float simulation


def test_opt_out_and_report() -> None:
    torch.manual_seed(0)
    qat = _deployable_digits()
    x = torch.rand(4, 1, 8, 8) - 0.5
    copy_ = copy.deepcopy(qat)  # the deep copy's modules are bound to the copy's fake quants
    for (_, a), (_, b) in zip(qat.named_modules(), copy_.named_modules(), strict=True):
        ga, gb = a.__dict__.get("integer_grid"), b.__dict__.get("integer_grid")
        if ga is not None:
            assert gb is not None and all(fa is not fb for fa, fb in zip(ga.inputs, gb.inputs, strict=True))
            assert set(map(id, gb.inputs)) <= {id(m) for m in copy_.modules()}
    set_integer_grid(copy_, False)
    assert set(integer_grid_report(copy_).values()) == {"integer grid off"}
    with float_fake_quant():
        want = copy.deepcopy(qat)(x)
    assert torch.equal(copy_(x), want)  # the float fake-quant forward
    set_integer_grid(copy_, True)
    assert set(integer_grid_report(copy_).values()) == {"grid"}
    float_model = Stubbed(nn.Sequential(nn.Conv2d(1, 2, 3)))
    float_model.qconfig = get_default_qat_qconfig()
    with march_scope("bayes"):
        eager = prepare_qat(float_model)
    # eager models train on the grid too (tests/flows/test_eager_compile.py); a float model cannot
    assert set_integer_grid(eager, False) is eager
    assert set(integer_grid_report(eager).values()) == {"integer grid off"}
    with pytest.raises(TypeError, match="prepare_qat_fx or prepare_qat"):
        set_integer_grid(float_model)


@settings(max_examples=60, deadline=None)
@given(
    s_acc=st.floats(1e-6, 1e-2),
    s_add=st.floats(1e-3, 1.0),
    s_out=st.floats(1e-3, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_float64_fused_add_is_the_integer_rule(s_acc: float, s_add: float, s_out: float, seed: int) -> None:
    """The float64 fused conv + add (accumulator clamped where the output saturates anyway) equals
    ``integer_rules.fused_add_int`` over the whole accumulator range."""
    from backends.common.integer_rules import fused_add_int, fused_add_params
    from qir.ir.types import DType
    from qir.quantization.fake_quantize import FakeQuantize
    from qir.quantization.integer_grid import _fused_add_float64, _FusedAdd64

    scales = torch.tensor([s_acc, s_acc * 0.3, s_acc * 3.1], dtype=torch.float64)
    try:
        p = fused_add_params(scales, s_add, s_out, "bayes", "qint8")
    except ValueError:
        return  # a ratio the rule cannot express: convert refuses it too
    g = torch.Generator().manual_seed(seed)
    acc = torch.randint(-(2**24) + 1, 2**24, (64, 3, 4), generator=g).to(torch.float32)
    acc[:, :, 0] = torch.randint(-2000, 2000, (64, 3), generator=g).to(torch.float32)  # near the output range
    bias = torch.randint(-(2**20), 2**20, (3,), generator=g).to(torch.float64).reshape(1, 3, 1)
    codes = torch.randint(-128, 128, (64, 3, 4), generator=g)
    addend = codes.to(torch.float32) * torch.tensor(s_add, dtype=torch.float32)
    inv = 1.0 / torch.tensor(s_add, dtype=torch.float32)
    add_fq = FakeQuantize(dtype="qint8")
    fast = _fused_add_float64(acc, bias, addend, inv, p, DType.qint8, add_fq, scales, s_add, s_out, 1)
    if fast is None:
        return
    one = torch.ones((), dtype=torch.float32)
    got = _FusedAdd64.apply(acc, bias, addend, inv, *fast, p.extra_bits, -128, 127, one, one)
    want = fused_add_int(
        acc.to(torch.int64) + bias.to(torch.int64), codes, p.acc_multiplier, p.acc_shift,
        p.add_multiplier, p.add_shift, p.extra_bits, "qint8", 1,
    )  # fmt: skip
    assert torch.equal(got, want.to(torch.float32))


class _Ops(nn.Module):
    """Standalone add and mul, cat (on the integer grid: exact) and FloatFunctional.exp (float fake
    quantization: within 1 LSB)."""

    def __init__(self) -> None:
        super().__init__()
        from qir.nn.quantized import FloatFunctional
        from qir.quantization import QuantStub

        self.qx, self.qy = QuantStub(), QuantStub()
        self.add, self.mul, self.cat = FloatFunctional(), FloatFunctional(), FloatFunctional()
        self.exp = FloatFunctional()
        self.dq = nn.ModuleList(DeQuantStub() for _ in range(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, y = self.qx(x), self.qy(y)
        outs = (self.add.add(x, y), self.mul.mul(x, y), self.cat.cat([x, y], dim=1), self.exp.exp(x))
        return tuple(dq(o) for dq, o in zip(self.dq, outs, strict=True))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_ops_off_the_grid_are_within_one_lsb_of_the_converted_model(march: str) -> None:
    """On the same input codes, add / mul / cat train on the converted op's codes and exp, which
    stays float fake quantization, is at most 1 LSB of its output scale off."""
    torch.manual_seed(0)
    with march_scope(march):
        qat = prepare_qat_fx(_Ops(), {"": get_default_qat_qconfig()}).train()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(64, 4, 6, generator=g), torch.randn(64, 4, 6, generator=g) * 3
        got = qat(x, y)
        with march_scope(march):
            converted = convert_fx(qat)
        want = converted(x, y)
        for name, a, b in zip(("add", "mul", "cat", "exp"), got, want, strict=True):
            fq = qat.get_submodule(name).activation_post_process
            lsb = float(fq.scale)
            assert float((a - b).abs().max()) <= lsb * 1.0001, (name, float((a - b).abs().max()) / lsb)
            if name != "exp":
                assert torch.equal(a, b), name


@pytest.mark.parametrize(("act", "lo", "hi"), [(None, -128, 127), ("relu", 0, 127)])
def test_int64_and_float64_fused_add_pass_the_same_gradients(act: str | None, lo: int, hi: int) -> None:
    """Where both apply, the int64 fused conv + add and the float64 one give the same output and the
    same straight-through gradients, also at a code exactly at the dtype's limit (passed) and beyond
    it (cut)."""
    from backends.common.integer_rules import fused_add_params
    from qir.ir.types import DType
    from qir.quantization.fake_quantize import FakeQuantize
    from qir.quantization.integer_grid import _fused_add_float64, _FusedAdd, _FusedAdd64

    scales = torch.tensor([1e-3, 2.5e-3], dtype=torch.float32).to(torch.float64)
    s_add, s_out = 0.1, 0.05
    p = fused_add_params(scales, s_add, s_out, "bayes", "qint8")
    p = p._replace(acc_multiplier=p.acc_multiplier.expand(2), acc_shift=p.acc_shift.expand(2))
    g = torch.Generator().manual_seed(0)
    acc = torch.arange(-8000, 8000, 3, dtype=torch.float32).reshape(1, 1, -1).expand(4, 2, -1).contiguous()
    bias = torch.tensor([7.0, -11.0], dtype=torch.float64).reshape(1, 2, 1)
    codes = torch.randint(-4, 5, acc.shape, generator=g)
    addend = codes.to(torch.float32) * torch.tensor(s_add, dtype=torch.float32)
    inv = 1.0 / torch.tensor(s_add, dtype=torch.float32)
    one = torch.ones((), dtype=torch.float32)
    acc_scale = torch.tensor([0.5, 2.0]).reshape(1, 2, 1)
    fast = _fused_add_float64(
        acc, bias, addend, inv, p, DType.qint8, FakeQuantize(dtype="qint8"), scales, s_add, s_out, 1
    )
    assert fast is not None
    results = []
    for path in ("float64", "int64"):
        a, ad = acc.clone().requires_grad_(), addend.clone().requires_grad_()
        if path == "float64":
            out = _FusedAdd64.apply(a, bias, ad, inv, *fast, p.extra_bits, lo, hi, one, acc_scale)
        else:
            out = _FusedAdd.apply(a, bias, ad, inv, p, DType.qint8, lo, hi, one, acc_scale, 1)
        grad = torch.linspace(1, 2, out.numel()).reshape(out.shape)
        out.backward(grad)
        results.append((out.detach(), a.grad, ad.grad))
    (o64, ga64, gd64), (oi, gai, gdi) = results
    assert torch.equal(o64, oi)
    assert torch.equal(ga64, gai) and torch.equal(gd64, gdi)
    at_limit = oi == hi
    assert bool((gdi[at_limit] != 0).any()), "a code exactly at the limit passes the gradient"
    assert bool((gdi[at_limit] == 0).any()), "a saturated code cuts it"
    assert bool((gdi[oi == lo] == 0).any()) and bool((gdi[(oi > lo) & (oi < hi)] != 0).all())
