"""A QAT conv / linear's ``from_float`` builds it from a meta prototype and skips the random
initialization's draws instead of making them (qir/nn/qat/conv.py ``_built_without_init_draw``):
the module, every tensor bit, ``requires_grad``, the repr and the global random stream after it
are the constructor's (the oracle: ``from_float`` with the constructor and the copies)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from nn_cases import CONV_CASES, Case
from nn_helpers import QC8, storages
from torch import nn

import qir.nn.qat.conv as conv_module
from qir.nn import QAT_MODULE_MAP
from tests.quantization.init_draws_helpers import assert_same_module, constructor_path


def _built(make: Callable[[], nn.Module], oracle: bool) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    fl = make()
    torch.manual_seed(1)
    torch.rand(3)  # part-way through a block of the generator
    with constructor_path() if oracle else contextlib.nullcontext():
        qat = QAT_MODULE_MAP[type(fl)].from_float(fl, QC8)  # type: ignore[attr-defined]
    return fl, qat, torch.rand(6)


def _check(make: Callable[[], nn.Module]) -> None:
    fl, mine, after = _built(make, oracle=False)
    _, theirs, oracle_after = _built(make, oracle=True)
    assert_same_module(mine, theirs)
    assert torch.equal(after, oracle_after), "the random stream after from_float differs"
    assert not storages(fl) & storages(mine), "the QAT module shares a tensor with the float module"


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: c.name)
def test_every_qat_conv_class_equals_the_constructor_path(case: Case) -> None:
    _check(case.make)


def _frozen_bias() -> nn.Module:
    conv = nn.Conv2d(4, 6, 3, bias=True)
    conv.bias.requires_grad_(False)
    return conv


def _channels_last() -> nn.Module:
    conv = nn.Conv2d(3, 8, 3)
    conv.weight = nn.Parameter(conv.weight.detach().to(memory_format=torch.channels_last))
    return conv


def _eval_mode() -> nn.Module:
    return nn.Linear(7, 3).eval()


FLOATS: dict[str, Callable[[], nn.Module]] = {
    "no bias": lambda: nn.Conv2d(3, 5, 3, bias=False),
    "groups, dilation, reflect": lambda: nn.Conv2d(4, 8, 3, groups=2, dilation=2, padding=2, padding_mode="reflect"),
    "padding same": lambda: nn.Conv2d(3, 4, (3, 5), padding="same"),
    "conv1d float64": lambda: nn.Conv1d(2, 3, 3, dtype=torch.float64),
    "linear float64 no bias": lambda: nn.Linear(5, 2, bias=False, dtype=torch.float64),
    "linear bfloat16": lambda: nn.Linear(9, 4, dtype=torch.bfloat16),
    "conv transpose float16": lambda: nn.ConvTranspose2d(4, 2, 3, stride=2, dtype=torch.float16),
    "frozen bias": _frozen_bias,
    "frozen weight": lambda: nn.Linear(4, 4).requires_grad_(False),
    "channels-last weight": _channels_last,
    "eval mode": _eval_mode,
    "meta device": lambda: nn.Conv2d(3, 4, 3, device="meta"),
    "zero in features": lambda: nn.Linear(0, 3),
}


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("name", list(FLOATS))
def test_layers_dtypes_and_flags_equal_the_constructor_path(name: str) -> None:
    if name == "meta device":
        _, mine, after = _built(FLOATS[name], oracle=False)
        _, theirs, oracle_after = _built(FLOATS[name], oracle=True)
        assert repr(mine) == repr(theirs) and mine.weight.is_meta and torch.equal(after, oracle_after)
        return
    _check(FLOATS[name])


def test_a_replaced_reset_parameters_takes_the_constructor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library that initializes convs its own way draws what it draws: the constructor runs."""

    def reset_normal(self: Any) -> None:
        nn.init.normal_(self.weight)
        nn.init.normal_(self.bias)

    monkeypatch.setattr(nn.Conv2d, "reset_parameters", reset_normal)
    calls: list[object] = []
    real = conv_module.skip_uniform_draws
    monkeypatch.setattr(conv_module, "skip_uniform_draws", lambda *a, **k: calls.append(a) or real(*a, **k))
    _check(lambda: nn.Conv2d(3, 4, 3))
    assert not calls


def test_the_weight_is_copied_once_and_contiguous() -> None:
    fl = _channels_last()
    qat = QAT_MODULE_MAP[nn.Conv2d].from_float(fl, QC8)  # type: ignore[attr-defined]
    assert qat.weight.is_contiguous() and isinstance(qat.weight, nn.Parameter)
    assert qat.weight.untyped_storage().nbytes() == qat.weight.numel() * 4
