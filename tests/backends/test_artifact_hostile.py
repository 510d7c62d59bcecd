"""Hostile artifacts: every forged header or data section is one ArtifactError naming the file,
the field and the rule; nothing else escapes the loader and nothing is allocated from a forged size."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from artifact_forge import Forge, assemble, instr

import qir
from backends.common.artifact import ArtifactError
from backends.common.artifact_json import MAX_DEPTH, JSONLimitError, loads_strict


def _refused(path: Path, *words: str) -> str:
    with pytest.raises(ArtifactError) as info:
        qir.load_compiled(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: "), msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


_instr = instr


def test_the_unforged_artifact_loads(forge: Forge) -> None:
    run = qir.load_compiled(forge())
    assert run(torch.zeros(1, 1, 28, 28)).shape == (1, 10)


# ----------------------------------------------------------------------------- JSON limits


def test_duplicate_key_does_not_silently_win(forge: Forge, good: tuple[dict[str, Any], bytes]) -> None:
    text = json.dumps(good[0]).replace('"march": "bayes"', '"march": "bayes", "march": "bernoulli2"', 1)
    assert text.count('"march"') == 2
    _refused(forge(header_text=text.encode()), "header:", "duplicate key 'march'")


def test_huge_integer_literal(forge: Forge, good: tuple[dict[str, Any], bytes]) -> None:
    text = json.dumps(good[0]).replace('"offset": 0', '"offset": ' + "9" * 5000, 1)
    _refused(forge(header_text=text.encode()), "header:", "5000 characters", "at most 20 digits")


def test_deep_nesting_is_refused_before_decoding(forge: Forge) -> None:
    text = b'{"program": ' + b"[" * 50_000 + b"]" * 50_000 + b', "tensors": []}'
    _refused(forge(header_text=text), "nesting depth 50001", f"limit of {MAX_DEPTH}")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers(forge: Forge, good: tuple[dict[str, Any], bytes], literal: str) -> None:
    scale = _instr(good[0], "quantize")["attrs"]["scale"]
    text = json.dumps(good[0]).replace(f'"scale": {scale!r}', f'"scale": {literal}', 1)
    assert literal in text
    _refused(forge(header_text=text.encode()), "header:", "finite numbers only" if "e" not in literal else "finite")


def test_loads_strict_brackets_inside_strings_do_not_count() -> None:
    assert loads_strict(json.dumps({"a": "[" * 1000})) == {"a": "[" * 1000}
    with pytest.raises(JSONLimitError, match="not valid JSON"):
        loads_strict("{")


@pytest.mark.parametrize("text", [b"\xff\xfe{}", b"[]", b"{}", b'{"program": {}, "tensors": [], "x": 1}'])
def test_header_not_an_artifact_object(forge: Forge, text: bytes) -> None:
    _refused(forge(header_text=text), "header")


# ----------------------------------------------------------------------------- tensor table


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit that sets ``header[path]`` (dotted, with integer list indices)."""

    def edit(h: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = h
        for k in parents:
            node = node[int(k)] if isinstance(node, list) else node[k]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return edit


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        ("tensors", {"a": 1}, ("field tensors:", "must be an array")),
        ("tensors.0", [1, 2], ("field tensors[0]:", "must be an object")),
        ("tensors.0.shape", [0, 2**40], ("tensors[0].shape[1]", "outside [0, 2147483647]")),
        ("tensors.0.shape", [-1, 4], ("tensors[0].shape[0]", "outside")),
        ("tensors.0.shape", [True, 4], ("tensors[0].shape[0]", "must be an integer, got a boolean")),
        ("tensors.0.shape", [1] * 40, ("tensors[0].shape", "rank 40")),
        ("tensors.0.shape", "4,1,3,3", ("tensors[0].shape", "must be an array")),
        ("tensors.0.dtype", "object", ("tensors[0].dtype", "'object' is not one of")),
        ("tensors.0.nbytes", 35, ("tensors[0].nbytes", "35 bytes do not hold int8[4, 1, 3, 3]")),
        ("tensors.0.offset", 2**62, ("tensors[0].offset", "does not fit the data section")),
        ("tensors.0.offset", 1.5, ("tensors[0].offset", "must be an integer")),
        ("tensors.0.offset", 2**64, ("tensors[0].offset", "outside")),
        ("tensors.0.name", "", ("tensors[0].name", "1 to 1024 characters")),
        ("tensors.0.name", None, ("tensors[0].name", "must be a string, got null")),
        ("tensors.0.extra", 1, ("tensors[0]", "unknown key(s) 'extra'")),
    ],
)
def test_tensor_table_fields(forge: Forge, path: str, value: Any, words: tuple[str, ...]) -> None:
    _refused(forge(_set(path, value)), "header field", *words)


