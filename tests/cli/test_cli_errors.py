"""User errors: exit 1, a one-line message naming the file / option, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import HERE, Result

Qir = Callable[..., Result]
Model = Callable[[str], str]
SHAPE = ("--input-shape", "1,3,16,16")


@pytest.mark.parametrize("cmd", ["check", "compile", "perf", "show", "similarity"])
def test_missing_model_file(qir: Qir, cmd: str, tmp_path: Path) -> None:
    qir(cmd, str(tmp_path / "nope.py") + ":make", *SHAPE).assert_user_error("nope.py", "does not exist")


def test_bad_factory_paths(qir: Qir, model: Model) -> None:
    qir("check", model("no_such_factory"), *SHAPE).assert_user_error("no attribute 'no_such_factory'", "did you mean")
    qir("check", str(HERE / "models.py"), *SHAPE).assert_user_error("names no factory", "package.module:factory")
    qir("check", "no_such_package.models:net", *SHAPE).assert_user_error(
        "cannot import model module", "no_such_package"
    )


def test_factory_that_raises_or_returns_junk(qir: Qir, model: Model) -> None:
    qir("check", model("raises"), *SHAPE).assert_user_error("raised ValueError", "weights file not found")
    qir("check", model("not_a_module"), *SHAPE).assert_user_error("returned a int", "nn.Module")


def test_model_file_that_fails_to_import(qir: Qir, tmp_path: Path) -> None:
    bad = tmp_path / "broken.py"
    bad.write_text("import torch\ndef broken(:\n")
    qir("check", f"{bad}:make", *SHAPE).assert_user_error("broken.py", "SyntaxError")


@pytest.mark.parametrize("shape", ["1,a,16,16", "", "0,3,16,16", "-1,3"])
def test_bad_shape_string(qir: Qir, model: Model, shape: str) -> None:
    qir("check", model("tiny"), "--input-shape", shape).assert_user_error("--input-shape")


def test_missing_shape(qir: Qir, model: Model) -> None:
    qir("compile", model("tiny")).assert_user_error("--input-shape")


def test_shape_the_model_rejects(qir: Qir, model: Model) -> None:
    r = qir("check", model("tiny"), "--input-shape", "1,5,16,16")
    r.assert_user_error("--input-shape 1,5,16,16", "RuntimeError")


def test_unknown_march(qir: Qir, model: Model) -> None:
    qir("check", model("tiny"), *SHAPE, "--march", "bayes2").assert_user_error("--march 'bayes2'", "bernoulli2")
    qir("ops", "--march", "x3").assert_user_error("--march 'x3'")


def test_bad_options_exit_1_not_argparse_2(qir: Qir, model: Model) -> None:
    qir("check", model("tiny"), *SHAPE, "--qconfig", "int4").assert_user_error("--qconfig")
    qir("check", model("tiny"), *SHAPE, "--bogus").assert_user_error("--bogus")
    qir("frobnicate").assert_user_error("frobnicate")


def test_corrupt_and_missing_artifact(qir: Qir, tmp_path: Path) -> None:
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((1, 3, 16, 16), np.float32))
    junk = tmp_path / "junk.hbm"
    junk.write_bytes(b"QIRPROG\x00" + b"\x01" * 100)
    qir("run", str(junk), "--input", str(x)).assert_user_error("junk.hbm")
    qir("run", str(tmp_path / "none.hbm"), "--input", str(x)).assert_user_error("none.hbm", "does not exist")


def test_calib_data_errors(qir: Qir, model: Model, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.zeros((4, 3, 8, 8), np.float32))
    qir("check", model("tiny"), *SHAPE, "--calib-data", str(wrong)).assert_user_error("wrong.npy", "(N, 3, 16, 16)")
    empty = tmp_path / "empty"
    empty.mkdir()
    qir("check", model("tiny"), *SHAPE, "--calib-data", str(empty)).assert_user_error("no image files")
    qir("check", model("tiny"), *SHAPE, "--calib-data", str(tmp_path / "no.npy")).assert_user_error("does not exist")
    qir("check", model("tiny"), *SHAPE, "--calib-steps", "0").assert_user_error("--calib-steps")


def test_console_entry_point_exit_code() -> None:
    """``python -m qir`` returns the code as the process status, with no traceback."""
    p = subprocess.run(
        [sys.executable, "-m", "qir", "check", "missing.py:f", "--input-shape", "1,3,8,8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE,
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "missing.py" in p.stderr


def test_huge_input_shape_refused_before_allocating(qir: Qir, model: Model) -> None:
    qir("check", model("tiny"), "--input-shape", "1,3,99999999,99999999").assert_user_error(
        "--input-shape", "more than the limit"
    )


def test_opt_on_binary_file(qir: Qir, tmp_path: Path) -> None:
    binary = tmp_path / "model.qir"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01")
    qir("opt", str(binary), "-p", "dce").assert_user_error("model.qir", "not a UTF-8 IR text file")
