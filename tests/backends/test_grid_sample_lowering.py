"""F.grid_sample through the whole flow: prepare generates qir.nn.GridSample, QAT, convert,
check_model (Bayes accepts, Bernoulli2 refuses), compile; the compiled program and its
artifact equal the converted model bit for bit."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

import qir
from backends.common import numerics
from qir.march import march_scope
from qir.nn import qat, quantized
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")

QC = get_default_qat_qconfig()
QC16 = get_default_qat_qconfig(dtype="qint16")


class Net(nn.Module):
    def __init__(self, mode: str = "bilinear", pad: str = "zeros", ac: bool = False) -> None:
        super().__init__()
        self.quant, self.grid_quant = QuantStub(), QuantStub()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 1)
        self.mode, self.pad, self.ac = mode, pad, ac
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        y = F.grid_sample(
            self.c1(self.quant(x)), self.grid_quant(grid), mode=self.mode, padding_mode=self.pad, align_corners=self.ac
        )
        return self.dequant(self.c2(y))


def _inputs(seed: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 10, generator=g), torch.rand(n, 5, 7, 2, generator=g) * 2.4 - 1.2


def _flow(net: Net, grid_qc: object, march: str = "bayes") -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    torch.manual_seed(0)
    with march_scope(march):
        prepared = prepare_qat_fx(net, {"": QC, "module_name": {"grid_quant": grid_qc}})
        opt = torch.optim.SGD(prepared.parameters(), lr=1e-3)
        for seed in range(3):
            opt.zero_grad()
            prepared(*_inputs(seed)).square().mean().backward()
            opt.step()
        set_fake_quantize(prepared, "validation")
        return prepared.eval(), convert_fx(prepared.eval())


CASES = list(itertools.product(["bilinear", "nearest"], ["zeros", "border"], [False, True]))


@pytest.mark.parametrize(("mode", "pad", "ac"), CASES)
def test_prepare_generates_the_module_and_convert_is_within_bound(mode: str, pad: str, ac: bool) -> None:
    prepared, converted = _flow(Net(mode, pad, ac), QC16)
    gen = prepared.get_submodule("_generated_grid_sample_0")
    assert isinstance(gen, qat.GridSample) and (gen.mode, gen.padding_mode, gen.align_corners) == (mode, pad, ac)
    qm = converted.get_submodule("_generated_grid_sample_0")
    assert isinstance(qm, quantized.GridSample)
    seen: dict[str, torch.Tensor] = {}
    qm.register_forward_hook(lambda m, a, out: seen.update(x=a[0], g=a[1], y=out))
    with torch.no_grad():
        converted(*_inputs(7))
        ref = gen(numerics.dequantize(seen["x"], qm.input_scale_0), numerics.dequantize(seen["g"], qm.input_scale_1))
    assert seen["g"].dtype == torch.int16
    want = numerics.quantize(ref, qm.scale, "qint8")
    assert int((seen["y"].to(torch.int64) - want.to(torch.int64)).abs().max()) <= (0 if mode == "nearest" else 1)


@pytest.mark.parametrize(("mode", "pad", "ac"), CASES)
@pytest.mark.parametrize("grid_qc", [QC, QC16], ids=["grid8", "grid16"])
def test_compiled_and_artifact_bitexact(tmp_path: Path, mode: str, pad: str, ac: bool, grid_qc: object) -> None:
    _, converted = _flow(Net(mode, pad, ac), grid_qc)
    path = tmp_path / "gs.hbm"
    compiled = compile_model(converted, list(_inputs(0, 2)), hbm=path, opt=1)
    assert "grid_sample" in {i.op for i in compiled.program.instructions}
    loaded = qir.load_compiled(path)
    with torch.no_grad():
        for seed in (10, 11):
            x, g = _inputs(seed)
            want = converted(x, g)
            assert torch.equal(compiled(x, g), want) and torch.equal(loaded(x, g), want)


def test_check_model_verdicts() -> None:
    prepared, converted = _flow(Net(), QC16)
    ins = _inputs(0, 1)
    assert check_model(converted, ins, march="bayes").ok
    assert check_model(prepared, ins, march="bayes").ok
    report = check_model(Net(), ins, march="bernoulli2")
    assert [(v.kind, v.spelling) for v in report.violations] == [("unsupported", "torch.nn.functional.grid_sample")]
    big = check_model(converted, (torch.randn(1, 3, 8, 1100), ins[1]), march="bayes")
    assert [v.rule for v in big.violations] == ["1≤H, W≤1024"]


def test_unsupported_padding_stays_functional() -> None:
    with march_scope("bayes"):
        prepared = prepare_qat_fx(Net("bilinear", "reflection"), {"": QC})
    assert not any(isinstance(m, qat.GridSample) for m in prepared.modules())
