"""prepare_qat_fx and eager prepare_qat with the QAT convs' random initialization skipped equal
them with it drawn (the constructor path of ``from_float``): state-dict keys and bits,
``requires_grad``, module tree and repr, generated code, the random stream after prepare."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

import qir
from qir.quantization import fuse_known_modules, get_default_qat_qconfig, prepare_qat, prepare_qat_fx
from tests.quantization.init_draws_helpers import assert_same_module, constructor_path
from tests.quantization.test_prepare_paths import MobileNetShaped, ResNetShaped, _module_swap, _qconfig


def _prepared(net: type[nn.Module], march: str, oracle: bool, swap: bool) -> tuple[nn.Module, torch.Tensor]:
    qir.set_march(march)
    torch.manual_seed(0)
    model = net()
    x = torch.randn(2, 3, 16, 16)
    torch.manual_seed(7)
    with (
        constructor_path() if oracle else contextlib.nullcontext(),
        _module_swap() if swap else contextlib.nullcontext(),
    ):
        gm = prepare_qat_fx(model, _qconfig(net, False, march), x)
    return gm, torch.rand(8)


@pytest.mark.parametrize("swap", [False, True], ids=["pass", "module-swap"])
@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize("net", [ResNetShaped, MobileNetShaped])
def test_prepare_qat_fx_equals_the_constructor_path(net: type[nn.Module], march: str, swap: bool) -> None:
    mine, after = _prepared(net, march, oracle=False, swap=swap)
    theirs, oracle_after = _prepared(net, march, oracle=True, swap=swap)
    assert torch.equal(after, oracle_after)
    sd, osd = mine.state_dict(), theirs.state_dict()
    assert list(sd) == list(osd)
    assert all(sd[k].dtype == osd[k].dtype and torch.equal(sd[k], osd[k]) for k in sd)
    assert mine.code == theirs.code and repr(mine) == repr(theirs)
    for (_, a), (_, b) in zip(mine.named_children(), theirs.named_children(), strict=True):
        assert_same_module(a, b)


def _eager_net() -> nn.Module:
    net = nn.Sequential(
        qir.quantization.QuantStub(),
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 4),
        qir.quantization.DeQuantStub(),
    )
    torch.ao.quantization.fuse_modules(net, [["1", "2", "3"]], inplace=True, fuser_func=fuse_known_modules)
    net.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    return net


def test_eager_prepare_qat_equals_the_constructor_path() -> None:
    qir.set_march("bayes")
    made: list[tuple[Any, torch.Tensor]] = []
    for oracle in (False, True):
        torch.manual_seed(0)
        net = _eager_net()
        torch.manual_seed(7)
        with constructor_path() if oracle else contextlib.nullcontext():
            made.append((prepare_qat(net), torch.rand(8)))
    (mine, after), (theirs, oracle_after) = made
    assert torch.equal(after, oracle_after)
    assert_same_module(mine, theirs)
