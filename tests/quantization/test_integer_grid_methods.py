"""The FloatFunctional methods beyond add / sub / mul / cat on the integer grid (add_scalar, mul_scalar,
div, matmul, mean, sum, maximum, minimum, exp, ceil, floor), module and functional forms, fx and eager:
each training step's forward equals the converted model of the state after that step's observer updates,
bit for bit, and the gradients are the float fake quantization's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qir.march import march_scope
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert,
    convert_fx,
    disable_observer,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    integer_grid_report,
    prepare_qat,
    prepare_qat_fx,
    set_integer_grid,
)
from qir.quantization.integer_grid import bind_integer_grid

METHODS = ("add_scalar", "mul_scalar", "div", "matmul", "mean", "sum", "maximum", "minimum", "exp", "ceil", "floor")


class _Methods(nn.Module):
    """Each method once as a FloatFunctional module call, on a conv's output and a second input."""

    def __init__(self, conv: bool = True) -> None:
        super().__init__()
        self.qx, self.qy = QuantStub(), QuantStub()
        self.conv = nn.Conv2d(3, 3, 1) if conv else nn.Identity()
        self.ff = nn.ModuleDict({m: FloatFunctional() for m in METHODS})
        self.dq = nn.ModuleList(DeQuantStub() for _ in METHODS)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        x, y = self.qx(x), self.qy(y)
        x = self.conv(x)
        f = self.ff
        outs = [
            f["add_scalar"].add_scalar(x, 0.75),
            f["mul_scalar"].mul_scalar(x, -1.5),
            f["div"].div(x, y),
            f["matmul"].matmul(x, y, y_trans=True),
            f["mean"].mean(x, dim=[2, 3], keepdim=True),
            f["sum"].sum(x, dim=1),
            f["maximum"].maximum(x, y),
            f["minimum"].minimum(x, y),
            f["exp"].exp(x),
            f["ceil"].ceil(x),
            f["floor"].floor(y),
        ]
        return [d(o) for d, o in zip(self.dq, outs, strict=True)]


