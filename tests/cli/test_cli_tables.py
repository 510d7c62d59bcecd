"""qir ops / passes / opt: the tables and the IR tool."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from cli_helpers import Result

Qir = Callable[..., Result]


def test_ops_filter_and_unsupported(qir: Qir) -> None:
    r = qir("ops", "--march", "bernoulli2", "--filter", "linear")
    assert r.code == 0
    assert "torch.nn.Linear" in r.out and "not_supported" in r.out
    assert all("linear" in line.split()[0].lower() for line in r.out.splitlines()[3:] if line[:4].strip())
    r = qir("ops", "--march", "bernoulli2", "--unsupported")
    assert r.code == 0 and "torch.nn.Linear" in r.out and " supported " not in r.out
    r = qir("ops", "--filter", "conv2d")
    assert "march bayes" in r.out and "torch.nn.Conv2d" in r.out and "supported" in r.out
    r = qir("ops", "--filter", "no-such-op")
    assert r.code == 0 and "0 of" in r.out


def test_passes_lists_options(qir: Qir) -> None:
    r = qir("passes")
    assert r.code == 0 and "absorb-bn" in r.out and "legalize" in r.out


def test_passes_prints_the_default_pipelines(qir: Qir) -> None:
    import passes
    from qir.quantization import default_pipeline

    r = qir("passes", "--pipelines", "--march", "bernoulli2")
    assert r.code == 0, r.err
    rows = dict(line.split(None, 1) for line in r.out.splitlines())
    assert set(rows) == {"prepare", "convert", "compile"}
    assert rows["compile"] == "legalize{march=bernoulli2},lower{march=bernoulli2}"
    assert rows["convert"] == "quantize{march=bernoulli2}"
    assert passes.Pipeline.parse(rows["prepare"]) == default_pipeline("prepare")
    bad = qir("passes", "--pipelines", "--march", "x3000")
    assert bad.code != 0 and "x3000" in bad.err and "Traceback" not in bad.err


def test_opt_runs_a_pipeline_on_ir_text(qir: Qir, tmp_path: Path) -> None:
    from qir.frontend import trace
    from qir.ir.printer import print_graph

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).eval()
    src = tmp_path / "m.qir"
    src.write_text(print_graph(trace(model, (torch.randn(1, 3, 8, 8),))))
    r = qir("opt", str(src), "-p", "absorb-bn,fuse,dce", "--time-passes")
    assert r.code == 0, r.err
    assert "batch_norm" not in r.out and "act=" in r.out
    assert "absorb-bn" in r.err  # the timing report
    qir("opt", str(tmp_path / "none.qir")).assert_user_error("none.qir")
    qir("opt", str(src), "-p", "no-such-pass").assert_user_error("no-such-pass")
