"""Hostile segmented tables: an artifact's ``lut16`` table and an IR graph's ``table16`` that break
one rule of their format (qir/ir/table16.py) are refused before anything runs, by the loader
(ArtifactError) and by verify (VerifyError), each naming the node, the field and the rule."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.common.artifact import ArtifactError
from benchmarks.fuzz_artifact import assemble
from benchmarks.fuzz_ir_converted import _Lut16
from qir.frontend import trace
from qir.ir import IRError, ParseError, VerifyError, parse_graph, print_graph, verify
from qir.march import march_scope
from qir.quantization import (
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    load_compiled,
    prepare_qat_fx,
    set_fake_quantize,
)

X = torch.linspace(-6.0, 6.0, 128).reshape(2, 64)
V1 = Path(__file__).parent.parent / "data" / "table16_v1" / "model.hbm"


@pytest.fixture(scope="module")
def converted() -> torch.nn.Module:
    with march_scope("bayes"):
        m = prepare_qat_fx(_Lut16().eval(), {"": get_default_qat_qconfig(dtype="qint16")})
        m(X)
        set_fake_quantize(m, "validation")
        return convert_fx(m)


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    (hlen,) = struct.unpack_from("<Q", data, 12)
    start = 20 + hlen + (-(20 + hlen)) % 64
    return json.loads(data[20 : 20 + hlen]), data[start:-32]


def _table(
    header: dict[str, Any], section: bytearray, source: str
) -> tuple[int, dict[str, Any], dict[str, Any], list[int]]:
    """(instruction index, instruction, tensor entry, the int32 values) of ``source``'s lut16 table."""
    i, inst = next(
        (i, d) for i, d in enumerate(header["program"]["instructions"]) if d["op"] == "lut16" and d["source"] == source
    )
    entry = next(t for t in header["tensors"] if t["name"] == inst["consts"]["table"])
    n = entry["nbytes"] // 4
    return i, inst, entry, list(struct.unpack_from(f"<{n}i", section, entry["offset"]))


def _swap(k: list[int], n: int) -> None:
    k[3], k[4] = k[4], k[3]


def _bump(k: list[int], n: int) -> None:
    k[5] += 1


def _end(k: list[int], n: int) -> None:
    k[0] = -32767


def _value(k: list[int], n: int) -> None:
    k[n + 7] = 32768


#: (what, edit of the (2, n) values flattened, attrs / shape edit, the rule in the message)
V2_CASES: list[tuple[str, Callable[[list[int], int], None] | None, dict[str, Any], str]] = [
    ("knots out of order", _swap, {}, r"consts\.table: the knot codes increase strictly; knot 4 \(-?\d+\) follows"),
    (
        "a width of no power of two",
        _bump,
        {},
        r"consts\.table: every interval is a power of two codes wide; knots 4 and 5",
    ),
    (
        "the first knot moved",
        _end,
        {},
        r"consts\.table: the knot codes run from -32768 to 32768 \(the code past the range\), got -32767",
    ),
    (
        "a value past the output range",
        _value,
        {},
        r"consts\.table: knot value 7 is 32768, outside the qint16 output range \[-32768, 32767\]",
    ),
    ("an unknown version", None, {"version": 3}, r"attrs\.version: 3 is outside \[1, 2\]"),
    (
        "version 1 on a version-2 table",
        None,
        {"version": 1},
        r"consts\.table: a version-1 table16 holds 513 knot values, got shape \[2, \d+\]",
    ),
    ("no version on a version-2 table", None, {"version": None}, r"a version-1 table16 holds 513 knot values"),
    ("one row", None, {"shape": "flat"}, r"consts\.table: a version-2 table16 is \(2, n\)"),
]


