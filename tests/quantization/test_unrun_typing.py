"""convert_fx of a QAT model that never ran and got no example inputs (a checkpoint flow): its IR is
typed with unknown batch and image sizes and converts by the quantize pass, bit-equal to module
swapping; what needs a real size converts by module swapping, saying which node and why."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qir
from qir.nn.quantized import QUANTIZED_MODULE_MAP
from qir.quantization import DeQuantStub, QuantStub, convert_fx, get_default_qat_qconfig, prepare_qat_fx
from qir.quantization.convert import CONVERT_PATH_KEY, _qat_ir
from qir.quantization.unrun_typing import input_types


class FPN(nn.Module):
    """Two strided stages, a top-down add, a channel chunk, a global pool and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.c1 = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.c2 = nn.Sequential(nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU())
        self.lateral = nn.Conv2d(8, 16, 1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c1 = self.c1(self.quant(x))
        p = self.lateral(c1) + self.up(self.c2(c1))
        a, b = p.chunk(2, dim=1)  # along the channels, which the convs make known
        y = torch.cat([a, b], dim=2)
        return self.dequant(self.fc(torch.flatten(self.pool(y), 1)))


class SpatialChunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, bottom = self.conv(self.quant(x)).chunk(2, dim=2)
        return self.dequant(top), self.dequant(bottom)


class FlatHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, 2, 1)
        self.fc = nn.Linear(4 * 8 * 8, 5)  # reads the flattened 8x8 map: the image must be 16x16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc(self.conv(self.quant(x)).view(x.shape[0], -1)))


def _trained(model: nn.Module, march: str) -> nn.Module:
    """A checkpoint flow: QAT trained in one place, loaded strictly into a fresh prepared model that never ran."""
    torch.manual_seed(0)
    qir.set_march(march)
    qat = prepare_qat_fx(copy.deepcopy(model), {"": get_default_qat_qconfig()})
    for _ in range(3):
        qat(torch.randn(2, 3, 16, 16) * 2)
    fresh = prepare_qat_fx(model, {"": get_default_qat_qconfig()})
    fresh.load_state_dict(qat.state_dict(), strict=True)
    return fresh.eval()


def _outputs_equal(a: nn.Module, b: nn.Module, x: torch.Tensor) -> bool:
    ya, yb = a(x), b(x)
    pairs = zip(ya, yb, strict=True) if isinstance(ya, tuple) else [(ya, yb)]
    return all(p.dtype == q.dtype and torch.equal(p, q) for p, q in pairs)


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_a_model_that_never_ran_converts_by_the_pass_equal_to_module_swap(march: str) -> None:
    qat = _trained(FPN(), march)
    graph, why = _qat_ir(qat, None, None)
    assert why == "" and str(graph.inputs[0].type) == "tensor<?x3x?x?xf32>"
    chunk = next(n for n in graph.nodes if n.op.name == "chunk")
    assert str(chunk.type) == "tuple<tensor<?x8x?x?xf32>,tensor<?x8x?x?xf32>>"
    assert str(next(n for n in graph.nodes if n.op.name == "flatten").type) == "tensor<?x8xf32>"
    by_pass = convert_fx(qat)
    assert by_pass.meta[CONVERT_PATH_KEY] == "quantize pass"
    swapped = convert_fx(qat, mapping=dict(QUANTIZED_MODULE_MAP))
    assert swapped.meta[CONVERT_PATH_KEY].startswith("module swap")
    sa, sb = by_pass.state_dict(), swapped.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)
    for shape in ((1, 3, 16, 16), (3, 3, 32, 24)):  # any size the model runs at
        assert _outputs_equal(by_pass, swapped, torch.randn(shape) * 2)


def test_a_chunk_along_an_unknown_size_converts_by_module_swap_saying_so() -> None:
    qat = _trained(SpatialChunk(), "bayes")
    out = convert_fx(qat)
    why = out.meta[CONVERT_PATH_KEY]
    assert why.startswith("module swap: without example inputs the model cannot be typed")
    assert "chunk(2) along dim 2 of unknown size" in why and "give example_inputs" in why
    x = torch.randn(2, 3, 8, 8)
    assert _outputs_equal(out, convert_fx(qat, example_inputs=x), x)  # the swap is the same model


def test_a_layer_that_needs_the_image_size_converts_by_module_swap_saying_so() -> None:
    qat = _trained(FlatHead(), "bayes")
    out = convert_fx(qat)
    why = out.meta[CONVERT_PATH_KEY]
    assert "without example inputs the model was typed at the input sizes tensor<2x3x64x64xf32>" in why
    assert "give example_inputs" in why
    x = torch.randn(2, 3, 16, 16)
    by_pass = convert_fx(qat, example_inputs=x)
    assert by_pass.meta[CONVERT_PATH_KEY] == "quantize pass" and _outputs_equal(out, by_pass, x)


def test_input_types_come_from_the_first_layers() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = nn.Conv1d(5, 2, 3), nn.Linear(6, 2)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.conv(x), self.fc(y)

    gm = torch.fx.symbolic_trace(TwoInputs())
    types, why = input_types(gm)
    assert why == "" and types is not None and [str(t) for t in types] == ["tensor<?x5x?xf32>", "tensor<?x6xf32>"]

    class Unread(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x)

    types, why = input_types(torch.fx.symbolic_trace(Unread()))
    assert types is None
    assert why == (
        "the rank of input 'x' is not known without example inputs: it reaches no conv / linear layer "
        "through quant stubs only (read by %relu)"
    )
