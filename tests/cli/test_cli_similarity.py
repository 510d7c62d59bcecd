"""qir similarity: two stages of a model compared per layer; files written; bad pairs are user errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from cli_helpers import Result

Qir = Callable[..., Result]
Model = Callable[[str], str]
SHAPE = ("--input-shape", "2,3,16,16", "--calib-steps", "2", "--no-progress")


def test_float_vs_converted_table_and_files(qir: Qir, model: Model, tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "calib.npy", x)
    out = tmp_path / "sim"
    r = qir(
        "similarity",
        model("tiny"),
        *SHAPE,
        "--calib-data",
        str(tmp_path / "calib.npy"),
        "--out",
        str(out),
        "--threshold",
        "0.5",
    )
    assert r.code == 0, r.err
    assert "float vs converted" in r.out and "compared on the first batch of" in r.out
    # The stubbed tiny model: fused conv-bn-relu at model.conv, the head, the output.
    for layer in ("model.conv", "model.pool", "model.head", "(output)"):
        assert layer in r.out
    assert "first layer below 0.5: (none)" in r.out
    data = json.loads((out / "similarity.json").read_text())
    assert data["stage_a"] == "float" and data["stage_b"] == "converted"
    assert (out / "similarity.png").is_file() and (out / "similarity.txt").is_file()


def test_prepared_vs_converted_without_plot(qir: Qir, model: Model, tmp_path: Path) -> None:
    r = qir("similarity", model("tiny"), *SHAPE, "--pair", "prepared,converted", "--out", str(tmp_path), "--no-plot")
    assert r.code == 0, r.err
    assert "RANDOM normal data" in r.out and "prepared vs converted" in r.out
    assert not (tmp_path / "similarity.png").exists()


def test_bad_pairs_are_one_line_errors(qir: Qir, model: Model, tmp_path: Path) -> None:
    r = qir("similarity", model("tiny"), *SHAPE, "--pair", "float", "--out", str(tmp_path))
    assert r.code == 1 and "--pair 'float'" in r.err and "Traceback" not in r.err
    r = qir("similarity", model("converted"), *SHAPE, "--out", str(tmp_path))
    assert r.code == 1 and "has no float stage" in r.err
