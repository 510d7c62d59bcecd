"""Wrap a float model that has no QuantStub so that the quantization flow can take it."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from qir.quantization.stubs import DeQuantStub, QuantStub


class Stubbed(nn.Module):
    """``dequant(model(quant_i(x_i)))``: a QuantStub per input, DeQuantStub on every tensor output."""

    def __init__(self, model: nn.Module, num_inputs: int) -> None:
        super().__init__()
        self.quant = nn.ModuleList(QuantStub() for _ in range(num_inputs))
        self.model = model
        self.dequant = DeQuantStub()

    def body(self, xs: list[Any]) -> Any:
        out = self.model(*[q(x) for q, x in zip(self.quant, xs, strict=True)])
        # outputs may be a tensor or nested tuples / lists / dicts of them (traced: fx Proxies)
        return pytree.tree_map(lambda v: self.dequant(v) if isinstance(v, (torch.Tensor, torch.fx.Proxy)) else v, out)


def _stubbed_class(num_inputs: int) -> type[Stubbed]:
    # fx traces a forward by its signature and cannot unpack *args: one named argument per input.
    names = ", ".join(f"input{i}" for i in range(num_inputs))
    scope: dict[str, Any] = {}
    exec(f"def forward(self, {names}):\n    return self.body([{names}])\n", scope)
    return type(f"Stubbed{num_inputs}", (Stubbed,), {"forward": scope["forward"]})


def has_stubs(model: nn.Module) -> bool:
    kinds = (QuantStub, torch.ao.quantization.QuantStub)
    return any(isinstance(m, kinds) for m in model.modules())


def add_stubs_if_missing(model: nn.Module, num_inputs: int) -> tuple[nn.Module, bool]:
    if has_stubs(model):
        return model, False
    return _stubbed_class(num_inputs)(model, num_inputs).eval(), True
