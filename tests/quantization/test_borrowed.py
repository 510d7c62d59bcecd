"""prepare_qat_fx copies only the user's tensors that survive fusion (qir/quantization/borrowed.py).

The oracle is the whole deep copy (``_borrowable`` returning None): the same state-dict keys in
the same order, the same tensors bit for bit, the same random stream after prepare, and no tensor
of the prepared model or of its record shares storage with the user's model, which training leaves
as it was.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import qir
import qir.quantization.borrowed as borrowed_module
from qir.quantization import DeQuantStub, QuantStub, get_default_qat_qconfig, prepare_qat_fx
from qir.quantization.borrowed import Borrowed, borrowing_copy
from qir.quantization.prepare import PREPARE_RECORD_KEY
from qir.utils.fx_helper import wrap
from tests.flows.hybrid_models import HybridModel, seed_hybrid_dict
from tests.quantization.test_prepare_paths import ResNetShaped


class Survivors(nn.Module):
    """Folded convs beside tensors that survive fusion: a conv without batch norm, a batch norm
    after an add (not folded), a linear whose weight a second linear shares; with ``offset``, a
    buffer the forward reads (the shape formulas have none for it: the graph is typed by a run)."""

    def __init__(self, offset: bool) -> None:
        super().__init__()
        self.with_offset = offset
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.plain = nn.Conv2d(4, 4, 1)
        self.lone_bn = nn.BatchNorm2d(4)
        self.lone_bn.qconfig = None  # no quantized form: float on purpose (on codes with a qconfig, prepare refuses it)
        self.fc1, self.fc2 = nn.Linear(4 * 8 * 8, 8), nn.Linear(4 * 8 * 8, 8)
        self.fc2.weight = self.fc1.weight
        self.register_buffer("offset", torch.randn(4, 1, 1))
        self.offset_quant = QuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(self.quant(x))))
        y = self.plain(y) + y
        y = self.lone_bn(y + self.offset_quant(self.offset) if self.with_offset else y)
        y = torch.flatten(y, 1)
        return self.dequant(self.fc1(y) + self.fc2(y))


@contextlib.contextmanager
def _whole_copy() -> Iterator[None]:
    """prepare with the whole deep copy of the model (what it did before borrowing)."""
    saved = borrowed_module._borrowable
    borrowed_module._borrowable = lambda model: None  # type: ignore[assignment]
    try:
        yield
    finally:
        borrowed_module._borrowable = saved


def _storages(*modules: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for m in modules for t in (*m.parameters(), *m.buffers()) if t.numel() > 0}


def _prepared_modules(gm: torch.fx.GraphModule) -> list[nn.Module]:
    record = gm.meta[PREPARE_RECORD_KEY]
    return [gm, record.float_model, *(bn for _, bn in record.batch_norms.values())]


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _prepare(model: nn.Module, x: torch.Tensor, **kwargs: Any) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    torch.manual_seed(11)
    gm = prepare_qat_fx(model, {"": get_default_qat_qconfig()}, x, **kwargs)
    return gm, torch.rand(4)  # the random stream after prepare


@pytest.mark.parametrize("net", ["survivors", "survivors_typed_by_run", "resnet_shaped", "hybrid"])
def test_borrowing_prepare_equals_the_whole_copy_and_never_shares_the_users_tensors(net: str) -> None:
    qir.set_march("bayes")
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {}
    if net.startswith("survivors"):
        model, x = Survivors(offset=net.endswith("run")).train(), torch.randn(2, 3, 8, 8)
    elif net == "resnet_shaped":
        model, x = ResNetShaped().train(), torch.randn(2, 3, 16, 16)
    else:
        model, x = HybridModel().train(), torch.randn(2, 3, 16, 16)
        kwargs = {"hybrid": True, "hybrid_dict": seed_hybrid_dict()}
    before = _snapshot(model)
    assert borrowing_copy(model)[1] is not None  # the model lends its tensors
    gm, after = _prepare(model, x, **kwargs)
    with _whole_copy():
        oracle, oracle_after = _prepare(model, x, **kwargs)
    assert torch.equal(after, oracle_after)
    for mine, theirs in zip(_prepared_modules(gm), _prepared_modules(oracle), strict=True):
        sd, osd = mine.state_dict(), theirs.state_dict()
        assert list(sd) == list(osd)
        for k in sd:
            assert sd[k].dtype == osd[k].dtype and torch.equal(sd[k], osd[k]), k
        assert [n for n, _ in mine.named_modules()] == [n for n, _ in theirs.named_modules()]
    assert not _storages(model) & _storages(*_prepared_modules(gm))
    # training the prepared model leaves the user's model as it was
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        gm(x).float().sum().backward()
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class AliasAttribute(nn.Module):
    """Holds its conv's weight in a plain attribute too: borrowing would miss that alias."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.kept = [self.conv.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_a_model_keeping_a_tensor_in_a_plain_attribute_or_a_graph_module_is_copied_whole() -> None:
    copied, borrowed = borrowing_copy(AliasAttribute())
    assert borrowed is None
    assert isinstance(copied, AliasAttribute)
    view = nn.Conv2d(3, 3, 1)
    view.__dict__["row"] = view.weight.detach()[0]  # a view of the weight's storage
    assert borrowing_copy(view)[1] is None
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 3, 1)))
    assert borrowing_copy(gm)[1] is None