@pytest.mark.parametrize(("what", "edit", "change", "rule"), V2_CASES, ids=[c[0] for c in V2_CASES])
def test_a_forged_version_2_table_is_refused_at_load(
    converted: torch.nn.Module, tmp_path: Path, what: str, edit: Any, change: dict[str, Any], rule: str
) -> None:
    compile_model(converted, X, hbm=tmp_path / "m.hbm", march="bayes")
    header, section = _split((tmp_path / "m.hbm").read_bytes())
    body = bytearray(section)
    i, inst, entry, values = _table(header, body, "act")
    assert inst["attrs"]["version"] == 2 and len(entry["shape"]) == 2
    if edit is not None:
        edit(values, entry["shape"][1])
        struct.pack_into(f"<{len(values)}i", body, entry["offset"], *values)
    if "version" in change:
        if change["version"] is None:
            del inst["attrs"]["version"]
        else:
            inst["attrs"]["version"] = change["version"]
    if change.get("shape") == "flat":
        entry["shape"] = [len(values)]
    path = tmp_path / "forged.hbm"
    path.write_bytes(assemble(json.dumps(header).encode(), bytes(body)))
    with pytest.raises(ArtifactError) as e:
        load_compiled(path)
    msg = str(e.value)
    assert msg.startswith(str(path)) and f"program.instructions[{i}]." in msg and "(lut16 for 'act')" in msg
    assert re.search(rule, msg), msg


def test_a_version_1_table_past_its_limit_is_refused_at_load(tmp_path: Path) -> None:
    header, section = _split(V1.read_bytes())
    body = bytearray(section)
    i, inst, entry, values = _table(header, body, "act")
    assert "version" not in inst["attrs"] and entry["shape"] == [513]
    values[9] = 2**24 + 1
    struct.pack_into("<513i", body, entry["offset"], *values)
    path = tmp_path / "forged.hbm"
    path.write_bytes(assemble(json.dumps(header).encode(), bytes(body)))
    rule = r"version-1 knot value 9 is 16777217, outside \+-2\*\*24 \(lut16 for 'act'\)"
    with pytest.raises(ArtifactError, match=rf"program\.instructions\[{i}\]\.consts\.table: {rule}"):
        load_compiled(path)


def _graph(converted: torch.nn.Module) -> tuple[str, dict[str, torch.Tensor]]:
    g = trace(converted, X)
    return print_graph(g), dict(g.constants)


@pytest.mark.parametrize(
    ("what", "edit", "rule"), [(c[0], c[1], c[3]) for c in V2_CASES[:4]], ids=[c[0] for c in V2_CASES[:4]]
)
def test_a_forged_version_2_table_is_refused_by_verify(
    converted: torch.nn.Module, what: str, edit: Any, rule: str
) -> None:
    text, constants = _graph(converted)
    t = constants["act.table16"]
    values = t.reshape(-1).tolist()
    edit(values, t.shape[1])
    constants["act.table16"] = torch.tensor(values, dtype=t.dtype).reshape(t.shape)
    g = parse_graph(text, constants=constants)
    with pytest.raises(VerifyError) as e:
        verify(g)
    msg = str(e.value)
    assert e.value.node == "act" and msg.startswith("%act (module act): qlut (Tanh): state operand table16: ")
    assert re.search(rule.replace(r"consts\.table: ", ""), msg), msg


@pytest.mark.parametrize(
    ("edit", "rule"),
    [
        (lambda s: s.replace("table16_version=2", "table16_version=3", 1), r"table16_version must be one of 1, 2"),
        (
            lambda s: s.replace("table16_version=2", "table16_version=1", 1),
            r"a version-1 table16 holds 513 knot values",
        ),
        (lambda s: s.replace("table16_version=2", 'table16_version="2"', 1), r"table16_version must be one of 1, 2"),
        (
            lambda s: re.sub(r"(qlut_method\(.*?)table16_version=2", r"\1table16_version=7", s),
            r"qlut_method: table16_version",
        ),
    ],
    ids=["3", "1 on a version-2 table", "a string", "qlut_method 7"],
)
def test_a_forged_version_in_ir_text_is_refused(
    converted: torch.nn.Module, edit: Callable[[str], str], rule: str
) -> None:
    text, constants = _graph(converted)
    edited = edit(text)
    assert edited != text
    with pytest.raises((ParseError, VerifyError, IRError), match=rule):
        verify(parse_graph(edited, constants=constants))


def test_the_unforged_files_load_and_verify(converted: torch.nn.Module, tmp_path: Path) -> None:
    text, constants = _graph(converted)
    verify(parse_graph(text, constants=constants))
    compile_model(converted, X, hbm=tmp_path / "m.hbm", march="bayes")
    assert torch.equal(load_compiled(tmp_path / "m.hbm")(X), converted(X))