class _Functional(nn.Module):
    """The same methods spelled as torch calls (prepare_qat_fx generates their FloatFunctionals), a
    number computed from a size, and a high-precision matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.qx, self.qy = QuantStub(), QuantStub()
        self.conv = nn.Conv2d(3, 3, 1)
        self.mm = FloatFunctional()
        self.dq = nn.ModuleList(DeQuantStub() for _ in range(9))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        x, y = self.qx(x), self.qy(y)
        x = self.conv(x)
        outs = [
            x + 0.5,
            x * (1.0 / x.shape[-1]),  # a number computed at run time
            x / y,
            torch.matmul(x, y.transpose(-2, -1)),
            x.mean(dim=(2, 3), keepdim=True),
            x.sum(1),
            torch.maximum(x, y),
            torch.minimum(x, y),
            self.mm.matmul(x, y, x_trans=True),  # qint32 output (module_name qconfig below)
        ]
        return [d(o) for d, o in zip(self.dq, outs, strict=True)]


def _inputs(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # y away from 0 for div; its range overlaps x's for maximum / minimum
    return torch.randn(2, 3, 5, 5, generator=g), torch.randn(2, 3, 5, 5, generator=g) + 3


def _train_equal_to_converted(qat: nn.Module, march: str, convert_fn: object, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(qat.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        x, y = _inputs(g)
        out = qat(x, y)
        with march_scope(march):
            want = convert_fn(qat)(x, y)  # type: ignore[operator]
        for i, (a, b) in enumerate(zip(out, want, strict=True)):
            assert torch.equal(a, b), (i, float((a - b).abs().max()))
        opt.zero_grad()
        sum(o.square().mean() for o in out).backward()  # type: ignore[union-attr]
        opt.step()


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_module_methods_train_as_the_converted_model(march: str) -> None:
    torch.manual_seed(0)
    with march_scope(march):
        qat = prepare_qat_fx(_Methods(), {"": get_default_qat_qconfig()}).train()
    assert set(integer_grid_report(qat).values()) == {"grid"}
    _train_equal_to_converted(qat, march, convert_fx)
    # the oracle can fail: with float fake quantization some outputs are LSBs away
    set_integer_grid(qat, False)
    x, y = _inputs(torch.Generator().manual_seed(9))
    with march_scope(march):
        want = convert_fx(qat)(x, y)
    assert not all(torch.equal(a, b) for a, b in zip(qat(x, y), want, strict=True))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_functional_spellings_train_as_the_converted_model(march: str) -> None:
    torch.manual_seed(0)
    qconfig = {"": get_default_qat_qconfig(), "module_name": {"mm": get_default_qat_out_qconfig()}}
    with march_scope(march):
        qat = prepare_qat_fx(_Functional(), qconfig).train()
    report = integer_grid_report(qat)
    assert set(report.values()) == {"grid"} and len(report) == 10, report
    assert qat.mm.activation_post_process is None  # the high-precision matmul is on the grid too
    _train_equal_to_converted(qat, march, convert_fx)


class _Sixteen(nn.Module):
    """qint16 codes into exp (the segmented table), mean and, when asked, ceil (the exact segmented table)."""

    def __init__(self, ceil: bool = False) -> None:
        super().__init__()
        self.q = QuantStub()
        self.conv = nn.Conv2d(3, 3, 1)
        self.exp, self.mean = FloatFunctional(), FloatFunctional()
        self.ceil = FloatFunctional() if ceil else None
        self.dq = nn.ModuleList(DeQuantStub() for _ in range(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        x = self.conv(self.q(x))
        outs = [self.exp.exp(x), self.mean.mean(x, dim=1)]
        if self.ceil is not None:
            outs.append(self.ceil.ceil(x))
        return [d(o) for d, o in zip(self.dq, outs, strict=False)]


def _qint16_conv() -> dict[str, object]:
    return {"": get_default_qat_qconfig(), "module_name": {"conv": get_default_qat_qconfig(dtype="qint16")}}


def test_qint16_exp_and_mean_train_as_the_converted_model() -> None:
    torch.manual_seed(0)
    with march_scope("bayes"):
        qat = prepare_qat_fx(_Sixteen(), _qint16_conv()).train()
    assert set(integer_grid_report(qat).values()) == {"grid"}
    _train_equal_to_converted(qat, "bayes", convert_fx)


def test_qint16_ceil_trains_as_the_converted_model() -> None:
    """ceil of qint16 codes: the exact segmented table (every jump its own interval), on the grid."""
    torch.manual_seed(0)
    with march_scope("bayes"):
        qat = prepare_qat_fx(_Sixteen(ceil=True), _qint16_conv()).train()
    report = integer_grid_report(qat)
    assert report["exp"] == report["mean"] == report["ceil"] == "grid", report
    assert bind_integer_grid(qat, "bayes") == {}
    _train_equal_to_converted(qat, "bayes", convert_fx)


def test_gradients_are_the_float_fake_quant_gradients() -> None:
    torch.manual_seed(0)
    with march_scope("bayes"):
        qat = prepare_qat_fx(_Methods(conv=False), {"": get_default_qat_qconfig()}).train()
    x, y = _inputs(torch.Generator().manual_seed(3))
    x = x * 4  # products and sums saturate somewhere: the masks matter
    qat(x, y)
    disable_observer(qat)  # both forwards see the same scales
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
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # 0 / 0 where a y code is 0
    # the forwards differ by at most one output LSB per method (the float simulation's rounding)
    for name, a, b in zip(METHODS, *outs, strict=True):
        lsb = float(qat.get_submodule(f"ff.{name}").activation_post_process.scale)
        assert float((a - b).detach().abs().max()) <= lsb * 1.0001, name


class _Eager(nn.Module):
    """An eager model fx cannot trace (a branch on a tensor's size) with FloatFunctional methods."""

    def __init__(self) -> None:
        super().__init__()
        self.qx, self.qy = QuantStub(), QuantStub()
        self.conv = nn.Conv2d(3, 3, 1)
        self.scale, self.div, self.mm = FloatFunctional(), FloatFunctional(), FloatFunctional()
        self.mean, self.exp, self.cat = FloatFunctional(), FloatFunctional(), FloatFunctional()
        self.dq, self.dq2 = DeQuantStub(), DeQuantStub()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.qx(x), self.qy(y)
        x = self.conv(x)
        if x.shape[-1] > 4:  # control flow on a size: symbolic tracing fails
            x = self.scale.mul_scalar(x, 0.5)
        a = self.div.div(x, y)
        b = self.mm.matmul(a, x, y_trans=True)
        c = self.mean.mean(self.exp.exp(b), dim=-1, keepdim=True)
        return self.dq(self.cat.cat([a, x], dim=1)), self.dq2(c)


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_eager_methods_train_as_the_converted_model(march: str) -> None:
    torch.manual_seed(0)
    base = _Eager()
    base.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    with march_scope(march):
        qat = prepare_qat(base).train()
    g = torch.Generator().manual_seed(4)
    qat(*_inputs(g))  # the first forward records which module feeds which
    report = integer_grid_report(qat)
    assert report and set(report.values()) == {"grid"}, report
    _train_equal_to_converted(qat, march, convert)
