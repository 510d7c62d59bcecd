"""legalize: the pass contract, facts per node, row selection, fused parts, strict mode."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from passes import PassContext, parse_pipeline, run_pipeline
from passes.legality_facts import Domains, build_facts, rows_for, skip_reason, subject_of
from passes.legality_registry import get_table
from passes.legalize import (
    ADVISORY,
    RESULT_KEY,
    UNKNOWN,
    UNSUPPORTED,
    VIOLATION,
    LegalityError,
    LegalityResult,
    Legalize,
    check_graph,
)
from passes.registry import get_pass_class
from qir.frontend import trace
from qir.ir import Graph, Node
from qir.march import march_scope
from qir.nn.intrinsic import ConvAddReLU2d


def _node(g: Graph, name: str) -> Node:
    v = g.find(name)
    assert isinstance(v, Node)
    return v


def _facts(g: Graph, name: str) -> dict[str, Any]:
    return build_facts(subject_of(_node(g, name), g), g, Domains(outputs=frozenset(g.output_values)))


def _run(g: Graph, pipeline: str = "legalize{march=bayes}", ctx: PassContext | None = None) -> LegalityResult:
    ctx = ctx or PassContext()
    run_pipeline(g, pipeline, ctx=ctx, inplace=True)
    result = ctx.options[RESULT_KEY]
    assert isinstance(result, LegalityResult)
    return result


class Conv(nn.Module):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.conv = nn.Conv2d(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


# ----------------------------------------------------------------------------- the pass contract


def test_registered_and_parsed_from_pipeline_text() -> None:
    assert get_pass_class("legalize") is Legalize
    (p,) = parse_pipeline("legalize{march=bernoulli2 strict=true}")
    assert isinstance(p, Legalize) and p.march == "bernoulli2" and p.strict


def test_assume_dtype_sets_the_dtype_of_float_values() -> None:
    g = trace(nn.Sequential(nn.Linear(4, 4)), torch.randn(1, 4))
    errors = _run(g, "legalize{march=bayes assume_dtype=qint16}").errors
    # Bayes Linear takes qint8 only and gives qint8 or qint32
    assert {(f.rule, f.actual) for f in errors} == {("Input: qint8", "qint16"), ("Output: qint8, qint32", "qint16")}
    with pytest.raises(Exception, match="expected one of qint8, qint16"):
        parse_pipeline("legalize{assume_dtype=qint9}")


def test_reports_without_changing_the_graph() -> None:
    g = trace(Conv(3, 4, 3), torch.randn(1, 3, 8, 8))
    before = str(g)
    ctx = PassContext()
    res = run_pipeline(g, "legalize{march=bayes}", ctx=ctx)
    assert res.changed == (False,)
    assert str(res.graph) == before and str(g) == before
    assert ctx.options[RESULT_KEY].march == "bayes"
    assert "legalize.errors" in ctx.stats


def test_march_from_context_then_from_qir_march() -> None:
    g = trace(nn.Sequential(nn.Linear(4, 4)), torch.randn(1, 4))
    assert _run(g, "legalize", PassContext(options={"march": "BERNOULLI2"})).march == "bernoulli2"
    with march_scope("bayes"):
        assert _run(g, "legalize").march == "bayes"


def test_strict_raises_naming_node_module_and_rule() -> None:
    g = trace(nn.Sequential(nn.Linear(4, 4)), torch.randn(1, 4))
    with pytest.raises(Exception) as info:
        run_pipeline(g, "legalize{march=bernoulli2 strict=true}")
    err = info.value.__cause__ if not isinstance(info.value, LegalityError) else info.value
    assert isinstance(err, LegalityError)
    assert "%_0 (0)" in str(err) and "torch.nn.Linear is not supported on bernoulli2" in str(err)
    assert not err.result.ok


# ----------------------------------------------------------------------------- facts


def test_conv_facts() -> None:
    m = Conv(4, 6, (3, 5), stride=(1, 2), padding=(1, 2), dilation=1, groups=2, bias=True)
    g = trace(m, torch.randn(1, 4, 9, 9))
    f = _facts(g, "conv")
    assert f["in_channels"] == 4 and f["out_channels"] == 6 and f["groups"] == 2
    assert f["kernel"] == (3, 5) and f["stride"] == (1, 2) and f["padding"] == (1, 2) and f["dilation"] == (1, 1)
    assert (f["weight_n"], f["weight_c"], f["weight_h"], f["weight_w"]) == (6, 2, 3, 5)
    assert f["has_bias"] and f["bias_dtype"] == "qint32" and f["weight_dtype"] == "qint8"
    assert f["input_shape"] == (1, 4, 9, 9) and (f["input_n"], f["input_c"], f["input_h"], f["input_w"]) == (1, 4, 9, 9)
    assert f["input_dtype"] == f["output_dtype"] == "qint8"  # a float model: the dtype it would have
    assert f["is_model_output"] and not f["sumin"]


def test_same_padding_is_resolved() -> None:
    g = trace(Conv(1, 1, 5, padding="same", dilation=2), torch.randn(1, 1, 12, 12))
    assert _facts(g, "conv")["padding"] == (4, 4)


def test_linear_pool_interpolate_reduce_facts() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pool = nn.AvgPool2d(3, stride=2, padding=1)
            self.mp = nn.MaxPool2d(2)
            self.fc = nn.Linear(8, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.interpolate(self.mp(self.pool(x)), scale_factor=2.0, mode="bilinear")
            return self.fc(y.mean(dim=(-2, -1)))

    g = trace(M(), torch.randn(2, 8, 8, 8))
    assert _facts(g, "pool")["kernel"] == (3, 3) and _facts(g, "pool")["stride"] == (2, 2)
    assert _facts(g, "pool")["padding"] == (1, 1)
    assert _facts(g, "mp")["stride"] == (2, 2)  # stride defaults to the kernel
    f = _facts(g, "interpolate")
    assert f["mode"] == "bilinear" and f["align_corners"] is None and f["scale_factor"] == (2.0, 2.0)
    assert _facts(g, "mean")["reduce_dims"] == (2, 3)
    f = _facts(g, "fc")
    assert (f["in_features"], f["out_features"], f["is_model_output"]) == (8, 5, True)


def test_add_broadcast_and_constant_facts() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return (x + y) + 1.0

    g = trace(M(), (torch.randn(2, 3, 4, 4), torch.randn(1, 3, 1, 1)))
    f = _facts(g, "add")
    assert f["broadcast_input_count"] == 1 and f["broadcasts_batch"] is True and not f["has_constant_operand"]
    assert f["in_channels"] == 3 and f["input_count"] == 2
    assert _facts(g, "add_1")["has_constant_operand"] is True


def test_non_compute_nodes_are_skipped() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop, self.id = nn.Dropout(), nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = torch.split(self.drop(self.id(x)), 1, dim=1)
            return a * x.size(0) + b

    g = trace(M().eval(), torch.randn(1, 2, 4, 4))
    reasons = {n.name: skip_reason(n, g) for n in g.nodes}
    assert reasons["id_1"] == reasons["drop"] == "transparent"
    assert reasons["getitem"] == "element of a sequence"
    assert reasons["size"] == "no tensor result"
    assert reasons["split"] is None and reasons["mul"] is None


def test_mode_dependent_transparent_ops_follow_the_graph_mode() -> None:
    from qir.ir import TensorType
    from qir.ir.ops.vision import StochasticDepth

    for training, graph_training, skipped in [
        (False, True, True),
        (None, False, True),
        (None, True, False),
        (True, False, False),
    ]:
        g = Graph()
        g.training = graph_training
        x = g.add_input("x", TensorType((1, 2, 3, 3)))
        n = g.add_node(StochasticDepth(p=0.2, training=training), [x], TensorType((1, 2, 3, 3)))
        g.set_output(n)
        assert (skip_reason(n, g) == "transparent") is skipped


def test_reduce_dims_given_as_a_list() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mean([2, 3])

    g = trace(M(), torch.randn(1, 4, 3, 3))
    assert _facts(g, "mean")["reduce_dims"] == (2, 3)
    (f,) = _run(g, "legalize{march=bernoulli2}").errors
    assert (f.rule, f.actual) == ("Supports channel-wise mean only.", (2, 3))


# ----------------------------------------------------------------------------- rows


def test_spellings_match_case_insensitively() -> None:
    # the source spells torch.nn.Hardsigmoid as torch.nn.HardSigmoid
    g = trace(nn.Sequential(nn.Hardsigmoid()), torch.randn(1, 2, 2, 2))
    (f,) = _run(g, "legalize{march=bernoulli2}").errors
    assert (f.kind, f.spelling) == (UNSUPPORTED, "torch.nn.HardSigmoid")


def test_batch_norm_rows_follow_the_module_class() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn2, self.bn1 = nn.BatchNorm2d(3), nn.BatchNorm1d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn1(self.bn2(x).mean(dim=(2, 3)))

    g = trace(M().eval(), torch.randn(2, 3, 4, 4))
    table = get_table("bayes")
    rows, _ = rows_for(table, subject_of(_node(g, "bn2"), g))
    assert [r.spelling for r in rows] == ["torch.nn.BatchNorm2d"]
    rows, looked_up = rows_for(table, subject_of(_node(g, "bn1"), g))
    assert rows == () and looked_up == "torch.nn.BatchNorm1d"
    res = _run(g)
    (f,) = [f for f in res.findings if f.node == "bn1"]
    assert f.kind == UNKNOWN and f.scope == "bn1"


def test_function_and_method_rows_that_disagree_are_unknown() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return torch.max(x, dim=1)

    g = trace(M(), torch.randn(1, 3, 4, 4))
    res = _run(g, "legalize{march=bernoulli2}")
    (f,) = [f for f in res.findings if f.node == "max_1"]
    assert f.kind == UNKNOWN and "torch.max" in f.message and "torch.Tensor.max" in f.message


def test_unsupported_operator_names_the_replacement() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(x)

    res = _run(trace(M(), torch.rand(1, 1, 2, 2)), "legalize{march=bernoulli2}")
    (f,) = res.errors
    assert f.kind == UNSUPPORTED and f.spelling == "torch.sqrt" and "qir.nn.Sqrt" in f.message


def test_advisories_are_reported_not_passed() -> None:
    g = trace(nn.Sequential(nn.BatchNorm2d(3)).eval(), torch.randn(1, 3, 2, 2))
    res = _run(g, "legalize{march=bernoulli2}")
    assert res.ok
    (f,) = res.of_kind(ADVISORY)
    assert f.spelling == "torch.nn.BatchNorm2d" and "absorbed in QAT" in f.rule and f.ok is None


def test_quant_stubs_bound_the_quantized_region() -> None:
    from qir.quantization import DeQuantStub, QuantStub

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.dq, self.conv = QuantStub(scale=1 / 128), DeQuantStub(), nn.Conv2d(3, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(self.dq(self.conv(self.q(torch.abs(x)))))

    res = _run(trace(M(), torch.randn(1, 3, 2, 2)), "legalize{march=bernoulli2}")
    assert set(res.cpu_nodes) == {"abs_1", "sqrt"}  # float work outside the stubs: no BPU rows apply
    assert res.ok
    spellings = {f.spelling for f in res.findings}
    assert {"torch.quantization.QuantStub", "torch.quantization.DeQuantStub"} <= spellings


# ----------------------------------------------------------------------------- fused convs


class Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1, groups=c)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv(x) + x)


@pytest.mark.parametrize("channels, ok", [(2048, True), (2049, False)])
def test_fused_conv_add_checks_the_add_row(channels: int, ok: bool) -> None:
    g = trace(Residual(channels), torch.randn(1, channels, 1, 1))
    res = _run(g, "fuse,legalize{march=bernoulli2}")
    assert res.ok is ok
    if not ok:
        (f,) = res.errors
        assert (f.kind, f.node, f.spelling, f.rule) == (VIOLATION, "conv", "torch.add", "in_channel<=2048")
        assert (f.actual, f.bound) == (2049, 2048)


def test_opaque_fused_module_is_checked_as_its_conv_plus_add() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = ConvAddReLU2d(nn.Conv2d(3, 3, 40))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(x, x[:, :, :1, :1])

    res = _run(trace(M(), torch.randn(1, 3, 40, 40)))
    rules = {(f.spelling, f.rule) for f in res.errors}
    assert rules == {("torch.nn.Conv2d", "kernel<32"), ("torch.nn.Conv2d", "H, W<=31")}
    assert all(f.scope == "block" for f in res.errors)
    assert any(f.spelling == "torch.add" for f in res.findings)  # the add part was looked at


def test_subclass_of_a_torch_module_uses_its_row() -> None:
    class MyConv(nn.Conv2d):
        pass

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = MyConv(1, 9000, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(x)

    g = trace(M(), torch.randn(1, 1, 1, 1))
    res = check_graph(g, get_table("bayes"), "bayes")
    assert res.ok  # 9000 output channels: over 8192, but a model output may have 16384
    assert {f.spelling for f in res.findings} == {"torch.nn.Conv2d"}
