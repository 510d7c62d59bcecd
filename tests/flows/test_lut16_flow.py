"""qint16 table lookups end to end: prepare -> calibrate -> QAT -> convert -> IR -> compile -> artifact.

A table-lookup op fed by a qint16 producer converts to ``qlut`` with its segmented table
(``table16``), lowers to the ``lut16`` kernel, and the QAT model in validation state, the
converted model, the IR interpreter and the loaded artifact give the same codes; the march
tables allow it on Bayes and refuse it on Bernoulli2, as the seeds' operator tables do.
"""

from __future__ import annotations

import copy
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import qir.nn as qnn
from backends.common.artifact import MAGIC, ArtifactError
from qir.frontend import trace
from qir.ir import parse_graph, print_graph, run_graph
from qir.march import march_scope
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    load_compiled,
    prepare_qat_fx,
    set_fake_quantize,
)

FUNCTIONS = {
    "Sigmoid": nn.Sigmoid,
    "Tanh": nn.Tanh,
    "Hardsigmoid": nn.Hardsigmoid,
    "Hardswish": nn.Hardswish,
    "SiLU": nn.SiLU,
    "GELU": nn.GELU,
    "Exp": qnn.Exp,
}


class _Net(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = act
        self.conv2 = nn.Conv2d(4, 2, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.conv2(self.act(self.conv(self.quant(x)))))


def _qconfig(out16: bool) -> dict[str, object]:
    q16 = get_default_qat_qconfig(dtype="qint16")
    names = {"conv": q16, "act": q16} if out16 else {"conv": q16}
    return {"": get_default_qat_qconfig(), "module_name": names}


def _trained(fn: str, out16: bool) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    with march_scope("bayes"):
        m = prepare_qat_fx(_Net(FUNCTIONS[fn]()).eval(), _qconfig(out16))
        set_fake_quantize(m, "calibration")
        for i in range(3):
            m(x * (1 + i / 2))
        set_fake_quantize(m, "qat")
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        for _ in range(2):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        m.eval()
        set_fake_quantize(m, "validation")
    return m, x


@pytest.mark.parametrize("out16", [False, True], ids=["out8", "out16"])
@pytest.mark.parametrize("fn", list(FUNCTIONS))
def test_validation_converted_ir_and_artifact_agree(fn: str, out16: bool, tmp_path: Path) -> None:
    m, x = _trained(fn, out16)
    with march_scope("bayes"):
        conv = convert_fx(m)
    g = trace(conv, x)
    (lut,) = [n for n in g.nodes if n.op.name == "qlut"]
    assert lut.operands[0].type.dtype.name in ("qint16", "int16")
    assert lut.op.out.dtype.name == ("qint16" if out16 else "qint8")
    knots = lut.operands[2].type.shape
    assert lut.op.table16_version == 2 and knots[0] == 2 and 2 <= knots[1] <= 513
    assert "table16_version=2" in print_graph(g)
    text = print_graph(g)
    g2 = parse_graph(text, constants=g.constants, objects=g.objects)
    assert print_graph(g2) == text
    assert not check_model(conv, x, march="bayes").violations
    compile_model(conv, x, hbm=tmp_path / "m.hbm")
    loaded = load_compiled(tmp_path / "m.hbm")
    (lut16,) = [i for i in loaded.program.instructions if i.op == "lut16"]
    assert lut16.attrs["version"] == 2
    for scale in (1.0, 3.0):  # the second saturates the qint16 producer
        xi = x * scale
        want = conv(xi)
        with torch.no_grad():
            assert torch.equal(m(xi), want)
        assert torch.equal(run_graph(g2, xi), want)
        assert torch.equal(loaded(xi), want)


class _Stub16(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.act = nn.Tanh()
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.act(self.quant(x)))


def test_every_qint16_code_compiles_to_the_converted_codes() -> None:
    """The lut16 kernel and the quantized module are two spellings of one rule: all 65,536 codes."""
    q16 = get_default_qat_qconfig(dtype="qint16")
    with march_scope("bayes"):
        m = prepare_qat_fx(_Stub16().eval(), {"": q16})
        set_fake_quantize(m, "calibration")
        m(torch.tensor([-3.0, 3.0]))
        set_fake_quantize(m, "validation")
        conv = convert_fx(m)
    s = float(conv.get_submodule("quant").scale[0])
    x = torch.arange(-32768, 32768, dtype=torch.float32) * s
    compiled = compile_model(conv, x, march="bayes")
    codes = conv.get_submodule("quant")(x)
    assert int(codes.min()) == -32768 and int(codes.max()) == 32767 and codes.unique().numel() == 65536
    assert torch.equal(compiled(x), conv(x))


def test_bernoulli2_tables_refuse_a_qint16_table_input() -> None:
    m, x = _trained("Sigmoid", False)
    with march_scope("bayes"):
        conv = convert_fx(m)
    report = check_model(conv, x, march="bernoulli2")
    assert "act" in {v.node for v in report.violations}


class _FFExp(nn.Module):
    def __init__(self, method: str) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 1)
        self.ff = FloatFunctional()
        self.method = method
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(getattr(self.ff, self.method)(self.conv(self.quant(x))))


