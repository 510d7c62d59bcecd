"""Files written before the segmented table format had a version (tests/data/table16_v1: an artifact,
IR text and its constants from commit c089389, a Tanh and a FloatFunctional.exp of qint16 codes with
the uniform 513-knot tables) load and run as they did; what qir writes now says version 2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from qir.frontend import emit, trace
from qir.ir import parse_graph, print_graph, run_graph, verify
from qir.march import march_scope
from qir.quantization import (
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    load_compiled,
    prepare_qat_fx,
    set_fake_quantize,
)

DATA = Path(__file__).parent.parent / "data" / "table16_v1"


def _io() -> tuple[torch.Tensor, torch.Tensor]:
    io = torch.load(DATA / "io.pt", weights_only=True)
    return io["x"], io["y"]


def test_an_old_artifact_loads_and_runs_identically() -> None:
    x, y = _io()
    loaded = load_compiled(DATA / "model.hbm")
    luts = [i for i in loaded.program.instructions if i.op == "lut16"]
    assert len(luts) == 2 and all("version" not in i.attrs for i in luts)
    assert all(loaded.program.constants[i.consts["table"]].shape == (513,) for i in luts)
    assert torch.equal(loaded(x), y)


def test_old_ir_text_parses_verifies_runs_emits_and_compiles_identically(tmp_path: Path) -> None:
    x, y = _io()
    text = (DATA / "model.qir").read_text()
    assert "table16_version" not in text
    g = parse_graph(text, constants=torch.load(DATA / "constants.pt", weights_only=True))
    verify(g)
    ops = {n.op.name: n.op for n in g.nodes}
    assert ops["qlut"].table16_version == 1 and ops["qlut_method"].table16_version == 1
    assert print_graph(g) + "\n" == text  # version 1 is the default: the text round-trips unchanged
    assert torch.equal(run_graph(g, x), y)
    module = emit(g)
    assert torch.equal(module(x), y)
    assert module.get_submodule("act").table16_version == 1 and module.get_submodule("ff").table16_version == 1
    compile_model(module, x, hbm=tmp_path / "again.hbm", march="bayes")
    again = load_compiled(tmp_path / "again.hbm")
    assert [i.attrs["version"] for i in again.program.instructions if i.op == "lut16"] == [1, 1]
    assert torch.equal(again(x), y)
    # traced back from the emitted module: still version 1
    assert "table16_version" not in print_graph(trace(module, x))


def test_the_same_model_converts_to_version_2_tables_closer_to_float(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("table16_v1_make", DATA / "make.py")
    assert spec is not None and spec.loader is not None
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    x, y_v1 = _io()
    q16 = get_default_qat_qconfig(dtype="qint16")
    with march_scope("bayes"):
        m = prepare_qat_fx(make.TanhExp().eval(), {"": q16})
        m(x)
        set_fake_quantize(m, "validation")
        conv = convert_fx(m)
    assert conv.get_submodule("act").table16_version == 2 and conv.get_submodule("ff").table16_version == 2
    text = print_graph(trace(conv, x))
    assert text.count("table16_version=2") == 2
    compile_model(conv, x, hbm=tmp_path / "v2.hbm", march="bayes")
    loaded = load_compiled(tmp_path / "v2.hbm")
    assert [i.attrs["version"] for i in loaded.program.instructions if i.op == "lut16"] == [2, 2]
    y = conv(x)
    assert torch.equal(loaded(x), y)
    with torch.no_grad():
        assert torch.equal(m(x), y)  # validation is the converted model, version 2 tables included
    ideal = torch.exp(torch.tanh(x.double()))
    assert float((y - ideal).abs().max()) < float((y_v1 - ideal).abs().max())
