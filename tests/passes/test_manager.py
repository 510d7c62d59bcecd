"""PassManager: results, copy vs in-place, failure wrapping, verification between passes."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from manager_fixtures import Boom, Corrupt, CountOps, codes_graph, node_names, small_graph

from passes import (
    BUILTIN_PASSES,
    PassContext,
    PassFailure,
    PassManager,
    PassVerificationFailure,
    Pipeline,
    PipelineError,
    VerifyInstrument,
    get_pass_class,
    run_pipeline,
)
from qir.ir import IRError, VerifyError, run_graph


def test_result_reports_each_pass() -> None:
    result = PassManager("remove-identity,dce,pm-count-ops").run(small_graph())
    assert result.changed == (True, True, False)
    assert result.any_changed
    assert [name for name, _ in result.timings] == ["remove-identity", "dce", "pm-count-ops"]
    assert all(seconds >= 0 for _, seconds in result.timings)
    assert result.stats["remove-identity.removed"] == 1
    assert result.stats["dce.removed"] == 1
    assert result.stats["ops.relu"] == 1 and "ops.identity" not in result.stats
    assert [str(r.pass_) for r in result.records] == ["remove-identity", "dce", "pm-count-ops"]
    assert str(result.pipeline) == "remove-identity,dce,pm-count-ops"


def test_passes_keep_meaning() -> None:
    g = small_graph()
    x = torch.randn(2, 4)
    result = run_pipeline(g, "remove-identity,dce")
    assert node_names(result.graph) == ["fc_weight", "fc_bias", "fc", "act", "sum"]
    torch.testing.assert_close(run_graph(result.graph, x), run_graph(g, x))


def test_input_graph_untouched_by_default() -> None:
    g = small_graph()
    before = str(g)
    result = run_pipeline(g, "remove-identity,dce")
    assert result.graph is not g
    assert str(g) == before
    assert "ident" in node_names(g) and "unused" in node_names(g)


def test_inplace_mutates_and_returns_the_same_graph() -> None:
    g = small_graph()
    result = run_pipeline(g, "remove-identity,dce", inplace=True)
    assert result.graph is g
    assert "ident" not in node_names(g) and "unused" not in node_names(g)


def test_accepts_text_pipeline_and_instances() -> None:
    dce = get_pass_class("dce")()
    for spec in ("dce,pm-count-ops", Pipeline.parse("dce,pm-count-ops"), [dce, CountOps()]):
        assert str(PassManager(spec).pipeline) == "dce,pm-count-ops"
    assert str(PassManager(dce).pipeline) == "dce"
    assert repr(PassManager("dce")) == "PassManager('dce')"
    with pytest.raises(TypeError, match="a pipeline holds Pass instances"):
        PassManager(["dce"])  # type: ignore[list-item]


def test_bad_pipeline_fails_before_running() -> None:
    g = small_graph()
    with pytest.raises(PipelineError, match="unknown pass 'nope'"):
        run_pipeline(g, "dce,nope", inplace=True)
    assert "unused" in node_names(g)


def test_failure_names_pass_options_and_predecessors() -> None:
    with pytest.raises(PassFailure) as info:
        run_pipeline(small_graph(), 'dce,pm-options{n=4},pm-boom{message="bad thing"},pm-count-ops')
    e = info.value
    message = str(e)
    assert isinstance(e, IRError)
    assert message.startswith(
        "pass 'pm-boom{message=\"bad thing\"}' (#3 of 4 in "
        "'dce,pm-options{n=4},pm-boom{message=\"bad thing\"},pm-count-ops') raised ValueError: bad thing"
    )
    assert 'options: message="bad thing"' in message
    assert "passes run before it: dce (changed), pm-options{n=4} (no change)" in message
    assert "input graph is untouched" in message
    assert isinstance(e.__cause__, ValueError) and str(e.__cause__) == "bad thing"
    assert e.pass_ == Boom(message="bad thing")
    assert e.index == 2
    assert [p.name for p in e.previous] == ["dce", "pm-options"]
    assert "unused" not in node_names(e.graph)  # the graph as the failing pass saw it


def test_failure_of_first_pass_in_place() -> None:
    g = small_graph()
    with pytest.raises(PassFailure) as info:
        run_pipeline(g, "pm-boom", inplace=True)
    message = str(info.value)
    assert "passes run before it: none (it ran first)" in message
    assert "modified in place up to the failure" in message
    assert info.value.graph is g


def test_pass_must_return_a_bool() -> None:
    with pytest.raises(PassFailure, match=r"returned None from apply\(\); apply\(\) must return True"):
        run_pipeline(small_graph(), "pm-returns-none")


def test_verification_blames_the_pass() -> None:
    with pytest.raises(PassVerificationFailure) as info:
        run_pipeline(small_graph(), "dce,pm-corrupt,pm-count-ops")
    e = info.value
    assert isinstance(e, PassFailure)
    assert str(e).startswith("pass 'pm-corrupt' (#2 of 3 in 'dce,pm-corrupt,pm-count-ops') left a graph that")
    assert "%act" in str(e) and "passes run before it: dce (changed)" in str(e)
    assert isinstance(e.error, VerifyError) and e.error.node == "act"
    assert isinstance(e.__cause__, VerifyError)
    assert e.pass_ == Corrupt()


def test_verify_each_off_lets_corruption_through() -> None:
    result = run_pipeline(small_graph(), "pm-corrupt", verify_each=False)
    assert result.changed == (True,)
    with pytest.raises(VerifyError):
        from qir.ir import verify

        verify(result.graph)


def test_invalid_input_is_reported_before_any_pass() -> None:
    g = small_graph()
    Corrupt().apply(PassContext(), g)
    with pytest.raises(VerifyError, match=r"the input graph does not verify \(before any pass ran\): %act"):
        run_pipeline(g, "dce")


def test_verify_input_off_skips_the_input_graph_only() -> None:
    g = small_graph()
    Corrupt().apply(PassContext(), g)  # a broken input: only the check of the input graph would see it
    skip = VerifyInstrument(verify_input=False)
    skip.run_before_pipeline(Pipeline.parse("dce"), g, PassContext())
    with pytest.raises(VerifyError, match="the input graph does not verify"):
        VerifyInstrument().run_before_pipeline(Pipeline.parse("dce"), g, PassContext())
    with pytest.raises(PassVerificationFailure):  # what a pass leaves is still verified
        run_pipeline(small_graph(), "pm-corrupt", instruments=[skip])


def test_one_verify_instrument_only() -> None:
    mine = VerifyInstrument(check_types=False)
    assert PassManager("dce", instruments=[mine]).instruments == (mine,)
    assert isinstance(PassManager("dce").instruments[-1], VerifyInstrument)
    assert PassManager("dce", verify_each=False).instruments == ()


def test_context_carries_history_and_options_across_runs() -> None:
    ctx = PassContext(options={"march": "bayes"})
    first = run_pipeline(small_graph(), "dce", ctx=ctx)
    second = run_pipeline(first.graph, "dce,pm-count-ops", ctx=ctx)
    assert [str(r.pass_) for r in ctx.history] == ["dce", "dce", "pm-count-ops"]
    assert second.changed == (False, False)  # only this run's passes
    assert ctx.ran("dce") and not ctx.ran("fuse")
    assert second.stats is ctx.stats and ctx.stats["dce.removed"] == 1


def test_remove_identity_keeps_graph_outputs() -> None:
    from qir.ir import DType, Graph, TensorType
    from qir.ir.ops.core import Identity

    g = Graph()
    x = g.add_input("x", TensorType((3,), DType.float32))
    g.set_output((g.add_node(Identity(), [x]), x))
    result = run_pipeline(g, "remove-identity")
    assert len(result.graph) == 0
    assert [v.name for v in result.graph.output_values] == ["x", "x"]


def test_docs_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every python block of docs/passes.md runs, in order, in one namespace."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "passes.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert blocks, "docs/passes.md has no python examples"
    monkeypatch.chdir(tmp_path)  # examples may write dump directories
    namespace: dict[str, object] = {"__name__": "docs_passes_md"}
    for block in blocks:
        exec(compile(block, str(doc), "exec", dont_inherit=True), namespace)  # no __future__ from here


@pytest.mark.parametrize("name", sorted(BUILTIN_PASSES))
def test_every_builtin_pass_runs_and_keeps_meaning(name: str) -> None:
    if importlib.util.find_spec(BUILTIN_PASSES[name]) is None:
        pytest.skip(f"{BUILTIN_PASSES[name]} is not written yet")
    from qir.march import march_scope

    g, x = (
        (codes_graph(), torch.randint(-128, 128, (2, 4), dtype=torch.int8))
        if name == "lower"
        else (small_graph(), torch.randn(2, 4))
    )
    ctx = PassContext(options={"example_inputs": (x,)})  # lower runs every kernel on them
    with march_scope("bayes"):  # march-dependent passes (legalize, lower) read the scoped march
        result = run_pipeline(g, f"{name},{name}", ctx=ctx)  # twice: the second run starts from its own output
    torch.testing.assert_close(run_graph(result.graph, x), run_graph(g, x))
    assert result.changed[1] is False, f"{name} is not idempotent on its own output"
    if name == "lower":  # the Program it stored computes what the graph does
        from backends.common.runtime import CompiledModel

        assert torch.equal(CompiledModel(ctx.options["lower.program"])(x), run_graph(g, x))
