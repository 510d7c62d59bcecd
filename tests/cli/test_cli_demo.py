"""``qir demo --fast``: the whole flow on the real digits, one table, every file written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import Result

Qir = Callable[..., Result]


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_demo_fast(qir: Qir, tmp_path: Path, march: str) -> None:
    out = tmp_path / "demo"
    r = qir("demo", "--fast", "--threads", "1", "--no-progress", "--march", march, "--out", str(out))
    assert r.code == 0, r.err
    for stage in (
        "float",
        "calibrated",
        "QAT",
        "integer (converted)",
        "QAT vs integer argmax",
        "legality",
        "compile",
        "artifact (loaded)",
        "artifact == integer",
        "perf",
        "visualize",
        "total",
    ):
        assert f"\n  {stage} " in r.out, stage
    assert "yes: torch.equal on all 449 test logits" in r.out
    assert f"PASSED on {march}" in r.out
    for name in ("digits.hbm", "legality.txt", "perf.txt", "perf.json", "model.svg", "float.qir", "summary.txt"):
        assert (out / name).is_file(), name
    assert (out / "summary.txt").read_text() == r.out
    # QAT evaluated in validation mode computes what the integer model computes: every prediction agrees
    agree = float(r.out.split("agree on ")[1].split("%")[0])
    assert agree == 100.0, r.out


def test_demo_bad_options(qir: Qir, tmp_path: Path) -> None:
    qir("demo", "--march", "x5").assert_user_error("--march")
    qir("demo", "--epochs", "-1").assert_user_error("--epochs")
    blocker = tmp_path / "file"
    blocker.write_text("")
    qir("demo", "--out", str(blocker / "sub")).assert_user_error("output folder")
