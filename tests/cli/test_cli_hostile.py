"""Bad invocations of every ``qir`` subcommand: each exits with the documented code (docs/cli.md)
and one line on stderr naming what is wrong, never a Python traceback.

Missing, binary, truncated and corrupted files, a directory where a file belongs, a file where a
folder belongs, bad shapes, marches, numbers and flags. Run in-process through
``qir.cli.main.main`` (the ``qir`` fixture), one real artifact compiled once for the ``run`` cases.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import MODELS, Result

Qir = Callable[..., Result]
SHAPE = ("--input-shape", "1,3,16,16")
TINY = f"{MODELS}:tiny"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Good and bad inputs, made once: a real artifact and broken copies of it, arrays, junk."""
    import sys

    sys.path.insert(0, str(MODELS.parent))
    import models  # tests/cli/models.py

    from qir.quantization import compile_model

    d = tmp_path_factory.mktemp("hostile_cli")
    good = d / "tiny.hbm"
    compile_model(models.converted(), [torch.randn(1, 3, 16, 16)], hbm=good, opt=0)
    data = good.read_bytes()
    (hlen,) = struct.unpack_from("<Q", data, 12)

    def refix(b: bytes) -> bytes:
        return b[:-32] + hashlib.sha256(b[:-32]).digest()

    header = data[20 : 20 + hlen]
    out = {"good": good, "dir": d / "a_dir"}
    out["dir"].mkdir()
    writes = {
        "truncated.hbm": data[: len(data) // 2],
        "empty.hbm": b"",
        "junk.hbm": bytes(range(256)) * 8,
        "flipped.hbm": data[:40] + bytes([data[40] ^ 1]) + data[41:],
        "dupkey.hbm": refix(data.replace(header, header.replace(b'"march":', b'"march":"bayes","march":', 1))),
        "march.hbm": refix(data.replace(b'"march":"bayes"', b'"march":"nayes"', 1)),  # same length
        "binary.py": b"\x00\x01\x02\xff\xfe import torch\n",
        "binary.qir": b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01",
        "empty.qir": b"",
        "nul.qir": b"graph @g(%x: tensor<1xf32>) {\n  return %x\0\n}\n",
        "cut.qir": b"graph @g(%x: tensor<1x3xf32>) {\n  %y: tensor<1x3xf32> = relu(%x",
        "text.npy": b"this is not numpy\n",
        "text.npz": b"PK not really a zip",
        "notes.txt": b"just text\n",
        "binary_passes.py": b"\xff\xfe\x00garbage",
        # converted-model IR: a cat along a dim the codes do not have, a march that is not one,
        # a FloatFunctional whose output scale is too small for its inputs (the multiplier limit)
        "qcat_dim.qir": _integer_ir("count=2, dim=7"),
        "qcat_march.qir": _integer_ir("count=2, dim=1").replace(b'march="bayes"', b'march="numpy"'),
        "qcat_scale.qir": _integer_ir("count=2, dim=1").replace(b"(0.1,)), in_scales", b"(1e-9,)), in_scales"),
    }
    for name, b in writes.items():
        (d / name).write_bytes(b)
        out[name] = d / name
    arrays = {
        "x.npy": np.zeros((1, 3, 16, 16), np.float32),
        "small.npy": np.zeros((1, 3, 8, 8), np.float32),
        "rank1.npy": np.zeros((3,), np.float32),
        "strings.npy": np.array(["a", "bc", "def"]),
        "complex.npy": np.zeros((1, 3, 16, 16), np.complex64),
        "calib_wrong.npy": np.zeros((4, 5, 16, 16), np.float32),
    }
    for name, a in arrays.items():
        np.save(d / name, a)
        out[name] = d / name
    np.save(d / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    out["objects.npy"] = d / "objects.npy"
    np.savez(d / "two.npz", a=np.zeros((1, 3, 16, 16), np.float32), b=np.zeros((1, 3, 16, 16), np.float32))
    out["two.npz"] = d / "two.npz"
    np.savez(d / "none.npz")
    out["none.npz"] = d / "none.npz"
    good_ir = d / "good.qir"
    good_ir.write_text("graph @g(%x: tensor<1x3xf32>) {\n  %y: tensor<1x3xf32> = relu(%x)\n  return %y\n}\n")
    out["good.qir"] = good_ir
    return out


def _integer_ir(cat_tail: str) -> bytes:
    return (
        "graph @g(%x: tensor<1x4xf32>) {\n"
        "  %q: tensor<1x4xqi8,scale=[0.1]> = qquant_stub(%x, out=QuantSpec(scale=(0.1,)))\n"
        '  %c: tensor<1x8xqi8,scale=[0.1]> = qcat(%q, %q, method="cat", out=QuantSpec(scale=(0.1,)), '
        f'in_scales=(0.1, 0.1), march="bayes", {cat_tail})\n'
        "  return %c\n}\n"
    ).encode()


#: (case id, argv with {name} placeholders for ``files``, words the one stderr line must hold)
CASES: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    # -- qir run
    ("run-missing", ("run", "{dir}/nope.hbm", "-i", "{x.npy}"), ("nope.hbm", "does not exist")),
    ("run-directory", ("run", "{dir}", "-i", "{x.npy}"), ("a_dir", "is a directory")),
    ("run-junk", ("run", "{junk.hbm}", "-i", "{x.npy}"), ("junk.hbm", "not a qir compiled model")),
    ("run-truncated", ("run", "{truncated.hbm}", "-i", "{x.npy}"), ("truncated.hbm",)),
    ("run-empty", ("run", "{empty.hbm}", "-i", "{x.npy}"), ("empty.hbm", "truncated")),
    ("run-flipped", ("run", "{flipped.hbm}", "-i", "{x.npy}"), ("flipped.hbm", "checksum")),
    ("run-dup-key", ("run", "{dupkey.hbm}", "-i", "{x.npy}"), ("dupkey.hbm", "duplicate key 'march'")),
    ("run-bad-march", ("run", "{march.hbm}", "-i", "{x.npy}"), ("march.hbm", "'nayes' is not a known march")),
    ("run-python-file", ("run", "{binary.py}", "-i", "{x.npy}"), ("binary.py",)),
    ("run-no-input", ("run", "{good}"), ("--input",)),
    ("run-max-memory-low", ("run", "{good}", "-i", "{x.npy}", "--max-memory", "1K"), ("tiny.hbm", "over the limit")),
    ("run-max-memory-junk", ("run", "{good}", "-i", "{x.npy}", "--max-memory", "lots"), ("--max-memory", "'lots'")),
    ("run-max-memory-zero", ("run", "{good}", "-i", "{x.npy}", "--max-memory", "0"), ("--max-memory",)),
    ("run-input-missing", ("run", "{good}", "-i", "{dir}/none.npy"), ("none.npy", "does not exist")),
    ("run-input-directory", ("run", "{good}", "-i", "{dir}"), ("a_dir",)),
    ("run-input-text", ("run", "{good}", "-i", "{text.npy}"), ("text.npy",)),
    ("run-input-bad-zip", ("run", "{good}", "-i", "{text.npz}"), ("text.npz",)),
    ("run-input-txt", ("run", "{good}", "-i", "{notes.txt}"), ("notes.txt",)),
    ("run-input-objects", ("run", "{good}", "-i", "{objects.npy}"), ("objects.npy",)),
    ("run-input-strings", ("run", "{good}", "-i", "{strings.npy}"), ("strings.npy", "holds <U3 values")),
    ("run-input-complex", ("run", "{good}", "-i", "{complex.npy}"), ("complex.npy", "holds complex64 values")),
    ("run-input-wrong-shape", ("run", "{good}", "-i", "{small.npy}"), ("(1, 3, 8, 8)",)),
    ("run-input-rank", ("run", "{good}", "-i", "{rank1.npy}"), ("(3,)",)),
    ("run-too-many-inputs", ("run", "{good}", "-i", "{two.npz}"), ("takes 1 input(s)", "2 array(s)")),
    ("run-empty-npz", ("run", "{good}", "-i", "{none.npz}"), ("0 array(s)",)),
    ("run-threads-zero", ("run", "{good}", "-i", "{x.npy}", "--threads", "0"), ("--threads",)),
    ("run-threads-negative", ("run", "{good}", "-i", "{x.npy}", "--threads", "-3"), ("--threads",)),
    ("run-threads-word", ("run", "{good}", "-i", "{x.npy}", "--threads", "two"), ("--threads",)),
    ("run-output-suffix", ("run", "{good}", "-i", "{x.npy}", "-o", "{dir}/y.txt"), ("y.txt", ".npz")),
    ("run-output-no-dir", ("run", "{good}", "-i", "{x.npy}", "-o", "{dir}/no/such/y.npy"), ("y.npy",)),
    ("run-output-is-dir", ("run", "{good}", "-i", "{x.npy}", "-o", "{dir}"), ("a_dir",)),
    ("run-output-under-file", ("run", "{good}", "-i", "{x.npy}", "-o", "{notes.txt}/y.npy"), ("notes.txt",)),
    # -- qir check / compile / perf / show: the model, its shape, march and options
    ("check-missing-model", ("check", "{dir}/nope.py:f", *SHAPE), ("nope.py", "does not exist")),
    ("check-model-directory", ("check", "{dir}:f", *SHAPE), ("a_dir",)),
    ("check-binary-model", ("check", "{binary.py}:f", *SHAPE), ("binary.py",)),
    ("check-empty-spec", ("check", ":", *SHAPE), ("factory",)),
    ("check-empty-factory", ("check", f"{MODELS}:", *SHAPE), ("factory",)),
    ("check-text-as-model", ("check", "{notes.txt}:f", *SHAPE), ("notes.txt",)),
    ("check-no-shape", ("check", TINY), ("--input-shape",)),
    ("check-empty-shape", ("check", TINY, "--input-shape", ""), ("--input-shape",)),
    ("check-shape-commas", ("check", TINY, "--input-shape", "1,3,16,16,,"), ("--input-shape",)),
    ("check-shape-float", ("check", TINY, "--input-shape", "1,3,1e3,16"), ("--input-shape",)),
    ("check-shape-huge-int", ("check", TINY, "--input-shape", "9" * 30 + ",3"), ("--input-shape",)),
    ("check-shape-huge", ("check", TINY, "--input-shape", "1,3,99999999,99999999"), ("--input-shape",)),
    ("check-shape-zero", ("check", TINY, "--input-shape", "1,0,16,16"), ("--input-shape",)),
    ("check-shape-rejected", ("check", TINY, "--input-shape", "1,5,16,16"), ("--input-shape 1,5,16,16",)),
    ("check-march", ("check", TINY, *SHAPE, "--march", "x3"), ("--march 'x3'",)),
    ("check-march-empty", ("check", TINY, *SHAPE, "--march", ""), ("--march",)),
    ("check-qconfig", ("check", TINY, *SHAPE, "--qconfig", "int4"), ("--qconfig",)),
    ("check-calib-missing", ("check", TINY, *SHAPE, "--calib-data", "{dir}/c.npy"), ("c.npy", "does not exist")),
    ("check-calib-text", ("check", TINY, *SHAPE, "--calib-data", "{text.npy}"), ("text.npy",)),
    ("check-calib-bad-zip", ("check", TINY, *SHAPE, "--calib-data", "{text.npz}"), ("text.npz",)),
    ("check-calib-wrong", ("check", TINY, *SHAPE, "--calib-data", "{calib_wrong.npy}"), ("calib_wrong.npy",)),
    ("check-calib-empty-dir", ("check", TINY, *SHAPE, "--calib-data", "{dir}"), ("no image files",)),
    ("check-calib-steps", ("check", TINY, *SHAPE, "--calib-steps", "-5"), ("--calib-steps",)),
    ("check-calib-steps-word", ("check", TINY, *SHAPE, "--calib-steps", "many"), ("--calib-steps",)),
    ("check-bogus-flag", ("check", TINY, *SHAPE, "--bogus"), ("--bogus",)),
    ("check-report-is-dir", ("check", TINY, *SHAPE, "--report", "{dir}"), ("a_dir",)),
    ("compile-no-shape", ("compile", TINY), ("--input-shape",)),
    ("compile-opt", ("compile", TINY, *SHAPE, "--opt", "7"), ("--opt",)),
    ("compile-input-source", ("compile", TINY, *SHAPE, "--input-source", "usb"), ("--input-source",)),
    ("compile-raises", ("compile", f"{MODELS}:raises", *SHAPE), ("raised ValueError",)),
    ("compile-not-module", ("compile", f"{MODELS}:not_a_module", *SHAPE), ("nn.Module",)),
    ("compile-output-is-dir", ("compile", TINY, *SHAPE, "-o", "{dir}"), ("a_dir",)),
    ("compile-output-under-file", ("compile", TINY, *SHAPE, "-o", "{notes.txt}/m.hbm"), ("notes.txt",)),
    ("perf-missing-model", ("perf", "{dir}/nope.py:f", *SHAPE), ("nope.py",)),
    ("perf-bad-shape", ("perf", TINY, "--input-shape", "1,3,a,16"), ("--input-shape",)),
    ("perf-out-is-file", ("perf", TINY, *SHAPE, "--out", "{notes.txt}"), ("notes.txt",)),
    ("perf-march", ("perf", TINY, *SHAPE, "--march", "bayes3"), ("--march",)),
    ("show-no-shape", ("show", TINY), ("--input-shape",)),
    ("show-output-is-dir", ("show", TINY, *SHAPE, "-o", "{dir}"), ("a_dir",)),
    ("show-output-under-file", ("show", TINY, *SHAPE, "-o", "{notes.txt}/m.svg"), ("notes.txt",)),
    ("similarity-missing-model", ("similarity", "{dir}/nope.py:f", *SHAPE), ("nope.py",)),
    ("similarity-no-shape", ("similarity", TINY), ("--input-shape",)),
    ("similarity-pair", ("similarity", TINY, *SHAPE, "--pair", "float|nowhere"), ("--pair",)),
    ("similarity-threshold", ("similarity", TINY, *SHAPE, "--threshold", "high"), ("--threshold",)),
    ("similarity-threshold-nan", ("similarity", TINY, *SHAPE, "--threshold", "nan"), ("--threshold",)),
    ("similarity-out-is-file", ("similarity", TINY, *SHAPE, "--out", "{notes.txt}", "--no-plot"), ("notes.txt",)),
    # -- qir ops / passes
    ("ops-march", ("ops", "--march", "nope"), ("--march 'nope'",)),
    ("ops-width-zero", ("ops", "--width", "0"), ("--width",)),
    ("ops-width-negative", ("ops", "--width", "-5"), ("--width",)),
    ("ops-width-word", ("ops", "--width", "wide"), ("--width",)),
    ("ops-extra-arg", ("ops", "conv"), ("conv",)),
    ("passes-load-missing", ("passes", "--load", "{dir}/p.py"), ("p.py",)),
    ("passes-load-binary", ("passes", "--load", "{binary_passes.py}"), ("binary_passes.py",)),
    ("passes-load-directory", ("passes", "--load", "{dir}"), ("a_dir",)),
    ("passes-load-bad-module", ("passes", "--load", "no_such_pkg.passes"), ("no_such_pkg",)),
    ("passes-extra-arg", ("passes", "dce"), ("dce",)),
    # -- qir opt
    ("opt-missing", ("opt", "{dir}/m.qir"), ("m.qir",)),
    ("opt-directory", ("opt", "{dir}"), ("a_dir",)),
    ("opt-binary", ("opt", "{binary.qir}", "-p", "dce"), ("binary.qir",)),
    ("opt-empty", ("opt", "{empty.qir}"), ("empty.qir",)),
    ("opt-nul", ("opt", "{nul.qir}"), ("nul.qir",)),
    ("opt-truncated", ("opt", "{cut.qir}"), ("cut.qir",)),
    ("opt-qcat-dim", ("opt", "{qcat_dim.qir}"), ("qcat", "Dimension out of range")),
    ("opt-qcat-march", ("opt", "{qcat_march.qir}"), ("qcat_march.qir", "march must be one of")),
    ("opt-qcat-scale", ("opt", "{qcat_scale.qir}"), ("qcat", "multiplier limit")),
    ("opt-artifact", ("opt", "{good}"), ("tiny.hbm",)),
    ("opt-unknown-pass", ("opt", "{good.qir}", "-p", "no-such-pass"), ("no-such-pass",)),
    ("opt-bad-option", ("opt", "{good.qir}", "-p", "legalize{march=nope}"), ("nope",)),
    ("opt-bad-pipeline", ("opt", "{good.qir}", "-p", ",,,"), ("pipeline",)),
    ("opt-output-is-dir", ("opt", "{good.qir}", "-o", "{dir}"), ("a_dir",)),
    ("opt-output-under-file", ("opt", "{good.qir}", "-o", "{notes.txt}/o.qir"), ("notes.txt",)),
    ("opt-load-missing", ("opt", "{good.qir}", "--load", "{dir}/p.py"), ("p.py",)),
    # -- qir demo, and the command itself
    ("demo-march", ("demo", "--march", "x5"), ("--march",)),
    ("demo-out-is-file", ("demo", "--fast", "--out", "{notes.txt}"), ("notes.txt",)),
    ("demo-threads", ("demo", "--fast", "--threads", "0"), ("--threads",)),
    ("demo-epochs", ("demo", "--epochs", "-1"), ("--epochs",)),
    ("no-command", (), ("COMMAND",)),
    ("unknown-command", ("frobnicate",), ("frobnicate",)),
    ("unknown-top-flag", ("--bogus",), ("COMMAND",)),
]


def test_there_are_many_cases_over_every_command() -> None:
    assert len(CASES) >= 60
    commands = {argv[0] for _, argv, _ in CASES if argv and not argv[0].startswith("-")}
    assert {"run", "check", "compile", "perf", "show", "similarity", "ops", "passes", "opt", "demo"} <= commands


@pytest.mark.parametrize(("argv", "words"), [(a, w) for _, a, w in CASES], ids=[c for c, _, _ in CASES])
def test_bad_invocation(
    qir: Qir,
    files: dict[str, Path],
    argv: tuple[str, ...],
    words: tuple[str, ...],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # a command that wrongly succeeds writes its default files here
    args = list(argv)
    for k, v in files.items():
        args = [a.replace("{" + k + "}", str(v)) for a in args]
    r = qir(*args)
    assert r.code == 1, (r.code, r.err[-2000:])
    assert "Traceback" not in r.err + r.out
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err[-2000:]
    assert lines[0].startswith("qir") and ": error: " in lines[0], lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