def test_missing_tensor_key(forge: Forge) -> None:
    _refused(forge(lambda h: h["tensors"][1].pop("nbytes")), "tensors[1]", "missing key(s) nbytes")


def test_duplicate_tensor_names(forge: Forge) -> None:
    def edit(h: dict[str, Any]) -> None:
        h["tensors"][1]["name"] = h["tensors"][0]["name"]

    _refused(forge(edit), "tensors[1].name", "appears twice")


def test_overlapping_byte_ranges(forge: Forge) -> None:
    def edit(h: dict[str, Any]) -> None:
        h["tensors"][1]["offset"] = h["tensors"][0]["offset"]  # both start at byte 0

    msg = _refused(forge(edit), "overlap", "its own byte range")
    assert "tensors[0]" in msg and "tensors[1]" in msg


def test_empty_tensors_may_share_an_offset(forge: Forge) -> None:
    def edit(h: dict[str, Any]) -> None:
        h["tensors"].append({"name": "empty#a", "dtype": "int8", "shape": [0, 2**31 - 1], "offset": 0, "nbytes": 0})

    prog = qir.load_compiled(forge(edit)).program
    assert prog.constants["empty#a"].shape == (0, 2**31 - 1)


def test_truncated_data_section(forge: Forge, good: tuple[dict[str, Any], bytes]) -> None:
    _refused(forge(section=good[1][:100]), "does not fit the data section")


# ----------------------------------------------------------------------------- program fields, scales, march


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        ("program.march", "bayes2", ("program.march", "'bayes2' is not a known march", "bernoulli2")),
        ("program.march", 7, ("program.march", "7 is not a known march")),
        ("program.inputs", "x", ("program.inputs", "must be an array")),
        ("program.inputs", ["a", "a"], ("program.inputs", "appears twice")),
        ("program.outputs", 5, ("program.outputs", "value name")),
        ("program.outputs", {"$dict": [["hm", "%a"], ["hm", "%a"]]}, ("program.outputs.$dict[1][0]", "appears twice")),
        ("program.outputs", {"$dict": [["hm"]]}, ("program.outputs.$dict[0]", "[key, value] pair")),
        ("program.outputs", {"$dict": [[3, "%a"]]}, ("program.outputs.$dict[0][0]", "must be a string")),
        ("program.outputs", {"hm": "%a"}, ("program.outputs", "$dict")),
        ("program.instructions", {}, ("program.instructions", "must be an array")),
        ("program.instructions.0", "quantize", ("program.instructions[0]", "must be an object")),
        ("program.instructions.0.op", "os.system", ("instructions[0].op", "not a kernel")),
        ("program.instructions.0.inputs", [3], ("instructions[0].inputs[0]", "must be a string")),
        ("program.instructions.0.attrs", [], ("instructions[0].attrs", "must be an object")),
        ("program.instructions.1.consts.weight", "nope", ("instructions[1].consts.weight", "'nope'")),
        ("program.instructions.0.attrs.scale", -0.5, ("instructions[0].attrs.scale", "finite positive")),
        ("program.instructions.0.attrs.scale", 0, ("instructions[0].attrs.scale", "finite positive")),
        ("program.instructions.0.attrs.scale", "0.1", ("instructions[0].attrs.scale", "must be a number")),
        ("program.meta", [], ("program.meta", "must be an object")),
    ],
)
def test_program_fields(forge: Forge, path: str, value: Any, words: tuple[str, ...]) -> None:
    _refused(forge(_set(path, value)), "header field", *words)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0])
def test_dequantize_scale_constant(forge: Forge, good: tuple[dict[str, Any], bytes], bad: float) -> None:
    header = good[0]
    name = _instr(header, "dequantize")["consts"]["scale"]
    entry = next(t for t in header["tensors"] if t["name"] == name)
    section = bytearray(good[1])
    section[entry["offset"] : entry["offset"] + 4] = struct.pack("<f", bad)
    _refused(forge(section=bytes(section)), "consts.scale", "finite and positive")


def test_malformed_value_reference(forge: Forge) -> None:
    def edit(h: dict[str, Any]) -> None:
        _instr(h, "shape_fn")["attrs"]["args"] = [{"$slice": [1]}]

    _refused(forge(edit), "invalid program", "[start, stop, step]")