def test_owning_copies_each_borrowed_tensor_once_keeping_ties() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].weight = model[0].weight
    copied, borrowed = borrowing_copy(model)
    assert borrowed is not None
    assert copied[0].weight is model[0].weight and copied[2].running_mean is model[2].running_mean
    borrowed.own_module(copied)
    assert copied[0].weight is copied[1].weight  # still tied, to one copy
    assert isinstance(copied[0].weight, nn.Parameter) and copied[0].weight.requires_grad
    assert not _storages(model) & _storages(copied)
    for (k, v), w in zip(model.state_dict().items(), copied.state_dict().values(), strict=True):
        assert torch.equal(v, w), k


def test_an_in_place_write_into_a_borrowed_tensor_is_refused_by_name() -> None:
    model = nn.Conv2d(3, 3, 1)
    _, borrowed = borrowing_copy(model)
    assert isinstance(borrowed, Borrowed)
    borrowed.check_untouched()
    with torch.no_grad():
        model.weight.mul_(2)
    with pytest.raises(RuntimeError, match=r"model's tensor 'weight' in place"):
        borrowed.check_untouched()


class NoFormula(nn.Module):
    """A layer the shape formulas do not cover (``torch.cumsum``): prepare types it by a run."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.conv(self.quant(x)).cumsum(1))


def test_the_typing_run_computes_with_owned_tensors() -> None:
    """Before the traced graph runs on real tensors, the copy owns them all."""
    from qir.quantization import fx_trace

    model = NoFormula()
    copied, borrowed = borrowing_copy(model)
    assert borrowed is not None
    seen: list[bool] = []

    def own() -> None:
        borrowed.own_module(copied)
        seen.append(True)

    g, _ = fx_trace.build_ir(copied, torch.randn(1, 3, 4, 4), before_run=own)
    assert seen == [True]
    assert not _storages(model) & {t.untyped_storage().data_ptr() for t in g.constants.values()}
    # graphs the formulas cover never run: nothing is owned before fusion
    copied2, _ = borrowing_copy(nn.Sequential(nn.Conv2d(3, 4, 1)))
    fx_trace.build_ir(copied2, torch.randn(1, 3, 4, 4), before_run=lambda: seen.append(False))
    assert seen == [True]


class FloatConvInWrap(nn.Module):
    """A wrapped method of the root calling a conv that stays float (qconfig None): the prepared
    model runs the method on prepare's copy of the root, whose conv must hold its own tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.post_conv = nn.Conv2d(8, 4, 1)

    @wrap()
    def post(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_conv(x).flatten(1).topk(5, dim=1)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.bn(self.conv(self.quant(x))))


def _wrapped_owners(gm: torch.fx.GraphModule) -> list[nn.Module]:
    """The modules the graph's wrapped-method calls run on."""
    return [
        n.target.__self__
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, types.MethodType)
        and isinstance(n.target.__self__, nn.Module)
    ]


@pytest.mark.parametrize("typed_by_run", [True, False])
def test_a_wrapped_method_runs_on_modules_holding_their_own_tensors(typed_by_run: bool) -> None:
    """With example inputs the wrapped call is typed by a run (the copy owns everything first);
    without, the call's module owns its tensors when fusion is done."""
    qir.set_march("bayes")
    torch.manual_seed(0)
    model, x = FloatConvInWrap().train(), torch.randn(2, 3, 8, 8)
    before = _snapshot(model)
    qconfig = {"": get_default_qat_qconfig(), "module_name": [("post_conv", None)]}
    gm = prepare_qat_fx(model, qconfig, x if typed_by_run else None)
    owners = _wrapped_owners(gm)
    assert owners and any(isinstance(m.get_submodule("post_conv"), nn.Conv2d) for m in owners)
    assert not _storages(model) & _storages(*_prepared_modules(gm), *owners)
    opt = torch.optim.SGD([p for m in (gm, *owners) for p in m.parameters()], lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        gm(x).float().sum().backward()
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
