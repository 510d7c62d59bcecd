"""qir.quantization.graph_pickle: ``torch.save`` / ``torch.load`` of a prepared model keeps its
backward hooks (full and pre), which fx's loader drops with the rest of ``nn.Module``'s hook tables."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

import qir
from qir.quantization import DeQuantStub, QATGraphModule, QuantStub, get_default_qat_qconfig, prepare_qat_fx

SEEN: list[str] = []


def _after(module: nn.Module, grad_in: Any, grad_out: Any) -> None:
    SEEN.append("backward")


def _before(module: nn.Module, grad_out: Any) -> None:
    SEEN.append("backward_pre")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.conv(self.quant(x)))


def test_a_prepared_model_with_backward_hooks_pickles_and_keeps_them() -> None:
    qir.set_march("bayes")  # the conftest fixture restores it
    x = torch.randn(2, 3, 8, 8)
    qat = prepare_qat_fx(_Net(), {"": get_default_qat_qconfig()}, x)
    qat.register_full_backward_pre_hook(_before)
    qat.register_full_backward_hook(_after)
    buf = io.BytesIO()
    torch.save(qat, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded, QATGraphModule)
    assert list(loaded._backward_pre_hooks.values()) == [_before]
    assert list(loaded._backward_hooks.values()) == [_after]
    assert loaded._is_full_backward_hook is True
    SEEN.clear()
    loaded.train()
    loaded(x.requires_grad_()).sum().backward()
    assert SEEN == ["backward_pre", "backward"]