def test_floatfunctional_exp_of_qint16_codes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 5)
    with march_scope("bayes"):
        m = prepare_qat_fx(_FFExp("exp").eval(), _qconfig(False))
        m(x)
        set_fake_quantize(m, "validation")
        conv = convert_fx(m)
    assert "qlut_method" in {n.op.name for n in trace(conv, x).nodes}
    compile_model(conv, x, hbm=tmp_path / "m.hbm")
    loaded = load_compiled(tmp_path / "m.hbm")
    assert "lut16" in [i.op for i in loaded.program.instructions]
    with torch.no_grad():
        assert torch.equal(m(x), conv(x))
    assert torch.equal(loaded(x), conv(x))


@pytest.mark.parametrize("method", ["ceil", "floor"])
def test_floatfunctional_ceil_floor_of_qint16_codes(method: str, tmp_path: Path) -> None:
    """An exact segmented table: the converted model, the IR and the artifact agree, and every
    output is the rounding of the float function at the output scale."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 5) * 3
    with march_scope("bayes"):
        q16 = get_default_qat_qconfig(dtype="qint16")  # Bayes: ceil / floor keep their input's dtype
        m = prepare_qat_fx(
            _FFExp(method).eval(), {"": get_default_qat_qconfig(), "module_name": {"conv": q16, "ff": q16}}
        )
        m(x)
        set_fake_quantize(m, "validation")
        conv = convert_fx(m)
    g = trace(conv, x)
    (node,) = [n for n in g.nodes if n.op.name == "qlut_method"]
    assert node.op.table16_version == 2 and node.operands[0].type.dtype.name in ("qint16", "int16")
    compile_model(conv, x, hbm=tmp_path / "m.hbm")
    loaded = load_compiled(tmp_path / "m.hbm")
    assert "lut16" in [i.op for i in loaded.program.instructions]
    with torch.no_grad():
        want = conv(x)
        assert torch.equal(m(x), want)
    assert torch.equal(run_graph(g, x), want) and torch.equal(loaded(x), want)
    ff = conv.get_submodule("ff")
    codes = conv.get_submodule("conv")(conv.get_submodule("quant")(x))
    s_in, s_out = float(ff.input_scale_0[0]), float(ff.scale[0])
    fn = getattr(torch, method)
    ideal = torch.floor(fn(codes.double() * float(torch.tensor(s_in))) / s_out + 0.5).clamp(-32768, 32767)
    assert torch.equal(getattr(ff, method)(codes).double(), ideal)


def _header_and_section(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    _, _, hlen = struct.unpack_from("<8sIQ", data, 0)
    start = 20 + hlen + (-(20 + hlen)) % 64
    return json.loads(data[20 : 20 + hlen]), data[start:-32]


def _forged(path: Path, header: dict[str, Any], section: bytes) -> Path:
    head = struct.pack("<8sIQ", MAGIC, 1, len(text := json.dumps(header).encode())) + text
    body = head + b"\x00" * ((-len(head)) % 64) + section
    out = path.with_name("forged.hbm")
    out.write_bytes(body + hashlib.sha256(body).digest())
    return out


def _converted(qconfig: Any) -> nn.Module:
    with march_scope("bayes"):
        m = prepare_qat_fx(_Stub16().eval(), {"": qconfig})
        m(torch.tensor([-3.0, 3.0]))
        set_fake_quantize(m, "validation")
        return convert_fx(m)


def test_a_forged_lut16_instruction_is_refused_at_load(tmp_path: Path) -> None:
    x = torch.randn(4, 8)
    compile_model(_converted(get_default_qat_qconfig(dtype="qint16")), x, hbm=tmp_path / "m16.hbm", march="bayes")
    compile_model(_converted(get_default_qat_qconfig()), x, hbm=tmp_path / "m8.hbm", march="bayes")
    h16, s16 = _header_and_section(tmp_path / "m16.hbm")
    h8, s8 = _header_and_section(tmp_path / "m8.hbm")
    (i16,) = [i for i in h16["program"]["instructions"] if i["op"] == "lut16"]
    (i8,) = [i for i in h8["program"]["instructions"] if i["op"] == "lut"]
    cases = []
    i16["attrs"]["out_dtype"] = "qint32"
    cases.append((h16, s16, "'qint32' is not one of 'qint8', 'qint16'"))
    h16 = copy.deepcopy(h16)
    (i16,) = [i for i in h16["program"]["instructions"] if i["op"] == "lut16"]
    i16["op"] = "lut"
    del i16["attrs"]["out_dtype"], i16["attrs"]["version"]
    cases.append((h16, s16, r"consts\.table: rank 2 is outside \[1, 1\] \(lut for"))  # knot codes and values
    i8["op"] = "lut16"
    i8["attrs"]["out_dtype"] = "qint8"
    cases.append((h8, s8, r"consts\.table: dtype int8 is not one of int32 \(lut16"))  # a 256-entry table
    for header, section, why in cases:
        with pytest.raises(ArtifactError, match=why):
            load_compiled(_forged(tmp_path / "m.hbm", header, section))
