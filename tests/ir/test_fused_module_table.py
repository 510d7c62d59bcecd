"""Fused conv / linear ops build their module from the table qir.nn.intrinsic fills (the IR imports no qir.nn)."""

from __future__ import annotations

import pytest
import torch

import qir.ir.ops.nn as nn_ops
from qir.ir.op import IRError


def tensors() -> dict[str, torch.Tensor]:
    return {"weight": torch.zeros(4, 3, 3, 3), "bias": torch.zeros(4)}


def test_fused_op_builds_the_registered_class() -> None:
    import qir.nn.intrinsic as nni

    m = nn_ops.Conv2d(act="relu").to_module(tensors())
    assert type(m) is nni.ConvReLU2d
    assert type(nn_ops.Conv2d().to_module(tensors())) is torch.nn.Conv2d


def test_unregistered_fused_class_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nn_ops, "FUSED_MODULE_CLASSES", {})
    with pytest.raises(IRError, match=r"Conv2d with add=True act='relu6'.*qir\.nn\.intrinsic"):
        nn_ops.Conv2d(add=True, act="relu6").to_module(tensors())
