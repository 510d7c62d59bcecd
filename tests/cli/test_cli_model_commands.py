"""check / compile / run / perf / show on the small models of tests/cli/models.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import Result

Qir = Callable[..., Result]
Model = Callable[[str], str]
SHAPE = ("--input-shape", "1,3,16,16", "--calib-steps", "2", "--no-progress")


def test_check_float_model_passes_on_both_marches(qir: Qir, model: Model) -> None:
    for march in ("bayes", "bernoulli2"):
        r = qir("check", model("tiny"), *SHAPE, "--march", march)
        assert r.code == 0, r.err
        assert f"march {march}: PASSED" in r.out
        assert "float model: calibrated and converted by qir" in r.out
        assert "RANDOM normal data" in r.out  # no --calib-data: said so
        assert "no QuantStub" in r.out


def test_check_illegal_model_exits_2_with_the_table(qir: Qir, model: Model, tmp_path: Path) -> None:
    report = tmp_path / "legality.txt"
    r = qir("check", model("with_linear"), *SHAPE, "--march", "bernoulli2", "--report", str(report))
    assert r.code == 2, r.err
    assert "FAILED" in r.out and "torch.nn.Linear" in r.out and "torch.nn.AdaptiveAvgPool2d" in r.out
    assert "fix: use Conv2d 1x1 instead of Linear" in r.out
    assert "not legal on bernoulli2" in r.err and "Traceback" not in r.err
    assert "torch.nn.Linear" in report.read_text()
    assert qir("check", model("with_linear"), *SHAPE, "--march", "bayes").code == 0


def test_compile_refuses_an_illegal_model(qir: Qir, model: Model, tmp_path: Path) -> None:
    out = tmp_path / "m.hbm"
    r = qir("compile", model("with_linear"), *SHAPE, "--march", "bernoulli2", "-o", str(out))
    assert r.code == 2 and "FAILED" in r.out and not out.exists()


def test_converted_and_instance_models_are_used_as_they_are(qir: Qir, model: Model) -> None:
    r = qir("check", model("converted"), *SHAPE)
    assert r.code == 0 and "converted model: used as it is" in r.out and "RANDOM" not in r.out
    r = qir("check", model("qat"), *SHAPE)
    assert r.code == 0 and "QAT model: converted by qir" in r.out and "RANDOM" not in r.out
    r = qir("check", model("instance"), *SHAPE)
    assert r.code == 0 and "float model" in r.out


def test_compile_then_run(qir: Qir, model: Model, tmp_path: Path) -> None:
    art = tmp_path / "tiny.hbm"
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "calib.npy", x)
    r = qir("compile", model("tiny"), *SHAPE, "--opt", "0", "-o", str(art), "--calib-data", str(tmp_path / "calib.npy"))
    assert r.code == 0, r.err
    assert "bit-exact" in r.out and art.is_file() and "calibrated on 2 batch(es) from" in r.out
    np.save(tmp_path / "x.npy", x)
    r = qir("run", str(art), "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy"))
    assert r.code == 0, r.err
    assert "output 0: shape (2, 4, 8, 8) float32" in r.out
    import qir as qir_pkg

    expected = qir_pkg.load_compiled(art)(torch.from_numpy(x))
    assert torch.equal(torch.from_numpy(np.load(tmp_path / "y.npy")), expected)


def test_run_input_errors(qir: Qir, model: Model, tmp_path: Path) -> None:
    art = tmp_path / "tiny.hbm"
    assert qir("compile", model("tiny"), *SHAPE, "--opt", "0", "-o", str(art)).code == 0
    np.save(tmp_path / "bad.npy", np.zeros((1, 5, 16, 16), np.float32))
    qir("run", str(art), "--input", str(tmp_path / "bad.npy")).assert_user_error("(1, 5, 16, 16)")
    qir("run", str(art)).assert_user_error("--input")
    qir("run", str(art), "-i", str(tmp_path / "bad.npy"), "-i", str(tmp_path / "bad.npy")).assert_user_error(
        "takes 1 input(s)"
    )
    truncated = tmp_path / "cut.hbm"
    truncated.write_bytes(art.read_bytes()[:200])
    qir("run", str(truncated), "-i", str(tmp_path / "bad.npy")).assert_user_error("cut.hbm")


def test_perf_and_show(qir: Qir, model: Model, tmp_path: Path) -> None:
    r = qir("perf", model("tiny"), *SHAPE, "--out", str(tmp_path / "perf"), "--layer-details")
    assert r.code == 0, r.err
    assert "ESTIMATE" in r.out and (tmp_path / "perf" / "perf.json").is_file()
    svg = tmp_path / "tiny.svg"
    r = qir("show", model("tiny"), *SHAPE, "-o", str(svg), "--march", "bernoulli2")
    assert r.code == 0, r.err
    assert svg.read_text().lstrip().startswith("<")


def test_show_marks_illegal_layers_without_failing(qir: Qir, model: Model, tmp_path: Path) -> None:
    svg = tmp_path / "bad.svg"
    r = qir("show", model("with_linear"), *SHAPE, "-o", str(svg), "--march", "bernoulli2")
    assert r.code == 0, r.err
    assert "not legal on bernoulli2" in svg.read_text()


def test_image_folder_calibration(qir: Qir, model: Model, tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(3):
        image.fromarray(np.full((20, 24, 3), 40 * i, np.uint8)).save(folder / f"{i}.png")
    r = qir("check", model("tiny"), *SHAPE, "--calib-data", str(folder))
    assert r.code == 0, r.err
    assert "calibrated on 2 batch(es)" in r.out


def test_two_inputs_two_outputs(qir: Qir, model: Model, tmp_path: Path) -> None:
    shapes = ("--input-shape", "1,3,8,8", "--input-shape", "2,3,4,4", "--calib-steps", "2", "--no-progress")
    art = tmp_path / "two.hbm"
    r = qir("compile", model("two_inputs"), *shapes, "--opt", "0", "-o", str(art))
    assert r.code == 0, r.err
    assert "bit-exact" in r.out
    np.savez(tmp_path / "xy.npz", x=np.ones((1, 3, 8, 8), np.float32), y=np.ones((2, 3, 4, 4), np.float32))
    r = qir("run", str(art), "--input", str(tmp_path / "xy.npz"), "-o", str(tmp_path / "out.npz"))
    assert r.code == 0, r.err
    assert "output 0: shape (1, 4, 8, 8)" in r.out and "output 1: shape (2, 4, 4, 4)" in r.out
    assert sorted(np.load(tmp_path / "out.npz").files) == ["output0", "output1"]
