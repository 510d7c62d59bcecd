"""FloatFunctional add / add_relu / sub / mul / cat / stack on the integer grid: each training step's
forward equals convert_fx of the state after that step's observer updates, bit for bit, and the
gradients are the float fake quantization's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qir.march import march_scope
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    disable_observer,
    get_default_qat_qconfig,
    integer_grid_report,
    prepare_qat_fx,
    set_fake_quantize,
    set_integer_grid,
)


class _ResidualFF(nn.Module):
    """A resnet-style block whose adds do not fuse into a conv (identity + ReLU output), then mul,
    sub, cat, stack and a conv reading the cat (bound through the cat's output scale)."""

    def __init__(self, extra: str | None = None) -> None:
        super().__init__()
        self.quant, self.quant2 = QuantStub(), QuantStub()
        self.conv1, self.conv2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.relu1, self.relu2 = nn.ReLU(), nn.ReLU()
        self.add, self.add_relu, self.sub = FloatFunctional(), FloatFunctional(), FloatFunctional()
        self.mul, self.cat, self.stack = FloatFunctional(), FloatFunctional(), FloatFunctional()
        self.extra = FloatFunctional() if extra else None
        self.extra_method = extra
        self.head = nn.Conv2d(12, 3, 1)
        self.dq, self.dq2 = DeQuantStub(), DeQuantStub()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.quant(x), self.quant2(y)
        a = self.add.add(self.relu1(self.conv1(x)), x)  # identity shortcut: an unfused FF add
        b = self.add_relu.add_relu(self.relu2(self.conv2(a)), a)
        c = self.sub.sub(b, y)
        d = self.mul.mul(c, a)
        e = self.cat.cat([b, d, c], dim=1)
        s = self.stack.stack([a, y], dim=1)
        if self.extra is not None:
            s = getattr(self.extra, str(self.extra_method))(s)
        return self.dq(self.head(e)), self.dq2(s)


def _inputs(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 4, 6, 6, generator=g), torch.randn(2, 4, 6, 6, generator=g) * 2


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_each_training_step_is_the_converted_model(march: str) -> None:
    torch.manual_seed(0)
    with march_scope(march):
        qat = prepare_qat_fx(_ResidualFF(), {"": get_default_qat_qconfig()}).train()
    report = integer_grid_report(qat)
    assert {p: report[p] for p in ("add", "add_relu", "sub", "mul", "cat", "stack", "head")} == dict.fromkeys(
        ("add", "add_relu", "sub", "mul", "cat", "stack", "head"), "grid"
    )
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(qat.parameters(), lr=0.05, momentum=0.9)
    for _ in range(4):
        x, y = _inputs(g)
        out = qat(x, y)
        with march_scope(march):
            converted = convert_fx(qat)
        want = converted(x, y)
        for a, b in zip(out, want, strict=True):
            assert torch.equal(a, b), float((a - b).abs().max())
        opt.zero_grad()
        sum(o.square().mean() for o in out).backward()  # type: ignore[union-attr]
        opt.step()
    qat.eval()
    set_fake_quantize(qat, "validation")
    x, y = _inputs(g)
    with march_scope(march):
        want = convert_fx(qat)(x, y)
    for a, b in zip(qat(x, y), want, strict=True):
        assert torch.equal(a, b)


class _Ops(nn.Module):
    """Each grid method once, on quantized inputs, straight to a DeQuantStub."""

    METHODS = ("add", "add_relu", "sub", "mul", "cat", "stack")

    def __init__(self) -> None:
        super().__init__()
        self.qx, self.qy = QuantStub(), QuantStub()
        self.ff = nn.ModuleDict({m: FloatFunctional() for m in self.METHODS})
        self.dq = nn.ModuleList(DeQuantStub() for _ in self.METHODS)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        x, y = self.qx(x), self.qy(y)
        outs = []
        for name in self.METHODS:
            f = getattr(self.ff[name], name)
            outs.append(f([x, y], dim=1) if name in ("cat", "stack") else f(x, y))
        return [dq(o) for dq, o in zip(self.dq, outs, strict=True)]


def test_gradients_are_the_float_fake_quant_gradients() -> None:
    torch.manual_seed(0)
    with march_scope("bayes"):
        qat = prepare_qat_fx(_Ops(), {"": get_default_qat_qconfig()}).train()
    assert set(integer_grid_report(qat).values()) == {"grid"}
    g = torch.Generator().manual_seed(2)
    x, y = _inputs(g)
    y = y * 3  # the sums and products saturate somewhere: the masks matter
    qat(x, y)  # settle the observers, then freeze them so both forwards see the same scales
    disable_observer(qat)
    grads, outs = [], []
    for grid in (True, False):
        set_integer_grid(qat, grid)
        xi, yi = x.clone().requires_grad_(), y.clone().requires_grad_()
        out = qat(xi, yi)
        weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(out)]
        sum((o * w).sum() for o, w in zip(out, weights, strict=True)).backward()  # type: ignore[union-attr]
        grads.append((xi.grad, yi.grad))
        outs.append(out)
    for a, b in zip(*grads, strict=True):
        assert a is not None and b is not None
        assert torch.equal(a, b), float((a - b).abs().max())
    # the forwards differ by at most one output LSB (the float simulation's rounding)
    for name, a, b in zip(_Ops.METHODS, *outs, strict=True):
        lsb = float(qat.get_submodule(f"ff.{name}").activation_post_process.scale)
        assert float((a - b).abs().max()) <= lsb * 1.0001, name


