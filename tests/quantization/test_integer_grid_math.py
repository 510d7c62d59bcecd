"""LayerNorm, Softmax and attention built from them on the integer grid: each training step's forward
equals convert_fx of the state after that step's observer updates, bit for bit, and the gradients
are the float fake quantization's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    disable_observer,
    get_default_qat_qconfig,
    integer_grid_report,
    prepare_qat_fx,
    set_integer_grid,
)
from qir.quantization.integer_grid import bind_integer_grid


class _Block(nn.Module):
    """A pre-norm transformer block: LayerNorm, qkv, scaled dot-product attention written with
    torch calls (matmul, a scale, softmax), the projection fused with the residual add, then a
    LayerNorm without affine parameters."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.q = QuantStub()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d, elementwise_affine=False)
        self.heads = heads
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.q(x)
        b, n, c = x.shape
        qkv = self.qkv(self.ln(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        a = ((q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5).softmax(dim=-1)
        o = (a @ v).transpose(1, 2).reshape(b, n, c)
        return self.dq(self.ln2(self.proj(o) + x))


def _prepare(march: str, qconfig: dict[str, object] | None = None) -> nn.Module:
    torch.manual_seed(0)
    with march_scope(march):
        return prepare_qat_fx(
            _Block(), qconfig or {"": get_default_qat_qconfig()}, example_inputs=(torch.randn(2, 5, 8),)
        ).train()


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_attention_block_steps_are_the_converted_model(march: str) -> None:
    qat = _prepare(march)
    report = integer_grid_report(qat)
    assert set(report.values()) == {"grid"}, report
    assert {"ln", "ln2", "_generated_softmax_0"} <= set(report)
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(qat.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        x = torch.randn(2, 5, 8, generator=g)
        out = qat(x)
        with march_scope(march):
            want = convert_fx(qat)(x)
        assert torch.equal(out, want), float((out - want).detach().abs().max())
        opt.zero_grad()
        out.square().mean().backward()
        opt.step()
    assert qat.ln.weight.grad is not None and bool(qat.ln.weight.grad.abs().sum() > 0)
    # the oracle can fail: float fake quantization is LSBs away from the converted model
    set_integer_grid(qat, False)
    x = torch.randn(2, 5, 8, generator=g)
    with march_scope(march):
        want = convert_fx(qat)(x)
    assert not torch.equal(qat(x), want)


def test_gradients_are_the_float_fake_quant_gradients() -> None:
    qat = _prepare("bayes")
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2)) * 3
    qat(x)
    disable_observer(qat)  # both forwards see the same scales
    # only the last LayerNorm differs between the two forwards when its input is the same: compare
    # the gradients of that module alone, through its float forward and on the grid
    ln2 = qat.ln2
    h = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    in_fq = ln2.__dict__["integer_grid"].inputs[0]
    h = in_fq(h)  # on the input grid
    grads = []
    for grid in (True, False):
        set_integer_grid(qat, grid)
        hi = h.clone().requires_grad_()
        out = qat.ln2(hi)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        assert hi.grad is not None
        grads.append(hi.grad)
    assert torch.equal(grads[0], grads[1])


def test_qint16_layer_norm_input_and_the_softmax_that_has_no_qint16_form() -> None:
    q16 = get_default_qat_qconfig(dtype="qint16")
    qat = _prepare("bayes", {"": get_default_qat_qconfig(), "module_name": {"q": q16}})
    report = integer_grid_report(qat)
    assert report["ln"] == "grid"  # qint16 codes into the LayerNorm
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        x = torch.randn(2, 5, 8, generator=g)
        out = qat(x)
        with march_scope("bayes"):
            assert torch.equal(out, convert_fx(qat)(x))
    qat = _prepare("bayes", {"": get_default_qat_qconfig(), "module_name": {"_generated_mul_0": q16}})
    why = bind_integer_grid(qat, "bayes")
    assert why["_generated_softmax_0"] == "Softmax of qint16 codes has no integer form (qint8 only)"


class _EagerNorm(nn.Module):
    """LayerNorm and Softmax in an eager model fx cannot trace (a branch on a size)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = QuantStub()
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.softmax = nn.Softmax(dim=-1)
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.fc(self.q(x)))
        if h.shape[1] > 3:  # control flow on a size: symbolic tracing fails
            h = self.softmax(h)
        return self.dq(h)


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_eager_layer_norm_and_softmax_steps_are_the_converted_model(march: str) -> None:
    from qir.quantization import convert, prepare_qat

    torch.manual_seed(0)
    base = _EagerNorm()
    base.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    with march_scope(march):
        qat = prepare_qat(base).train()
    g = torch.Generator().manual_seed(5)
    qat(torch.randn(2, 5, 8, generator=g))  # the first forward records which module feeds which
    assert integer_grid_report(qat) == dict.fromkeys(("fc", "ln", "softmax"), "grid")
    opt = torch.optim.SGD(qat.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        x = torch.randn(2, 5, 8, generator=g)
        out = qat(x)
        with march_scope(march):
            want = convert(qat)(x)
        assert torch.equal(out, want), float((out - want).detach().abs().max())
        opt.zero_grad()
        out.square().mean().backward()
        opt.step()
