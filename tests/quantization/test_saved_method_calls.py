"""``torch.save`` / ``torch.load`` of models calling FloatFunctional methods: fx re-traces the saved
code on load, and each method call must come back as the one ``call_method`` node it was (the
integer methods cannot run on proxies; a QAT method traced through no longer converts)."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn

from qir.march import march_scope
from qir.nn.modules.functional import FLOAT_FUNCTIONAL_METHODS
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)


class _EveryMethod(nn.Module):
    """Every FloatFunctional method, the number forms (``add(x, 2.0)``) and a shared FloatFunctional,
    on a conv's output and a second input."""

    def __init__(self) -> None:
        super().__init__()
        self.qx, self.qy = QuantStub(), QuantStub()
        self.conv = nn.Conv2d(3, 3, 1)
        self.ff = nn.ModuleDict({m: FloatFunctional() for m in FLOAT_FUNCTIONAL_METHODS})
        self.shared = FloatFunctional()
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        x, y = self.qx(x), self.qy(y)
        x = self.conv(x)
        f = self.ff
        outs = [
            f["add"].add(x, y),
            f["add_relu"].add_relu(x, y),
            f["add_scalar"].add_scalar(x, 0.75),
            f["sub"].sub(x, y),
            f["mul"].mul(x, y),
            f["mul_scalar"].mul_scalar(x, -1.5),
            f["div"].div(x, y),
            f["cat"].cat([x, y], dim=1),
            f["concat"].concat([y, x], dim=1),
            f["concatenate"].concatenate([x, x], dim=2),
            f["stack"].stack([x, y], dim=1),
            f["matmul"].matmul(x, y, y_trans=True),
            f["mean"].mean(x, dim=[2, 3], keepdim=True),
            f["sum"].sum(x, dim=1),
            f["maximum"].maximum(x, y),
            f["minimum"].minimum(x, y),
            f["exp"].exp(x),
            f["ceil"].ceil(x),
            f["floor"].floor(y),
            self.shared.add(self.shared.mul(x, 2.0), x),  # add(x, 2.0) is mul_scalar; one module, two calls
            x.mean(dim=1) + y.sum(dim=1),  # generated FloatFunctionals
        ]
        return [self.dq(o) for o in outs]


def _reloaded(model: nn.Module) -> Any:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 4, 4, generator=g), torch.rand(2, 3, 4, 4, generator=g) + 0.5


def _module_methods(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """``(module type, method)`` of each call_method node on a module, in graph order."""
    found = []
    for n in gm.graph.nodes:
        if n.op == "call_method" and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "get_attr":
            found.append((type(gm.get_submodule(str(n.args[0].target))).__name__, str(n.target)))
    return found


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(u, v), f"output {i}: {float((u - v).abs().max())}"


@pytest.fixture(scope="module", params=["bayes", "bernoulli2"])
def qat_model(request: pytest.FixtureRequest) -> tuple[str, torch.fx.GraphModule]:
    march = request.param
    torch.manual_seed(0)
    with march_scope(march):
        qat = prepare_qat_fx(_EveryMethod(), {"": get_default_qat_qconfig()})
    qat(*_inputs(1))
    set_fake_quantize(qat.eval(), "validation")  # frozen scales: the tests run it without changing it
    return march, qat


def test_a_converted_model_calling_every_method_saves_and_loads(qat_model: tuple[str, Any]) -> None:
    march, qat = qat_model
    with march_scope(march):
        converted = convert_fx(qat)
    called = _module_methods(converted)
    assert {m for cls, m in called if cls == "QFunctional"} == set(FLOAT_FUNCTIONAL_METHODS)
    assert {cls for cls, _ in called} == {"QFunctional"}  # every module qir calls by method in a converted graph
    loaded = _reloaded(converted)
    assert _module_methods(loaded) == called
    x, y = _inputs(2)
    _same(loaded(x, y), converted(x, y))


def test_a_prepared_model_saved_and_loaded_still_converts_to_the_same_model(qat_model: tuple[str, Any]) -> None:
    march, qat = qat_model
    loaded = _reloaded(qat)
    assert _module_methods(loaded) == _module_methods(qat)
    x, y = _inputs(3)
    _same(loaded(x, y), qat(x, y))
    with march_scope(march):
        _same(convert_fx(loaded)(x, y), convert_fx(qat)(x, y))


def test_a_float_model_traced_by_fx_keeps_the_method_calls() -> None:
    model = _EveryMethod().eval()
    traced = torch.fx.symbolic_trace(model)
    assert {m for cls, m in _module_methods(traced)} == set(FLOAT_FUNCTIONAL_METHODS)
    x, y = _inputs(4)
    _same(traced(x, y), model(x, y))