def test_a_method_after_the_join_is_on_the_grid_too() -> None:
    """exp of a stack's output: every FloatFunctional method has its integer form on the grid
    (tests/quantization/test_integer_grid_methods.py: each one, and qint16 ceil / floor, which has none)."""
    with march_scope("bayes"):
        qat = prepare_qat_fx(_ResidualFF("exp"), {"": get_default_qat_qconfig()}).train()
    report = integer_grid_report(qat)
    assert report["extra"] == "grid" and report["stack"] == "grid"
    from qir.quantization.integer_grid import bind_integer_grid

    assert "extra" not in bind_integer_grid(qat, "bayes")
    g = torch.Generator().manual_seed(6)
    for _ in range(2):
        x, y = _inputs(g)
        out = qat(x, y)  # observers update first: the step equals convert_fx of the state it leaves
        with march_scope("bayes"):
            want = convert_fx(qat)(x, y)
        for a, b in zip(out, want, strict=True):
            assert torch.equal(a, b)


class _SharedFF(nn.Module):
    """One FloatFunctional for two adds and a mul: each call site gets its own output fake quant."""

    def __init__(self) -> None:
        super().__init__()
        self.qx, self.qy = QuantStub(), QuantStub()
        self.ff = FloatFunctional()
        self.conv = nn.Conv2d(4, 3, 1)
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = self.qx(x), self.qy(y)
        return self.dq(self.conv(self.ff.mul(self.ff.add(self.ff.add(x, y), x), y)))


def test_a_floatfunctional_called_at_several_places() -> None:
    torch.manual_seed(0)
    with march_scope("bayes"):
        qat = prepare_qat_fx(_SharedFF(), {"": get_default_qat_qconfig()}).train()
    assert integer_grid_report(qat) == dict.fromkeys(("ff", "conv", "ff_call1", "ff_call2"), "grid")
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = _inputs(g)
        out = qat(x, y)
        with march_scope("bayes"):
            assert torch.equal(out, convert_fx(qat)(x, y))


class _FPN(nn.Module):
    """Bilinear upsampling by a factor and to a run-time size (FPN's lateral add)."""

    def __init__(self, align_corners: bool) -> None:
        super().__init__()
        import qir.nn as qnn

        self.quant = QuantStub()
        self.down = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.lateral = nn.Conv2d(3, 4, 1)
        self.up = qnn.Interpolate(scale_factor=2, mode="bilinear", align_corners=align_corners)
        self.up_to = qnn.Interpolate(mode="bilinear", align_corners=align_corners)
        self.add = FloatFunctional()
        self.head = nn.Conv2d(4, 2, 1)
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        d = self.down(x)
        lat = self.lateral(x)
        top = self.up_to(self.up(d), lat.shape[2:])
        top = F.interpolate(top, size=(lat.shape[2] + 1, lat.shape[3]), mode="bilinear")  # prepared as a module
        lat = F.interpolate(lat, size=top.shape[2:], mode="bilinear")
        return self.dq(self.head(self.add.add(top, lat)))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_bilinear_resize_steps_are_the_converted_model(march: str, align_corners: bool) -> None:
    torch.manual_seed(0)
    qconfig: dict[str, object] = {"": get_default_qat_qconfig()}
    if march == "bayes":
        qconfig["module_name"] = {"down": get_default_qat_qconfig(dtype="qint16")}  # a qint16 resize input
    with march_scope(march):
        qat = prepare_qat_fx(_FPN(align_corners), qconfig).train()
    report = integer_grid_report(qat)
    assert [p for p in report if "interpolate" in p] == ["_generated_interpolate_0", "_generated_interpolate_1"]
    assert set(report.values()) == {"grid"}
    g = torch.Generator().manual_seed(4)
    opt = torch.optim.SGD(qat.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        x = torch.randn(2, 3, 9, 7, generator=g)  # odd sizes: the run-time size differs from 2x
        out = qat(x)
        with march_scope(march):
            want = convert_fx(qat)(x)
        assert torch.equal(out, want), float((out - want).abs().max())
        opt.zero_grad()
        out.square().mean().backward()
        opt.step()


class _Tables(nn.Module):
    """Table lookups on qint8 and (Bayes) qint16 codes between convs."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv8, self.conv16 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
        self.sig, self.tanh, self.silu = nn.Sigmoid(), nn.Tanh(), nn.SiLU()
        self.head = nn.Conv2d(12, 2, 1)
        self.cat = FloatFunctional()
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        a, b = self.conv8(x), self.conv16(x)
        return self.dq(self.head(self.cat.cat([self.sig(a), self.tanh(b), self.silu(b)], dim=1)))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_table_lookup_steps_are_the_converted_model(march: str) -> None:
    torch.manual_seed(0)
    qconfig: dict[str, object] = {"": get_default_qat_qconfig()}
    if march == "bayes":  # qint16 codes into tanh and silu (segmented tables), silu with a qint16 output
        q16 = get_default_qat_qconfig(dtype="qint16")
        qconfig["module_name"] = {"conv16": q16, "silu": q16}
    with march_scope(march):
        qat = prepare_qat_fx(_Tables(), qconfig).train()
    assert {p: integer_grid_report(qat)[p] for p in ("sig", "tanh", "silu")} == dict.fromkeys(
        ("sig", "tanh", "silu"), "grid"
    )
    g = torch.Generator().manual_seed(5)
    opt = torch.optim.SGD(qat.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        x = torch.randn(2, 3, 6, 6, generator=g) * 2
        out = qat(x)
        with march_scope(march):
            want = convert_fx(qat)(x)
        assert torch.equal(out, want), float((out - want).abs().max())
        opt.zero_grad()
        out.square().mean().backward()
        opt.step()
    assert qat.conv8.weight.grad is not None and bool(qat.conv8.weight.grad.abs().sum() > 0)
