"""Wrap a float model that has no QuantStub so that the quantization flow can take it."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from qir.quantization.stubs import DeQuantStub, QuantStub


def _is_tensor(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, torch.fx.Proxy))


class Stubbed(nn.Module):
    """``dequant_j(model(quant_i(x_i)))``: a QuantStub per input, a DeQuantStub per tensor output.

    One stub per call site: a converted stub has fixed input scales, and outputs differ.
    """

    def __init__(self, model: nn.Module, num_inputs: int, num_outputs: int) -> None:
        super().__init__()
        self.quant = nn.ModuleList(QuantStub() for _ in range(num_inputs))
        self.model = model
        self.dequant = nn.ModuleList(DeQuantStub() for _ in range(num_outputs))

    def body(self, xs: list[Any]) -> Any:
        out = self.model(*[q(x) for q, x in zip(self.quant, xs, strict=True)])
        # outputs may be a tensor or nested tuples / lists / dicts of them (traced: fx Proxies)
        leaves, spec = pytree.tree_flatten(out)
        stubs = iter(self.dequant)
        return pytree.tree_unflatten([next(stubs)(v) if _is_tensor(v) else v for v in leaves], spec)


def _stubbed_class(num_inputs: int) -> type[Stubbed]:
    # fx traces a forward by its signature and cannot unpack *args: one named argument per input.
    names = ", ".join(f"input{i}" for i in range(num_inputs))
    scope: dict[str, Any] = {}
    exec(f"def forward(self, {names}):\n    return self.body([{names}])\n", scope)
    return type(f"Stubbed{num_inputs}", (Stubbed,), {"forward": scope["forward"]})


def has_stubs(model: nn.Module) -> bool:
    kinds = (QuantStub, torch.ao.quantization.QuantStub)
    return any(isinstance(m, kinds) for m in model.modules())


def add_stubs_if_missing(model: nn.Module, example_output: Any, num_inputs: int) -> tuple[nn.Module, bool]:
    """``model`` itself when it has a QuantStub, else wrapped (``example_output`` counts the outputs)."""
    if has_stubs(model):
        return model, False
    num_outputs = sum(1 for v in pytree.tree_leaves(example_output) if _is_tensor(v))
    return _stubbed_class(num_inputs)(model, num_inputs, num_outputs).eval(), True