# ----------------------------------------------------------------------------- kernel schemas, wiring


def _conv(h: dict[str, Any]) -> dict[str, Any]:
    return _instr(h, "conv2d")


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (
            lambda h: _conv(h)["attrs"].update(kernel_size=[10**6, 10**6]),
            ("attrs.kernel_size", "not an integer in [1, 4096]"),
        ),
        (lambda h: _conv(h)["attrs"].update(kernel_size=[5, 5]), ("kernel_size [5, 5] differs from the weight's",)),
        (lambda h: _conv(h)["attrs"].update(stride=[0, 1]), ("attrs.stride", "entry 0")),
        (lambda h: _conv(h)["attrs"].update(engine="gpu"), ("attrs.engine", "'gpu' is not one of")),
        (lambda h: _conv(h)["attrs"].update(bogus=1), ("attrs.bogus", "conv2d has no attribute 'bogus'")),
        (lambda h: _conv(h)["attrs"].pop("groups"), ("attrs.groups", "needs attribute 'groups'")),
        (lambda h: _conv(h)["attrs"].update(has_add=True), ("has_add needs the addend",)),
        (lambda h: _conv(h)["consts"].pop("bias"), ("consts.bias", "needs constant 'bias'")),
        (lambda h: _conv(h)["outputs"].append("%extra"), ("outputs", "exactly 1 output")),
        (lambda h: _conv(h)["inputs"].clear(), ("inputs", "takes 1 to 2 input(s), got 0")),
        (lambda h: _instr(h, "maxpool2d")["attrs"].update(kernel_size=-2), ("maxpool2d", "kernel_size")),
        (lambda h: _instr(h, "quantize")["attrs"].update(dtype="qint64"), ("attrs.dtype", "'qint64'")),
        (lambda h: _instr(h, "dequantize")["attrs"].update(axis=10**6), ("attrs.axis", "outside")),
        (lambda h: _instr(h, "shape_fn")["attrs"].update(fn="system"), ("attrs.fn", "'system' is not one of")),
        (lambda h: _instr(h, "shape_fn")["attrs"]["args"].append({"a": 1}), ("attrs.args", "holds an object")),
        (lambda h: _instr(h, "shape_fn")["attrs"]["args"].append(2**40), ("attrs.args", "outside")),
        (
            lambda h: _instr(h, "shape_fn")["attrs"]["args"].append({"$v": h["program"]["inputs"][0]}),
            ("not inputs of this instruction",),
        ),
    ],
)
def test_kernel_schema(forge: Forge, edit: Callable[[dict[str, Any]], Any], words: tuple[str, ...]) -> None:
    msg = _refused(forge(edit), *words)
    assert "header field program.instructions[" in msg or "invalid program" in msg, msg


def test_a_value_bound_twice(forge: Forge) -> None:
    def edit(h: dict[str, Any]) -> None:
        ins = h["program"]["instructions"]
        ins[2]["outputs"] = list(ins[1]["outputs"])

    _refused(forge(edit), "invalid program", "already defined")


def test_every_kernel_declares_a_schema() -> None:
    from backends.common.kernels import get_kernel, kernel_names
    from backends.common.kernels.schema import KernelSchema

    names = kernel_names()
    assert len(names) >= 40
    assert all(isinstance(get_kernel(n).schema, KernelSchema) for n in names)


def test_the_writer_checks_the_same_schema(good: tuple[dict[str, Any], bytes], tmp_path: Path) -> None:
    """write_program refuses what the loader would refuse: one declaration on both sides."""
    from backends.common.artifact import read_program, write_program

    path = tmp_path / "ok.hbm"
    path.write_bytes(assemble(json.dumps(good[0]).encode(), good[1]))
    prog = read_program(path)
    i = next(k for k, inst in enumerate(prog.instructions) if inst.op == "conv2d")
    inst = prog.instructions[i]
    prog.instructions[i] = type(inst)(inst.op, inst.inputs, inst.outputs, {**inst.attrs, "groups": 0}, inst.consts)
    with pytest.raises(ArtifactError, match=r"not written: program\.instructions\[\d+\]\.attrs\.groups: 0 is outside"):
        write_program(prog, tmp_path / "bad.hbm")
    assert not (tmp_path / "bad.hbm").exists()


# ----------------------------------------------------------------------------- the fuzzer, briefly


