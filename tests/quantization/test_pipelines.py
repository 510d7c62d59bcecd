"""``pipeline=`` on prepare_qat_fx / fuse_fx / convert_fx / compile_model, and ``default_pipeline``."""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest
import torch
from torch import nn

import passes
from qir.ir.graph import Graph
from qir.ir.ops.elementwise import Relu, Relu6
from qir.ir.ops.shape import Permute
from qir.march import March, set_march
from qir.quantization import (
    STAGES,
    CompileError,
    DeQuantStub,
    FakeQuantState,
    QuantStub,
    compile_model,
    convert_fx,
    default_pipeline,
    fuse_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)


@passes.register_pass
@attrs.frozen
class _ReluToRelu6(passes.Pass):
    name: ClassVar[str] = "test-relu-to-relu6"
    summary: ClassVar[str] = "replace every relu by relu6 (test pass)"

    def apply(self, ctx: passes.PassContext, graph: Graph) -> bool:
        hits = [n for n in graph.nodes if isinstance(n.op, Relu)]
        for n in hits:
            n.op = Relu6()
        return bool(hits)


@passes.register_pass
@attrs.frozen
class _DropTranspose(passes.Pass):
    """``permute(0, 1, 3, 2)`` becomes ``permute(0, 1, 2, 3)``: same shape on square maps, other values."""

    name: ClassVar[str] = "test-drop-transpose"
    summary: ClassVar[str] = "make hw transposes identities (test pass)"

    def apply(self, ctx: passes.PassContext, graph: Graph) -> bool:
        hits = [n for n in graph.nodes if isinstance(n.op, Permute) and n.op.dims == (0, 1, 3, 2)]
        for n in hits:
            n.op = attrs.evolve(n.op, dims=(0, 1, 2, 3))
        return bool(hits)


@passes.register_pass
@attrs.frozen
class _Spy(passes.Pass):
    name: ClassVar[str] = "test-spy"
    summary: ClassVar[str] = "record the op names it sees (test pass)"

    def apply(self, ctx: passes.PassContext, graph: Graph) -> bool:
        ctx.options.setdefault("spy", []).append([n.op.name for n in graph.nodes])
        _SEEN.append([n.op.name for n in graph.nodes])
        return False


_SEEN: list[list[str]] = []


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.keep = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(self.relu(self.bn(self.conv(self.quant(x)))))
        return self.dequant(self.keep(y.permute(0, 1, 3, 2)))


@pytest.fixture(autouse=True)
def _bayes() -> None:
    set_march(March.BAYES)


def _x() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, 3, 16, 16) * 20


def _qat(pipeline: object = None) -> nn.Module:
    torch.manual_seed(1)
    x = _x()
    qat = prepare_qat_fx(Net(), {"": get_default_qat_qconfig()}, x, pipeline=pipeline)
    qat.train()
    qat(x)
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    return qat.eval()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_default_pipelines_print_and_parse_back(stage: str, march: str) -> None:
    p = default_pipeline(stage, march)
    assert passes.Pipeline.parse(str(p)) == p


def test_default_pipeline_texts() -> None:
    assert str(default_pipeline("prepare")) == "fuse{force_bn=true},dce,insert-observers"
    assert str(default_pipeline("convert")) == "quantize{march=bayes}"  # the current march
    assert str(default_pipeline("compile", "bernoulli2")) == "legalize{march=bernoulli2},lower{march=bernoulli2}"
    assert str(default_pipeline("compile")) == "legalize{march=bayes},lower{march=bayes}"  # the current march


def test_unknown_stage_names_the_stages() -> None:
    with pytest.raises(ValueError, match="prepare, convert, compile"):
        default_pipeline("train")


def test_bad_pipeline_text_fails_before_tracing() -> None:
    with pytest.raises(passes.PipelineError, match="nope"):
        prepare_qat_fx(Net(), {"": get_default_qat_qconfig()}, _x(), pipeline="fuse{nope=1}")
    with pytest.raises(TypeError, match="pipeline="):
        prepare_qat_fx(Net(), {"": get_default_qat_qconfig()}, _x(), pipeline=[1, 2])  # type: ignore[list-item]


def test_explicit_default_is_the_default() -> None:
    a, b = _qat(), _qat(default_pipeline("prepare"))
    assert a.state_dict().keys() == b.state_dict().keys()
    x = _x()
    assert torch.equal(a(x), b(x))


def test_user_pass_in_prepare_reaches_the_artifact() -> None:
    x = _x()
    qat = _qat(passes.Pipeline.parse("test-relu-to-relu6") + default_pipeline("prepare"))
    assert type(qat.conv).__name__ == "ConvReLU62d"  # fused with the relu6 the pass made
    int_model = convert_fx(qat)
    compiled = compile_model(int_model, [x])
    conv = [i for i in compiled.program.instructions if i.op == "conv2d"]
    assert [i.attrs["act"] for i in conv] == ["relu6"]
    y = compiled(x)
    assert torch.equal(y, int_model(x))
    assert float(y.max()) <= 6.0 and float(_qat()(x).detach().max()) > 6.5  # without the pass the range is wider


def test_prepare_pipeline_without_fuse_leaves_batch_norm_alone() -> None:
    fused = fuse_fx(Net(), _x(), pipeline="dce")
    assert isinstance(fused.bn, nn.BatchNorm2d) and isinstance(fused.conv, nn.Conv2d)
    assert not isinstance(fuse_fx(Net(), _x()).bn, nn.BatchNorm2d)


def test_convert_and_compile_stages_run_the_same_rewrite() -> None:
    x = _x()
    qat = _qat()
    plain = convert_fx(qat)
    rewritten = convert_fx(qat, pipeline="test-drop-transpose", example_inputs=x)
    assert not torch.equal(rewritten(x), plain(x))  # the pass changed what the model computes
    compiled = compile_model(plain, [x], pipeline="test-drop-transpose")
    assert torch.equal(compiled(x), rewritten(x))  # the changed graph is what got lowered
    assert torch.equal(compile_model(plain, [x])(x), plain(x))


def test_convert_pipeline_that_changes_nothing_keeps_the_module() -> None:
    qat = _qat()
    _SEEN.clear()
    out = convert_fx(qat, pipeline="test-spy", example_inputs=_x())
    assert _SEEN and "permute" in _SEEN[0]
    assert torch.equal(out(_x()), convert_fx(qat)(_x()))


def test_compile_appends_legalize_when_checking() -> None:
    x = _x()
    plain = convert_fx(_qat())
    _SEEN.clear()
    compile_model(plain, [x], pipeline="test-spy")
    assert len(_SEEN) == 1

    class Head(nn.Module):  # Linear is not in the Bernoulli2 table
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()
            self.fc = nn.Linear(8, 4)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.fc(self.quant(t)))

    set_march(March.BERNOULLI2)
    xb = torch.randn(4, 8)
    qat = prepare_qat_fx(Head(), {"": get_default_qat_qconfig()}, xb)
    qat(xb)
    bad = convert_fx(qat.eval())
    with pytest.raises(CompileError, match="not legal on bernoulli2"):
        compile_model(bad, [xb], pipeline="test-spy")
    with pytest.raises(CompileError, match="not legal on bernoulli2"):
        compile_model(bad, [xb])
    compiled = compile_model(bad, [xb], pipeline="test-spy", check=False)  # no legalize appended without check
    assert torch.equal(compiled(xb), bad(xb))
