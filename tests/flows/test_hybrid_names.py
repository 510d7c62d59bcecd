"""A hybrid model's CPU modules without an IR op are traced inline to compile them; the program's
steps, perf_model's layers and visualize_model's boxes keep the module paths the user wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hybrid_models import HybridModel
from test_hybrid import SHAPE, frozen, seed_flow
from torch import nn

import qir
from qir.march import march_scope
from qir.quantization import (
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    perf_model,
    prepare_qat_fx,
    set_fake_quantize,
    visualize_model,
)

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")


@pytest.fixture(scope="module")
def seed_converted() -> torch.fx.GraphModule:
    with march_scope("bayes"):
        _, qat_model = seed_flow(HybridModel())
        return convert_fx(frozen(qat_model))


def test_seed_003_selu_calls_are_named_for_the_module(seed_converted: torch.fx.GraphModule, tmp_path: Path) -> None:
    data = torch.rand(SHAPE)
    path = tmp_path / "hybrid.hbm"
    compile_model(seed_converted, [data], hbm=path)
    steps = [(i.source, i.attrs["fn"]) for i in qir.load_compiled(path).program.instructions if i.op == "float_fn"]
    # the module 'selu' called three times: its calls, not fx's names for the inlined F.selu (selu_3 ...)
    assert steps == [
        ("selu", "F.selu"),
        ("selu_1", "F.selu"),
        ("layer1_conv", "F.conv2d"),
        ("conv0", "F.conv2d"),
        ("selu_2", "F.selu"),
    ]
    prof = perf_model(seed_converted, [data], out_dir=tmp_path)
    rows = {la.name: la.module for la in prof.layers if la.unit == "CPU"}
    assert rows == {"selu": "selu", "selu_1": "selu", "selu_2": "selu", "layer1_conv": "layer1.conv", "conv0": "conv0"}
    svg = visualize_model(seed_converted, [data], save_path=tmp_path / "m.svg", check=False).read_text()
    for layer in ("selu", "selu_1", "selu_2"):
        assert f"(layer {layer}, module selu _SeluModule)" in svg


class _Act(nn.Module):
    """A CPU activation with several calls in its forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.selu(x) * 0.5 + 1.0


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.act = _Act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.head = _Head()
        self.out = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.head(self.stem(x)))


def test_nested_cpu_module_with_several_calls(tmp_path: Path) -> None:
    x = torch.rand(2, 3, 8, 8)
    with march_scope("bayes"):
        qat = prepare_qat_fx(_Net(), {"": get_default_qat_qconfig()}, hybrid=True, hybrid_dict={"module_type": [_Act]})
        qat(x)
        qat.eval()
        set_fake_quantize(qat, "validation")
        quantized = convert_fx(qat)
        compiled = compile_model(quantized, [x])
        prof = perf_model(quantized, [x], out_dir=tmp_path)
        svg = visualize_model(quantized, [x], save_path=tmp_path / "m.svg", check=False).read_text()
    assert torch.equal(compiled(x), quantized(x))
    inlined = [i.source for i in compiled.program.instructions if i.op == "float_fn"]
    assert inlined == ["head_act_selu", "head_act_mul", "head_act_add"]
    modules = {la.name: la.module for la in prof.layers}
    assert [modules[k] for k in inlined] == ["head.act.selu", "head.act.mul", "head.act.add"]
    assert "(layer head_act_mul, module head.act.mul _Act)" in svg
    assert quantized.graph.find_nodes(op="call_module", target="head.act")  # the user's model is not changed