def test_fuzzer_finds_no_bug_at_load(tmp_path: Path) -> None:
    """200 seeded mutations of real artifacts (benchmarks/fuzz_artifact.py, run in its own process
    under an address-space limit): every file the loader accepts or refuses is classified, no
    load ends in anything but ArtifactError, and every file that loads runs."""
    import subprocess
    import sys

    out = tmp_path / "fuzz.json"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.fuzz_artifact", "--cases", "200", "--seed", "0", "--json", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert out.exists(), proc.stdout + proc.stderr
    counts = json.loads(out.read_text())["counts"]
    assert sum(counts.values()) == 200
    assert counts.get("refused at load (ArtifactError)", 0) > 50, counts
    assert counts.get("loads and runs", 0) > 10, counts
    from benchmarks.fuzz_artifact import OK_CLASSES

    # nothing but ArtifactError at load, and no kernel refusing operands at run: shape inference
    # at load catches them (before it, 3.6% of cases failed at run)
    bugs = {c: n for c, n in counts.items() if c not in OK_CLASSES}
    assert not bugs, (bugs, proc.stdout)


@pytest.mark.parametrize("attrs", [{"$v": "x"}, {"$tuple": [1]}])
def test_attrs_that_decode_to_a_special_form(forge: Forge, attrs: dict[str, Any]) -> None:
    _refused(forge(lambda h: _instr(h, "maxpool2d").update(attrs=attrs)), "invalid program", "attrs must be an object")


@pytest.mark.parametrize(
    ("fn", "args"),
    [("repeat", [20000, 10000]), ("repeat", [[1, 1, 2**20, 2**20]]), ("expand", [2**20, 2**20, -1, -1])],
)
def test_growing_layout_functions_are_bounded_before_allocating(
    forge: Forge, fn: str, args: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forged repeat / expand is refused by its size at load (shape inference runs the bounded
    layout function on meta tensors), with or without a memory limit; nothing is allocated."""

    def edit(h: dict[str, Any]) -> None:
        d = _instr(h, "shape_fn")
        d["attrs"] = {"fn": fn, "args": [{"$v": d["inputs"][0]}, *args], "kwargs": {}}

    path = forge(edit)
    calls: list[Any] = []
    monkeypatch.setattr(torch.Tensor, "repeat", lambda *a: calls.append(a))  # must never be reached
    for limit in (None, 2**31):
        with pytest.raises(ArtifactError, match=rf"shape_fn for 'flatten': .*{fn}.* elements \(limit 268435456\)"):
            qir.load_compiled(path, max_memory=limit)
    assert not calls


def test_a_forged_power_of_sizes_is_bounded(forge: Forge) -> None:
    """``pow`` on sizes (``d ** -0.5``) computes ints of bounded size: a forged exponent is refused
    (at load, before any kernel runs)."""

    def edit(h: dict[str, Any]) -> None:
        d = _instr(h, "shape_fn")
        d["attrs"] = {"fn": "pow", "args": [3, 2**30], "kwargs": {}}

    # refused at load: shape inference evaluates the bounded pow at the declared shapes
    with pytest.raises(ArtifactError, match=r"shape_fn for 'flatten': .*3 \*\* 1073741824 would have more than 4096"):
        qir.load_compiled(forge(edit), max_memory=None)


@pytest.mark.parametrize(("repeats", "want"), [(False, "loads and runs"), (True, "run: hang (> 10 s)")])
def test_fuzzer_counts_a_hang_only_when_it_repeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, repeats: bool, want: str
) -> None:
    """A case is deterministic: a hang times out again, a stall of a loaded machine does not. The
    retry's class counts and the stall is reported."""
    import types

    from benchmarks import fuzz_artifact

    calls: list[Path] = []

    def stalling(path: Path, inputs: Any, timeout: float) -> str:
        calls.append(path)
        return "run: hang (> 10 s)" if len(calls) == 1 or repeats else "loads and runs"

    monkeypatch.setattr(fuzz_artifact, "classify", stalling)
    monkeypatch.setattr(fuzz_artifact, "mutate", lambda rng, seed: ("m", b"bytes"))
    seed = types.SimpleNamespace(name="s", inputs=())
    counts, _, stalls = fuzz_artifact.fuzz([seed], 1, 0, tmp_path)
    assert len(calls) == 2 and dict(counts) == {want: 1} and stalls == (0 if repeats else 1)
    assert ("within it when run again" in fuzz_artifact.table(counts, {}, stalls)) is not repeats
