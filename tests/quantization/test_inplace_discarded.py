"""In-place calls whose result is discarded while the tensor they write is read later
(``s.act(y); return y`` with ``nn.ReLU(inplace=True)``, ``F.relu(y, inplace=True)``, ``z = y; y += 1``):
the traced, fused and prepared models compute what the eager model does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.quantization import DeQuantStub, QuantStub

from qir.frontend.tracer import TraceError
from qir.march import March, set_march
from qir.quantization import fuse_fx, get_default_qat_qconfig, prepare_qat_fx
from qir.quantization.fake_quantize import disable_fake_quant
from qir.quantization.fx_trace import trace_fx

#: every spelling of an in-place write whose result the forward drops
DISCARDED = (
    "F.relu",
    "F.relu(positional)",
    "F.hardtanh",
    "F.leaky_relu",
    "nn.ReLU",
    "nn.ReLU6",
    "nn.LeakyReLU",
    "relu_",
    "clamp_",
    "mul_",
    "add_",
    "sigmoid_",
    "torch.relu_",
    "F.relu_",
    "+=",
    "*=",
    "-=",
)


def _discard(m: Program, kind: str, v: torch.Tensor) -> None:
    """Write ``v`` in place as ``kind`` says and drop the result (``+=`` rebinds a local only)."""
    if kind == "F.relu":
        F.relu(v, inplace=True)
    elif kind == "F.relu(positional)":
        F.relu(v, True)
    elif kind == "F.hardtanh":
        F.hardtanh(v, -0.25, 0.25, inplace=True)
    elif kind == "F.leaky_relu":
        F.leaky_relu(v, 0.2, inplace=True)
    elif kind.startswith("nn."):
        m.acts[kind[3:]](v)
    elif kind == "relu_":
        v.relu_()
    elif kind == "clamp_":
        v.clamp_(min=-0.1, max=0.3)
    elif kind == "mul_":
        v.mul_(0.5)
    elif kind == "add_":
        v.add_(0.25)
    elif kind == "sigmoid_":
        v.sigmoid_()
    elif kind == "torch.relu_":
        torch.relu_(v)
    elif kind == "F.relu_":
        F.relu_(v)
    elif kind == "+=":
        v += 0.5
    elif kind == "*=":
        v *= 2.0
    else:
        assert kind == "-="
        v -= 0.125


class Program(nn.Module):
    """A straight-line forward from drawn steps: ``("conv", i)``, ``("add", i, j)``, ``("mul", i)``
    append a new value computed from earlier ones; ``(kind, i)`` for a kind in :data:`DISCARDED`
    writes value i in place and drops the result. Every value is returned, read after all writes."""

    def __init__(self, steps: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.steps = steps
        self.q = QuantStub()
        self.convs = nn.ModuleList(nn.Conv2d(4, 4, 1) for s in steps if s[0] == "conv")
        self.acts = nn.ModuleDict(
            {
                "ReLU": nn.ReLU(inplace=True),
                "ReLU6": nn.ReLU6(inplace=True),
                "LeakyReLU": nn.LeakyReLU(0.1, inplace=True),
            }
        )
        self.dq = nn.ModuleList(DeQuantStub() for s in steps if s[0] in ("conv", "add", "mul"))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vals = [self.convs[0](self.q(x))]  # the first step is a conv of the input: nothing writes the input
        k = 1
        for s in self.steps[1:]:
            if s[0] == "conv":
                vals.append(self.convs[k](vals[s[1] % len(vals)]))
                k += 1
            elif s[0] == "add":
                vals.append(vals[s[1] % len(vals)] + vals[s[2] % len(vals)])
            elif s[0] == "mul":
                vals.append(vals[s[1] % len(vals)] * 1.5)
            else:
                _discard(self, s[0], vals[s[1] % len(vals)])
        return tuple(dq(v) for dq, v in zip(self.dq, vals, strict=True))


_index = st.integers(0, 7)
_step = st.one_of(
    st.tuples(st.just("conv"), _index),
    st.tuples(st.just("add"), _index, _index),
    st.tuples(st.just("mul"), _index),
    st.tuples(st.sampled_from(DISCARDED), _index),
)
programs = st.lists(_step, min_size=1, max_size=8).map(lambda s: [("conv", 0), *s])


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


@pytest.fixture(autouse=True)
def _bayes() -> Any:
    set_march(March.BAYES)
    yield


@settings(max_examples=25)
@given(programs, st.integers(0, 2**16))
def test_discarded_inplace_calls_keep_the_eager_result(steps: list[tuple[Any, ...]], seed: int) -> None:
    torch.manual_seed(seed)
    m = Program(steps).eval()
    x = torch.randn(2, 4, 3, 3)
    with torch.no_grad():
        expected = m(x.clone())
        traced = torch.fx.GraphModule(m, trace_fx(m))
        _same(traced(x.clone()), expected)
        _same(fuse_fx(m)(x.clone()), expected)
        qat = prepare_qat_fx(m, {"": get_default_qat_qconfig()}, example_inputs=(x,)).eval()
        disable_fake_quant(qat)
        _same(qat(x.clone()), expected)


@pytest.mark.parametrize("kind", DISCARDED)
def test_each_spelling_is_kept_after_a_conv(kind: str) -> None:
    """The trial's case: the write follows a conv, which fusion would otherwise take alone."""
    torch.manual_seed(0)
    m = Program([("conv", 0), (kind, 0)]).eval()
    x = torch.randn(2, 4, 3, 3)
    with torch.no_grad():
        expected = m(x.clone())
        _same(fuse_fx(m)(x.clone()), expected)
        qat = prepare_qat_fx(m, {"": get_default_qat_qconfig()}, example_inputs=(x,)).eval()
        disable_fake_quant(qat)
        _same(qat(x.clone()), expected)


class _ThroughView(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        if self.kind == "F.relu":
            F.relu(y[:, :2], inplace=True)
        elif self.kind == "F.leaky_relu":
            F.leaky_relu(y[:, :2], 0.2, inplace=True)
        elif self.kind == "relu_":
            y[:, :2].relu_()
        else:
            self.act(y[:, :2])
        return y


@pytest.mark.parametrize("kind", ["F.relu", "F.leaky_relu", "relu_"])
def test_a_discarded_write_through_a_view_stays_in_the_float_graph(kind: str) -> None:
    x = torch.randn(2, 4, 3, 3)
    torch.testing.assert_close(fuse_fx(_ThroughView(kind))(x), _ThroughView(kind)(x))


def test_a_discarded_inplace_module_on_a_view_is_refused_by_name() -> None:
    with pytest.raises(TraceError, match=r"module 'act' \(ReLU\) at node 'act' runs in place on 'getitem'"):
        fuse_fx(_ThroughView("module"))
