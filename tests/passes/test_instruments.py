"""Instruments: hook order, timing, IR dumps and printing, failure notifications."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from manager_fixtures import small_graph

from passes import (
    DumpIRInstrument,
    Instrument,
    Pass,
    PassContext,
    PassFailure,
    PipelineResult,
    PrintIRInstrument,
    TimingInstrument,
    run_pipeline,
)
from passes.pipeline import Pipeline
from qir.ir import Graph

try:
    from qir.ir.printer import print_graph
except ImportError:  # the printer is another module's work; text checks wait for it
    print_graph = None  # type: ignore[assignment]


class Recorder(Instrument):
    def __init__(self, tag: str, log: list[str]) -> None:
        self.tag = tag
        self.log = log

    def run_before_pipeline(self, pipeline: Pipeline, graph: Graph, ctx: PassContext) -> None:
        self.log.append(f"{self.tag}:start {pipeline}")

    def run_before_pass(self, pass_: Pass, graph: Graph, ctx: PassContext) -> None:
        self.log.append(f"{self.tag}:before {pass_}")

    def run_after_pass(self, pass_: Pass, graph: Graph, ctx: PassContext, changed: bool) -> None:
        self.log.append(f"{self.tag}:after {pass_} {changed}")

    def run_after_pass_failed(self, pass_: Pass, graph: Graph, ctx: PassContext, error: BaseException) -> None:
        self.log.append(f"{self.tag}:failed {pass_} {type(error).__name__}")

    def run_after_pipeline(self, result: PipelineResult) -> None:
        self.log.append(f"{self.tag}:end {result.changed}")


def test_hooks_fire_in_nested_order() -> None:
    log: list[str] = []
    run_pipeline(small_graph(), "dce,pm-count-ops", instruments=[Recorder("a", log), Recorder("b", log)])
    assert log == [
        "a:start dce,pm-count-ops",
        "b:start dce,pm-count-ops",
        "a:before dce",
        "b:before dce",
        "b:after dce True",
        "a:after dce True",
        "a:before pm-count-ops",
        "b:before pm-count-ops",
        "b:after pm-count-ops False",
        "a:after pm-count-ops False",
        "b:end (True, False)",
        "a:end (True, False)",
    ]


def test_failed_hook_replaces_after_hook() -> None:
    log: list[str] = []
    with pytest.raises(PassFailure):
        run_pipeline(small_graph(), "dce,pm-boom", instruments=[Recorder("a", log), Recorder("b", log)])
    assert log[-4:] == [
        "a:before pm-boom",
        "b:before pm-boom",
        "b:failed pm-boom PassFailure",
        "a:failed pm-boom PassFailure",
    ]


def test_verification_failure_notifies_the_outer_instruments() -> None:
    log: list[str] = []
    with pytest.raises(PassFailure):
        run_pipeline(small_graph(), "pm-corrupt", instruments=[Recorder("a", log)])
    # the verifier runs innermost, so no other instrument saw the corrupt graph as a success
    assert log[-1] == "a:failed pm-corrupt PassVerificationFailure"
    assert "a:after pm-corrupt True" not in log


def test_timing_instrument_accumulates_and_reports() -> None:
    timing = TimingInstrument()
    first = run_pipeline(small_graph(), "remove-identity,dce", instruments=[timing])
    run_pipeline(small_graph(), "dce", instruments=[timing])
    assert [name for name, _ in timing.timings] == ["remove-identity", "dce", "dce"]
    assert timing.timings[:2] == list(first.timings)  # the manager's apply-only measurement
    assert timing.total == pytest.approx(sum(t for _, t in timing.timings))
    report = timing.report()
    lines = report.splitlines()
    assert lines[0].split() == ["pass", "runs", "seconds", "%"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["dce"][1] == "2" and rows["remove-identity"][1] == "1"
    assert rows["total"][1] == "3" and rows["total"][-1] == "100.0"
    assert str(timing) == report
    timing.reset()
    assert timing.timings == [] and timing.total == 0.0


def test_dump_ir_writes_one_numbered_file_per_pass(tmp_path: Path) -> None:
    dump = DumpIRInstrument(tmp_path / "dumps")
    result = run_pipeline(small_graph(), "remove-identity,dce,pm-count-ops", instruments=[dump])
    names = sorted(p.name for p in (tmp_path / "dumps").iterdir())
    assert names == ["00-remove-identity.qir", "01-dce.qir", "02-pm-count-ops.qir"]
    assert dump.paths == [tmp_path / "dumps" / n for n in names]
    text = (tmp_path / "dumps" / "00-remove-identity.qir").read_text()
    assert "unused" in text and "ident" not in text.replace("remove-identity", "")
    if print_graph is None:
        pytest.skip("qir.ir.printer is not available: dump contents use the fallback listing")
    assert (tmp_path / "dumps" / "02-pm-count-ops.qir").read_text().rstrip("\n") == print_graph(result.graph)


def test_dump_ir_numbers_widen_for_long_pipelines(tmp_path: Path) -> None:
    dump = DumpIRInstrument(tmp_path)
    run_pipeline(small_graph(), ",".join(["pm-count-ops"] * 101), instruments=[dump], verify_each=False)
    assert dump.paths[0].name == "000-pm-count-ops.qir" and dump.paths[-1].name == "100-pm-count-ops.qir"


def test_dump_ir_writes_the_failed_graph(tmp_path: Path) -> None:
    dump = DumpIRInstrument(tmp_path)
    with pytest.raises(PassFailure):
        run_pipeline(small_graph(), "dce,pm-corrupt", instruments=[dump])
    assert [p.name for p in dump.paths] == ["00-dce.qir", "01-pm-corrupt.failed.qir"]
    if print_graph is None:
        pytest.skip("qir.ir.printer is not available")
    assert "9x9" in (tmp_path / "01-pm-corrupt.failed.qir").read_text()


def test_print_ir_after_all() -> None:
    out = io.StringIO()
    run_pipeline(small_graph(), "dce,pm-count-ops", instruments=[PrintIRInstrument(stream=out)])
    text = out.getvalue()
    assert text.count("// ----- IR after ") == 2
    assert "// ----- IR after dce -----\n" in text
    assert "// ----- IR after pm-count-ops (unchanged) -----\n" in text
    if print_graph is not None:
        assert text.rstrip("\n").endswith(print_graph(run_pipeline(small_graph(), "dce").graph).rstrip("\n"))


def test_print_ir_filters() -> None:
    out = io.StringIO()
    printer = PrintIRInstrument(after_all=True, before_all=True, stream=out, only=["dce"], only_changed=True)
    run_pipeline(small_graph(), "dce,pm-count-ops,dce", instruments=[printer])
    headers = [line for line in out.getvalue().splitlines() if line.startswith("// -----")]
    assert headers == [
        "// ----- IR before dce -----",
        "// ----- IR after dce -----",
        "// ----- IR before dce -----",  # the second dce changes nothing: no after dump
    ]


def test_print_ir_defaults_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    run_pipeline(small_graph(), "dce", instruments=[PrintIRInstrument()])
    assert "// ----- IR after dce -----" in capsys.readouterr().err
