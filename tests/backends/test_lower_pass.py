"""The ``lower`` pass and the IR walk: op rules by IR op name, march overrides, the legacy
adapter, the compile pipeline compile_model builds, and what the pass leaves in the context."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.fx
from bitexact_models import digits_net, fx_converted
from torch import nn

import backends.common.lower as lower_mod
import passes
from backends.common.lower import LowerContext, LoweringError, op_rule, register_op_rule, shape_call
from backends.common.lower_ir import lower_ir
from backends.common.lower_pass import PROGRAM_KEY, Lower
from backends.common.program import Program
from qir.frontend import trace
from qir.ir.graph import Node
from qir.ir.op import IRError
from qir.ir.printer import print_graph
from qir.ir.types import UNKNOWN_DIM, TensorType
from qir.quantization import compile_model
from qir.quantization.compile import compile_pipeline

SHAPE = (2, 1, 28, 28)


def permuted(converted: nn.Module) -> torch.fx.GraphModule:
    """A copy of a converted GraphModule whose output is permuted: a layout op in the integer graph."""
    gm = copy.deepcopy(converted)
    assert isinstance(gm, torch.fx.GraphModule)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        p = gm.graph.call_method("permute", (out.args[0], 1, 0))
    out.args = (p,)
    gm.recompile()
    return gm


@pytest.fixture(scope="module")
def digits() -> nn.Module:
    return fx_converted(digits_net(width=4), SHAPE, "bayes", batches=2)


def test_lower_pass_stores_the_program_and_keeps_the_graph(digits: nn.Module) -> None:
    x = torch.randn(*SHAPE)
    graph = trace(digits, (x,))
    before = print_graph(graph)
    ctx = passes.PassContext(options={"example_inputs": (x,)})
    result = passes.run_pipeline(graph, "lower{march=bayes opt=0}", ctx=ctx, inplace=True)
    assert result.changed == (False,)
    assert print_graph(graph) == before
    program = ctx.options[PROGRAM_KEY]
    assert isinstance(program, Program) and program.march == "bayes" and program.meta["opt"] == 0
    assert ctx.stats["lower.instructions"] == len(program.instructions)
    # the same Program compile_model builds, and bit-exact with the converted model
    compiled = compile_model(digits, [x], opt=0)
    assert [i.op for i in compiled.program.instructions] == [i.op for i in program.instructions]
    assert torch.equal(compiled(x), digits(x))


def test_lower_pass_needs_example_inputs(digits: nn.Module) -> None:
    graph = trace(digits, (torch.randn(*SHAPE),))
    with pytest.raises(passes.PassFailure, match=r"lower needs example inputs in ctx.options\['example_inputs'\]"):
        passes.run_pipeline(graph, "lower{march=bayes}")


def test_lower_pass_options_parse_and_print() -> None:
    (p,) = passes.Pipeline.parse("lower{march=bernoulli2 opt=0}")
    assert p == Lower(march="bernoulli2", opt=0)
    assert str(passes.Pipeline((p,))) == "lower{march=bernoulli2 opt=0}"
    with pytest.raises(passes.PipelineError, match="opt"):
        passes.Pipeline.parse("lower{opt=9}")


def test_compile_pipeline_appends_lower_and_legalize() -> None:
    assert str(compile_pipeline(None, "bayes", 2, check=True)) == "legalize{march=bayes},lower{march=bayes}"
    assert str(compile_pipeline(None, "bayes", 0, check=False)) == "lower{march=bayes opt=0}"
    assert str(compile_pipeline("dce", "bernoulli2", 2, check=True)) == (
        "dce,legalize{march=bernoulli2},lower{march=bernoulli2}"
    )
    assert str(compile_pipeline("dce", "bayes", 1, check=False)) == "dce,lower{march=bayes opt=1}"
    # a pipeline that ends with lower keeps its own; legalize goes before it
    assert str(compile_pipeline("dce,lower{opt=0}", "bayes", 2, check=True)) == (
        "dce,legalize{march=bayes},lower{opt=0}"
    )


def test_register_op_rule_refuses_an_unknown_op() -> None:
    with pytest.raises(ValueError, match="'permutte' is not a registered IR op"):
        register_op_rule("permutte", lambda ctx, node, operands: operands[0])


def test_a_march_rule_overrides_the_common_one(digits: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def bayes_permute(ctx: LowerContext, node: Node, operands: list[Any]) -> Any:
        seen.append(node.name)
        op: Any = node.op
        return shape_call(ctx, node, "transpose", [operands[0], *op.dims])  # a 2-d permute is a transpose

    monkeypatch.setitem(lower_mod._OP_RULES, ("bayes", "permute"), bayes_permute)
    assert op_rule("bayes", "permute") is bayes_permute
    assert op_rule("bernoulli2", "permute") is lower_mod._OP_RULES[("*", "permute")]
    model, x = permuted(digits), torch.randn(*SHAPE)
    compiled = compile_model(model, [x], march="bayes", opt=0, check=False)
    assert seen == ["permute"]
    fns = [i.attrs.get("fn") for i in compiled.program.instructions if i.op == "shape_fn"]
    assert "transpose" in fns and "permute" not in fns
    assert torch.equal(compiled(x), model(x))


def test_unknown_op_names_the_node_and_its_module() -> None:
    model, x = nn.Sequential(nn.Hardshrink()).eval(), torch.randn(2, 3)
    graph = trace(model, (x,))
    with pytest.raises(
        LoweringError, match=r"node '_0': module '0' \(torch\.nn\..*Hardshrink\) has no lowering rule on bayes"
    ):
        lower_ir(graph, [x], "bayes")


def test_wrong_number_of_example_inputs_is_named(digits: nn.Module) -> None:
    graph = trace(digits, (torch.randn(*SHAPE),))
    with pytest.raises(LoweringError, match=r"takes 1 input\(s\) \(x\), got 2 example input\(s\)"):
        lower_ir(graph, [torch.randn(*SHAPE)] * 2, "bayes")


def test_an_ir_error_in_a_rule_names_the_node(digits: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(ctx: LowerContext, node: Node, operands: list[Any]) -> Any:
        raise IRError("op 'flatten': no torch call for these operands")

    monkeypatch.setitem(lower_mod._OP_RULES, ("bayes", "flatten"), broken)
    x = torch.randn(*SHAPE)
    with pytest.raises(LoweringError, match=r"node 'flatten': op 'flatten': no torch call"):
        lower_ir(trace(digits, (x,)), [x], "bayes", opt=0)


def test_lower_refuses_a_graph_with_unknown_sizes(digits: nn.Module) -> None:
    x = torch.randn(*SHAPE)
    graph = trace(digits, (x,))
    first = graph.inputs[0]
    assert isinstance(first.type, TensorType)
    first.type = first.type.with_shape((UNKNOWN_DIM, *first.type.shape[1:]))  # as typed without example inputs
    ctx = passes.PassContext(options={"example_inputs": (x,)})
    with pytest.raises(passes.PassFailure) as info:
        passes.run_pipeline(graph, "lower{march=bayes opt=0}", ctx=ctx, inplace=True)
    assert f"%{first.name} is tensor<?x1x28x28" in str(info.value.__cause__)
    assert "type it from the example inputs first" in str(info.value.__cause__)
