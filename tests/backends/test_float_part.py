"""The program's CPU float part: float pre- and post-processing around the quantized layers compile
to ``float_fn`` instructions that call the same torch functions as the converted model (bit for bit,
saved and loaded), and an artifact can only name functions on the allowlist."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from artifact_forge import assemble
from bitexact_models import fx_converted
from torch import nn

import qir
from backends.common.artifact import ArtifactError
from backends.common.kernels.float_ops import FLOAT_FUNCTIONS
from qir.quantization import DeQuantStub, QuantStub, compile_model


class CenterNetDecode(nn.Module):
    """Normalization before the QuantStub; a CenterNet-style decode after the DeQuantStub: sigmoid
    heatmap, a 3x3 max-pool peak test, topk over the flattened map, positions from the int64 indices
    (``idx // w``, ``idx % w``), the size read at the peaks with ``gather``."""

    def __init__(self, k: int = 4) -> None:
        super().__init__()
        self.k = k
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = (x - 0.5) / 0.25
        out = self.dequant(self.body(self.quant(x)))
        heat = out[:, :1].sigmoid()
        peaks = (heat == nn.functional.max_pool2d(heat, 3, 1, 1)).float() * heat
        b, _, _, w = heat.shape
        scores, idx = peaks.flatten(1).topk(self.k, dim=1)
        ys = torch.div(idx, w, rounding_mode="floor").float()
        xs = (idx % w).float()
        size = out[:, 1:].flatten(2).gather(2, idx.unsqueeze(1).expand(b, 2, self.k)).exp()
        return scores, torch.stack([xs, ys], -1), size


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    converted = fx_converted(CenterNetDecode().eval(), (2, 3, 8, 8), "bayes")
    path = tmp_path_factory.mktemp("float") / "centernet.hbm"
    compile_model(converted, [torch.rand(2, 3, 8, 8)], hbm=path, march="bayes")
    return path, converted


def test_the_float_part_runs_the_models_torch_functions_bit_for_bit(compiled: tuple[Path, nn.Module]) -> None:
    path, converted = compiled
    run = qir.load_compiled(path)
    fns = [i.attrs["fn"] for i in run.program.instructions if i.op == "float_fn"]
    assert {"operator.sub", "operator.truediv", "torch.sigmoid", "torch.topk", "torch.div", "operator.mod"} <= set(fns)
    assert all(fn in FLOAT_FUNCTIONS for fn in fns)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.rand(2, 3, 8, 8, generator=g)
        with torch.no_grad():
            got, want = run(x), converted(x)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert got[1].dtype == torch.float32 and got[0].shape == (2, 4)


def _forged(path: Path, tmp_path: Path, edit: Any) -> Path:
    data = path.read_bytes()
    _, _, hlen = struct.unpack_from("<8sIQ", data, 0)
    header = json.loads(data[20 : 20 + hlen])
    start = 20 + hlen + (-(20 + hlen)) % 64
    edit(header)
    out = tmp_path / "forged.hbm"
    out.write_bytes(assemble(json.dumps(header).encode(), data[start:-32]))
    return out


def _float_fn(header: dict[str, Any], fn: str) -> dict[str, Any]:
    return next(d for d in header["program"]["instructions"] if d["op"] == "float_fn" and d["attrs"]["fn"] == fn)


def test_a_function_off_the_allowlist_is_refused_at_load(compiled: tuple[Path, nn.Module], tmp_path: Path) -> None:
    def edit(h: dict[str, Any]) -> None:
        _float_fn(h, "torch.sigmoid")["attrs"]["fn"] = "builtins.eval"

    with pytest.raises(ArtifactError, match=r"attrs\.fn: 'builtins\.eval' is not one of"):
        qir.load_compiled(_forged(compiled[0], tmp_path, edit))


def test_codes_fed_to_the_float_part_are_refused_at_load(compiled: tuple[Path, nn.Module], tmp_path: Path) -> None:
    def edit(h: dict[str, Any]) -> None:
        ins = h["program"]["instructions"]
        codes = next(d for d in ins if d["op"] == "conv2d")["outputs"][0]
        target = _float_fn(h, "torch.sigmoid")
        target["attrs"]["args"] = [{"$v": codes}]
        target["inputs"] = [codes]

    with pytest.raises(ArtifactError, match=r"torch\.sigmoid: a torch\.int8 operand; the float part takes float32"):
        qir.load_compiled(_forged(compiled[0], tmp_path, edit))


def test_misfit_operands_are_refused_at_load(compiled: tuple[Path, nn.Module], tmp_path: Path) -> None:
    def edit(h: dict[str, Any]) -> None:
        _float_fn(h, "torch.topk")["attrs"]["args"][1] = 10_000  # more than the map has

    with pytest.raises(ArtifactError, match=r"float_fn for 'topk'.*do not fit"):
        qir.load_compiled(_forged(compiled[0], tmp_path, edit))
