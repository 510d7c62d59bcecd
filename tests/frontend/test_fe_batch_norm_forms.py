"""How a batch norm comes back out of the IR: a user's ``F.batch_norm`` call stays that call, a
module batch norm stays a module (with a scope or without one: it trains its running statistics),
and the function flavour of the op (``dims=0``, no counter) is its eval call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qir.frontend import emit, trace
from qir.ir import parser, printer, run_graph


class FunctionalThenModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rm", torch.randn(3))
        self.register_buffer("rv", torch.rand(3) + 0.5)
        self.w = nn.Parameter(torch.randn(3))
        self.b = nn.Parameter(torch.randn(3))
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(F.batch_norm(x, self.rm, self.rv, self.w, self.b, False, 0.1, 1e-5))


def _model() -> FunctionalThenModule:
    torch.manual_seed(0)
    m = FunctionalThenModule().eval()
    with torch.no_grad():
        m.bn.running_mean.normal_()
        m.bn.running_var.uniform_(0.5, 2.0)
        m.bn.weight.normal_()
    return m


def _without_scope(m: nn.Module, x: torch.Tensor, edit: str = "") -> tuple[object, str]:
    g = trace(m, (x,))
    text = printer.print_graph(g).replace(" @bn", "")
    if edit:
        text = text.replace("%bn_running_var, %bn_num_batches_tracked)", f"%bn_running_var{edit})")
    return parser.parse_graph(text, constants=g.constants, objects=g.objects), text


def test_user_functional_batch_norm_emits_as_the_call() -> None:
    m, x = _model(), torch.randn(2, 3, 4, 4)
    gm = emit(trace(m, (x,)))
    assert "torch.nn.functional.batch_norm(x, rm, rv" in gm.code
    assert isinstance(gm.bn, nn.BatchNorm2d)
    torch.testing.assert_close(gm(x), m(x), rtol=0, atol=0)


def test_scopeless_module_batch_norm_stays_a_module_that_trains() -> None:
    m, x = _model(), torch.randn(2, 3, 4, 4)
    g, _ = _without_scope(m, x)
    gm = emit(g)
    built = gm.get_submodule("_qir_bn")
    assert isinstance(built, nn.BatchNorm2d) and "self._qir_bn(" in gm.code
    torch.testing.assert_close(gm(x), m(x), rtol=0, atol=0)
    before = built.running_mean.clone()
    gm.train()
    gm(x)  # the eval call would leave the statistics alone; the module updates them
    assert not torch.equal(built.running_mean, before)


def test_scopeless_function_flavour_emits_its_eval_call() -> None:
    m, x = _model(), torch.randn(2, 3, 4, 4)
    g, text = _without_scope(m, x, edit=", dims=0, counter=False")
    assert "dims=0" in text
    gm = emit(g)
    assert not any(name.startswith("_qir_") for name, _ in gm.named_children())
    assert gm.code.count("torch.nn.functional.batch_norm(") == 2
    want = run_graph(g, x)
    torch.testing.assert_close(gm(x), want, rtol=0, atol=0)
    torch.testing.assert_close(gm(x), m(x), rtol=0, atol=0)
