"""Modules called at several places, as Horizon users write them, through the whole flow.

One ``DeQuantStub`` for every output and one ``QuantStub`` for several inputs (40 files of
the toolkit and its users), one conv head on every FPN level, one ``nn.ReLU`` and one
``FloatFunctional`` used twice. Each call site gets its own output observer (the scale an
unshared copy of the module would get) while the weights stay one tensor with one weight
fake quant; calibration -> QAT -> convert -> check -> compile -> run works, and the
checkpoints load strictly.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from qir.march import March, march_scope
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.fake_quantize import FakeQuantize

CALIB = {"": get_default_calib_qconfig()}
QAT = {"": get_default_qat_qconfig()}


@pytest.fixture(autouse=True)
def bayes() -> object:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


class SharedHead(nn.Module):
    """RetinaNet-style: one QuantStub, one conv tower and one classifier for every FPN level,
    one DeQuantStub for every output."""

    def __init__(self, c: int = 8, anchors: int = 3) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.relu = nn.ReLU()
        self.skip = FloatFunctional()
        self.cls = nn.Conv2d(c, anchors, 1)
        self.dequant = DeQuantStub()

    def level(self, f: torch.Tensor) -> torch.Tensor:
        x = self.quant(f)
        return self.dequant(self.cls(self.skip.add(self.relu(self.conv(x)), x)))

    def forward(self, p3: torch.Tensor, p4: torch.Tensor, p5: torch.Tensor) -> list[torch.Tensor]:
        return [self.level(p3), self.level(p4), self.level(p5)]


class UnsharedHead(nn.Module):
    """The same computation with one module instance per level (the reference)."""

    def __init__(self, shared: SharedHead) -> None:
        super().__init__()
        self.levels = nn.ModuleList(copy.deepcopy(shared) for _ in range(3))

    def forward(self, p3: torch.Tensor, p4: torch.Tensor, p5: torch.Tensor) -> list[torch.Tensor]:
        return [lvl.level(f) for lvl, f in zip(self.levels, (p3, p4, p5), strict=True)]


def _levels(scale: float = 1.0) -> list[torch.Tensor]:
    # FPN levels with very different ranges: one shared observer would quantize p3 with p5's range
    return [torch.randn(2, 8, s, s) * r * scale for s, r in ((16, 0.5), (8, 4.0), (4, 30.0))]


def _calibrate(model: nn.Module, batches: int = 3) -> nn.Module:
    calib = prepare_qat_fx(model, CALIB)
    calib.eval()
    with torch.no_grad():
        for _ in range(batches):
            calib(*_levels())
    return calib


def _scales(model: nn.Module) -> dict[str, float]:
    return {
        n.removesuffix(".activation_post_process"): float(m.scale)
        for n, m in model.named_modules()
        if isinstance(m, FakeQuantize) and n.endswith("activation_post_process")
    }


def _roundtrip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded: dict[str, torch.Tensor] = torch.load(buf)
    return loaded


def test_every_call_site_gets_the_scale_an_unshared_module_would_get() -> None:
    shared = SharedHead()
    torch.manual_seed(1)
    calib = _calibrate(shared)
    torch.manual_seed(1)
    reference = _calibrate(UnsharedHead(shared))
    got, want = _scales(calib), _scales(reference)
    for name in ("quant", "conv", "skip", "cls"):
        for k, site in enumerate([name, f"{name}_call1", f"{name}_call2"]):
            assert got[site] == pytest.approx(want[f"levels.{k}.{name}"], rel=1e-6), site
    # the levels' ranges differ by 60x: one observer for all three would be wrong for p3
    assert got["quant_call2"] > 20 * got["quant"]
    # ... and the integer model computes what the unshared one computes, bit for bit
    converted = []
    for c in (calib, reference):
        qat = prepare_qat_fx(c, QAT).eval()
        set_fake_quantize(qat, "validation")
        converted.append(convert_fx(qat))
    xs = _levels()
    for a, b in zip(converted[0](*xs), converted[1](*xs), strict=True):
        assert torch.equal(a, b)


def test_weights_stay_shared_one_tensor_one_weight_fake_quant() -> None:
    qat = prepare_qat_fx(_calibrate(SharedHead()), QAT)
    assert len(list(qat.parameters())) == len(list(SharedHead().parameters()))  # 4: conv and cls
    for site in ("conv_call1", "conv_call2"):
        m = qat.get_submodule(site)
        assert m.weight is qat.conv.weight and m.bias is qat.conv.bias
        assert m.weight_fake_quant is qat.conv.weight_fake_quant
        assert m.activation_post_process is not qat.conv.activation_post_process
    opt = torch.optim.SGD(qat.parameters(), lr=0.1)
    before = qat.conv.weight.detach().clone()
    sum(o.square().mean() for o in qat(*_levels())).backward()
    opt.step()
    assert not torch.equal(qat.conv.weight, before)
    assert qat.conv_call2.weight is qat.conv.weight  # every level trains the one weight


def test_shared_modules_calibrate_train_convert_check_and_compile() -> None:
    qat = prepare_qat_fx(_calibrate(SharedHead()), QAT)
    opt = torch.optim.SGD(qat.parameters(), lr=0.01)
    qat.train()
    for _ in range(2):
        loss = sum(o.square().mean() for o in qat(*_levels()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.eval()
    set_fake_quantize(qat, "validation")
    xs = _levels()
    quantized = convert_fx(qat)
    with torch.no_grad():
        want = qat(*xs)
        got = quantized(*xs)
    for site, (a, b) in enumerate(zip(got, want, strict=True)):
        # conv, add, conv: each within 1 LSB of QAT (docs/semantics.md), a few output LSB in all
        lsb = float(qat.get_submodule("cls" if site == 0 else f"cls_call{site}").activation_post_process.scale)
        assert float((a - b).abs().max()) <= 4.01 * lsb, site
    report = check_model(quantized, tuple(xs))
    assert report.ok, report
    compiled = compile_model(quantized, xs)
    for a, b in zip(compiled(*xs), got, strict=True):
        assert torch.equal(a, b)


def test_state_dict_keys_are_stable_and_checkpoints_load_strictly() -> None:
    calib = _calibrate(SharedHead())
    qat = prepare_qat_fx(SharedHead(), QAT)  # a fresh float model, as the QAT stage of a toolkit config
    result = qat.load_state_dict(_roundtrip(calib.state_dict()), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    keys = set(qat.state_dict())
    # the first call keeps the module's keys; later calls add only their output observers
    assert {"conv.weight", "conv.bias", "conv.weight_fake_quant.scale", "conv.activation_post_process.scale"} <= keys
    assert "conv_call1.activation_post_process.scale" in keys and "dequant_call2" not in {k.split(".")[0] for k in keys}
    assert not any(k.startswith(("conv_call1.weight", "conv_call1.bias", "cls_call2.weight")) for k in keys)
    assert _scales(qat) == _scales(calib)  # every call site starts from its calibrated scale
    resumed = prepare_qat_fx(SharedHead(), QAT)
    resumed.load_state_dict(_roundtrip(qat.state_dict()), strict=True)
    for m in (qat, resumed):
        m.eval()
        set_fake_quantize(m, "validation")
    xs = _levels()
    for a, b in zip(resumed(*xs), qat(*xs), strict=True):
        assert torch.equal(a, b)
    assert resumed.conv_call1.weight is resumed.conv.weight  # loading keeps the tie
    assigned = prepare_qat_fx(SharedHead(), QAT)
    assigned.load_state_dict(_roundtrip(qat.state_dict()), strict=True, assign=True)  # new Parameter objects
    assert assigned.conv_call2.weight is assigned.conv.weight
    assert assigned.cls_call1.bias is assigned.cls.bias
    assert len(list(assigned.parameters())) == 4


def test_one_relu_applied_twice_at_different_scales_converts() -> None:
    class TwoRelu(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.conv_a = nn.Conv2d(3, 4, 1)
            self.conv_b = nn.Conv2d(4, 4, 1)
            self.relu = nn.ReLU()
            self.dequant = DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.relu(self.conv_a(self.quant(x)) * 0.5 + 0.1)
            b = self.relu(self.conv_b(a) * 20.0)
            return self.dequant(b)

    x = torch.randn(2, 3, 6, 6)
    qat = prepare_qat_fx(TwoRelu(), QAT)
    qat(x)
    qat.eval()
    set_fake_quantize(qat, "validation")
    quantized = convert_fx(qat)
    lsb = max(_scales(qat).values())
    assert float((quantized(x) - qat(x)).abs().max()) <= 2.01 * lsb
    compiled = compile_model(quantized, [x])
    assert torch.equal(compiled(x), quantized(x))


def test_a_module_called_once_is_not_split() -> None:
    class Once(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.conv = nn.Conv2d(3, 3, 1)
            self.dequant = DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.conv(self.quant(x)))

    qat = prepare_qat_fx(Once(), QAT)
    assert not any("_call" in n for n, _ in qat.named_modules())


def test_a_name_taken_by_the_user_is_a_clear_error() -> None:
    class Taken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.quant_call1 = nn.Identity()
            self.dequant = DeQuantStub()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.quant(x) + self.quant_call1(self.quant(y)))

    with pytest.raises(ValueError, match=r"module 'quant' is called at 2 places .* 'quant_call1'.* rename it"):
        prepare_qat_fx(Taken(), QAT)


@pytest.mark.parametrize("traceable", [True, False], ids=["traced", "recorded"])
def test_eager_mode_dequantizes_each_call_of_a_shared_stub_with_its_inputs_scale(traceable: bool) -> None:
    from qir.nn.quantized import PerCallDeQuantStub
    from qir.quantization import convert, prepare_qat

    class TwoOutputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.cls = nn.Conv2d(3, 3, 1)
            self.reg = nn.Conv2d(3, 4, 1)
            self.dequant = DeQuantStub()

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = self.quant(x)
            if not traceable and bool(torch.rand(1) < 0):  # data-dependent: fx cannot trace it
                raise AssertionError("unreachable")
            return self.dequant(self.cls(x)), self.dequant(self.reg(x))

    model = TwoOutputs()
    model.qconfig = get_default_qat_qconfig()
    qat = prepare_qat(model)
    qat(torch.randn(2, 3, 4, 4))
    qat.eval()
    set_fake_quantize(qat, "validation")
    quantized = convert(qat)  # codes carry their scales to the stub (test_users_shared_dequant_eager.py)
    assert isinstance(quantized.dequant, PerCallDeQuantStub)
    x = torch.randn(2, 3, 4, 4)
    for got, want, head in zip(quantized(x), qat(x), (quantized.cls, quantized.reg), strict=True):
        assert torch.equal(got, want)
        assert torch.equal(got, (got / head.scale).round() * head.scale)  # on its own head's grid


def test_an_lstm_cell_unrolled_over_time_steps() -> None:
    class Unrolled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.quant_h = QuantStub()
            self.quant_c = QuantStub()
            self.cell = nn.LSTMCell(4, 6)
            self.dequant = DeQuantStub()

        def forward(
            self, x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, h: torch.Tensor, c: torch.Tensor
        ) -> list[torch.Tensor]:
            h, c = self.quant_h(h), self.quant_c(c)
            outs = []
            for x in (x0, x1, x2):
                h, c = self.cell(self.quant(x), (h, c))
                outs.append(self.dequant(h))
            return outs

    xs = [torch.randn(2, 4) * s for s in (1.0, 3.0, 9.0)] + [torch.zeros(2, 6), torch.zeros(2, 6)]
    calib = prepare_qat_fx(Unrolled(), CALIB).eval()
    with torch.no_grad():
        calib(*xs)
    qat = prepare_qat_fx(calib, QAT)
    assert len(list(qat.parameters())) == 4  # one cell's weights and biases for every step
    assert qat.cell_call2.weight_ih_fake_quant is qat.cell.weight_ih_fake_quant
    assert float(qat.quant_call2.activation_post_process.scale) > 5 * float(qat.quant.activation_post_process.scale)
    qat.eval()
    set_fake_quantize(qat, "validation")
    quantized = convert_fx(qat)
    got = quantized(*xs)
    compiled = compile_model(quantized, xs)
    for a, b in zip(compiled(*xs), got, strict=True):
        assert torch.equal(a, b)


class _EagerSharedHead(nn.Module):
    """One QuantStub and one conv head for every FPN level, written for eager mode."""

    def __init__(self, traceable: bool) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.cls = nn.Conv2d(8, 3, 1)
        self.dequant = DeQuantStub()
        self.traceable = traceable

    def forward(self, p3: torch.Tensor, p4: torch.Tensor) -> list[torch.Tensor]:
        if not self.traceable and bool(p3.sum() > 1e9):  # data-dependent: fx cannot trace it
            raise AssertionError("unreachable")
        return [self.dequant(self.cls(self.quant(f))) for f in (p3, p4)]


@pytest.mark.parametrize("traceable", [True, False], ids=["traced", "recorded"])
def test_eager_prepare_refuses_a_module_whose_one_observer_would_serve_several_calls(traceable: bool) -> None:
    from qir.quantization import prepare_qat

    model = _EagerSharedHead(traceable)
    model.qconfig = get_default_qat_qconfig()
    refused = r"module 'quant' \(QuantStub\) is called (at 2 places|more than once) in one forward.*prepare_qat_fx"
    if traceable:  # found at prepare by one trace
        with pytest.raises(ValueError, match=refused):
            prepare_qat(model)
        return
    qat = prepare_qat(model)  # fx cannot trace it: its first forward finds the shared module
    with pytest.raises(ValueError, match=refused):
        qat(*_levels()[:2])


def test_eager_prepare_accepts_shared_modules_without_their_own_observer() -> None:
    from qir.quantization import convert, prepare_qat

    class OneDequant(nn.Module):
        """A fixed-scale QuantStub for two inputs and one DeQuantStub for two outputs of equal scale."""

        def __init__(self) -> None:
            super().__init__()
            self.quant = QuantStub(scale=1 / 128)
            self.dequant = DeQuantStub()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
            return [self.dequant(torch.relu(self.quant(x))), self.dequant(self.quant(y))]

    model = OneDequant()
    model.qconfig = get_default_qat_qconfig()
    qat = prepare_qat(model)
    x, y = torch.rand(2, 4), torch.rand(2, 4)
    qat(x, y)
    quantized = convert(qat.eval())
    for a, b in zip(quantized(x, y), qat(x, y), strict=True):
        assert torch.allclose(a, b, atol=1 / 128)
