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


class _MHA(nn.Module):
    """nn.MultiheadAttention between a linear and a head, with a key padding mask and the weights."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.q = QuantStub()
        self.fc = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.head = nn.Linear(8, 3)
        self.dq, self.dqw = DeQuantStub(), DeQuantStub()

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(self.q(x))
        out, weights = self.attn(h, h, h, key_padding_mask=pad)
        return self.dq(self.head(out)), self.dqw(weights)


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_steps_are_the_converted_model(march: str, batch_first: bool) -> None:
    torch.manual_seed(0)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    shape = (2, 5, 8) if batch_first else (5, 2, 8)
    with march_scope(march):
        qat = prepare_qat_fx(
            _MHA(batch_first), {"": get_default_qat_qconfig()}, example_inputs=(torch.randn(*shape), pad)
        ).train()
    assert integer_grid_report(qat)["attn"] == "grid"
    g = torch.Generator().manual_seed(6)
    opt = torch.optim.SGD(qat.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        x = torch.randn(*shape, generator=g)
        out = qat(x, pad)
        with march_scope(march):
            want = convert_fx(qat)(x, pad)
        for a, b in zip(out, want, strict=True):
            assert torch.equal(a, b), float((a - b).detach().abs().max())
        opt.zero_grad()
        (out[0].square().mean() + out[1].square().mean()).backward()
        opt.step()
    grad = qat.attn.in_proj_weight.grad
    assert grad is not None and bool(grad.abs().sum() > 0)
    set_integer_grid(qat, False)
    x = torch.randn(*shape, generator=g)
    with march_scope(march):
        want = convert_fx(qat)(x, pad)
    assert not all(torch.equal(a, b) for a, b in zip(qat(x, pad), want, strict=True))


def test_multihead_attention_gradients_are_the_float_forwards() -> None:
    torch.manual_seed(0)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    with march_scope("bayes"):
        qat = prepare_qat_fx(
            _MHA(True), {"": get_default_qat_qconfig()}, example_inputs=(torch.randn(2, 5, 8), pad)
        ).train()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(7))
    qat(x, pad)
    disable_observer(qat)
    h = qat.fc(qat.q(x)).detach()  # the attention's input, on its grid
    grads = []
    for grid in (True, False):
        set_integer_grid(qat, grid)
        hi = h.clone().requires_grad_()
        out, weights = qat.attn(hi, hi, hi, key_padding_mask=pad)
        # linear in the outputs: the upstream gradient does not depend on the forward values
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward(retain_graph=True)
        (weights * torch.linspace(1, -2, weights.numel()).reshape(weights.shape)).sum().backward()
        assert hi.grad is not None
        grads.append(hi.grad)
    assert torch.equal(grads[0], grads[1])


class _EagerMHA(nn.Module):
    """nn.MultiheadAttention in an eager model fx cannot trace, its output read by a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.q = QuantStub()
        self.fc = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)
        self.dq, self.dqw = DeQuantStub(), DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(self.q(x))
        if h.shape[1] > 3:  # control flow on a size: symbolic tracing fails
            h = h.flip(1)
        out, weights = self.attn(h, h, h)
        return self.dq(self.head(out)), self.dqw(weights)


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_eager_multihead_attention_steps_are_the_converted_model(march: str) -> None:
    from qir.quantization import convert, prepare_qat

    torch.manual_seed(0)
    base = _EagerMHA()
    base.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    with march_scope(march):
        qat = prepare_qat(base).train()
    g = torch.Generator().manual_seed(8)
    qat(torch.randn(2, 5, 8, generator=g))  # the first forward records which module feeds which
    assert integer_grid_report(qat) == dict.fromkeys(("fc", "attn", "head"), "grid")
    opt = torch.optim.SGD(qat.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        x = torch.randn(2, 5, 8, generator=g)
        out = qat(x)
        with march_scope(march):
            want = convert(qat)(x)
        for a, b in zip(out, want, strict=True):
            assert torch.equal(a, b), float((a - b).detach().abs().max())
        opt.zero_grad()
        (out[0].square().mean() + out[1].square().mean()).backward()
        opt.step()


class _Cells(nn.Module):
    """Two LSTM cells over two time steps: the first without a state, the second reading its (h, c)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = QuantStub()
        self.fc = nn.Linear(4, 6)
        self.cell0, self.cell1 = nn.LSTMCell(6, 8), nn.LSTMCell(6, 8)
        self.head = nn.Linear(8, 3)
        self.dq, self.dqc = DeQuantStub(), DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(self.q(x))
        h, c = self.cell0(x[0])
        h, c = self.cell1(x[1], (h, c))
        return self.dq(self.head(h)), self.dqc(c)


def test_lstm_cell_steps_are_the_converted_model() -> None:
    torch.manual_seed(0)
    with march_scope("bayes"):
        qat = prepare_qat_fx(_Cells(), {"": get_default_qat_qconfig()}, example_inputs=(torch.randn(2, 3, 4),))
    qat.train()
    assert integer_grid_report(qat) == dict.fromkeys(("fc", "cell0", "cell1", "head"), "grid")
    g = torch.Generator().manual_seed(9)
    opt = torch.optim.SGD(qat.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        x = torch.randn(2, 3, 4, generator=g) * 2
        out = qat(x)
        with march_scope("bayes"):
            want = convert_fx(qat)(x)
        for a, b in zip(out, want, strict=True):
            assert torch.equal(a, b), float((a - b).detach().abs().max())
        opt.zero_grad()
        (out[0].square().mean() + out[1].square().mean()).backward()
        opt.step()
    grad = qat.cell1.weight_hh.grad
    assert grad is not None and bool(grad.abs().sum() > 0)
    set_integer_grid(qat, False)
    x = torch.randn(2, 3, 4, generator=g) * 2
    with march_scope("bayes"):
        want = convert_fx(qat)(x)
    assert not all(torch.equal(a, b) for a, b in zip(qat(x), want, strict=True))


def test_eager_lstm_cell_steps_are_the_converted_model() -> None:
    from qir.quantization import convert, prepare_qat

    torch.manual_seed(0)
    base = _Cells()
    base.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    with march_scope("bayes"):
        qat = prepare_qat(base).train()
    g = torch.Generator().manual_seed(10)
    qat(torch.randn(2, 3, 4, generator=g))  # the first forward records which module feeds which
    assert integer_grid_report(qat) == dict.fromkeys(("fc", "cell0", "cell1", "head"), "grid")
    opt = torch.optim.SGD(qat.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        x = torch.randn(2, 3, 4, generator=g) * 2
        out = qat(x)
        with march_scope("bayes"):
            want = convert(qat)(x)
        for a, b in zip(out, want, strict=True):
            assert torch.equal(a, b), float((a - b).detach().abs().max())
        opt.zero_grad()
        (out[0].square().mean() + out[1].square().mean()).backward()
        opt.step()


class _WholeState(nn.Module):
    """The second cell reads the first cell's whole output ``hx`` (one tuple value, not ``(h, c)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = QuantStub()
        self.fc = nn.Linear(4, 6)
        self.cell0, self.cell1 = nn.LSTMCell(6, 8), nn.LSTMCell(6, 8)
        self.head = nn.Linear(8, 3)
        self.dq, self.dqc = DeQuantStub(), DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(self.q(x))
        hx = self.cell0(x[0])
        h, c = self.cell1(x[1], hx)
        return self.dq(self.head(h)), self.dqc(c)


@pytest.mark.parametrize("flow", ["fx", "eager"])
def test_a_cell_reading_another_cells_whole_state_is_on_the_grid(flow: str) -> None:
    from qir.quantization import FakeQuantState, convert, prepare_qat, set_fake_quantize

    torch.manual_seed(0)
    with march_scope("bayes"):
        if flow == "fx":
            qat = prepare_qat_fx(_WholeState(), {"": get_default_qat_qconfig()}, example_inputs=(torch.randn(2, 3, 4),))
            to_int = convert_fx
        else:
            base = _WholeState()
            base.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
            qat = prepare_qat(base)
            to_int = convert
    qat.train()
    g = torch.Generator().manual_seed(11)
    if flow == "eager":
        qat(torch.randn(2, 3, 4, generator=g))  # the first forward records which module feeds which
    assert integer_grid_report(qat) == dict.fromkeys(("fc", "cell0", "cell1", "head"), "grid")
    opt = torch.optim.SGD(qat.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        x = torch.randn(2, 3, 4, generator=g) * 2
        out = qat(x)
        with march_scope("bayes"):
            want = to_int(qat)(x)
        for a, b in zip(out, want, strict=True):
            assert torch.equal(a, b), float((a - b).detach().abs().max())
        opt.zero_grad()
        (out[0].square().mean() + out[1].square().mean()).backward()
        opt.step()
    assert integer_grid_report(qat)["cell1"] == "grid"
    set_fake_quantize(qat.eval(), FakeQuantState.VALIDATION)
    x = torch.randn(2, 3, 4, generator=g)
    with march_scope("bayes"):
        want = to_int(qat)(x)
    assert all(torch.equal(a, b) for a, b in zip(qat(x), want, strict=True))
