"""check_model and compile_model of eager-converted models fx cannot trace.

Each model goes calibrate -> QAT (from the calibrated state dict) -> convert -> check -> compile
-> run, and the artifact equals the converted model bit for bit on the example it was recorded
on (and on other inputs of the same shape)."""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.ao.quantization import DeQuantStub

from backends.common.runtime import InputError
from qir.frontend import trace
from qir.frontend.record import SpecializationError, record, trace_or_record
from qir.march import march_scope
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    QuantStub,
    check_model,
    compile_model,
    convert,
    fuse_known_modules,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    integer_grid_report,
    load_compiled,
    perf_model,
    prepare_calibration,
    prepare_qat,
    set_exact_validation,
    set_fake_quantize,
    set_integer_grid,
    visualize_model,
)


@pytest.fixture(autouse=True)
def _bayes() -> Iterator[None]:
    with march_scope("bayes"):
        yield


def _cbr(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


def _fuse_cbr(model: nn.Module) -> None:
    """Fuse every conv + bn + relu Sequential of ``model`` (as users list them for fuse_modules)."""
    groups = [
        [f"{p}.0", f"{p}.1", f"{p}.2"]
        for p, m in model.named_modules()
        if isinstance(m, nn.Sequential) and [type(c) for c in m] == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU]
    ]
    if groups:
        torch.ao.quantization.fuse_modules(model, groups, inplace=True, fuser_func=fuse_known_modules)


def _randomize_bn(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.3, 0.3)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    return model


def _flow(make: Callable[[], nn.Module], batches: list[torch.Tensor]) -> tuple[nn.Module, nn.Module]:
    """Calibrate, start QAT from the calibrated state dict, train two steps, convert.
    Returns (the QAT model in eval, the converted model)."""
    torch.manual_seed(0)
    base = _randomize_bn(make()).eval()
    _fuse_cbr(base)
    calib_model = copy.deepcopy(base)
    calib_model.qconfig = get_default_calib_qconfig()  # type: ignore[assignment]
    calib = prepare_calibration(calib_model)
    with torch.no_grad():
        for x in batches:
            calib(x)
    qat_model = copy.deepcopy(base)
    qat_model.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    qat = prepare_qat(qat_model)
    qat.load_state_dict(calib.state_dict(), strict=True)
    qat.train()
    opt = torch.optim.SGD(qat.parameters(), lr=1e-3)
    for x in batches[:2]:
        out = qat(x)
        loss = sum(o.square().mean() for o in (out if isinstance(out, (list, tuple)) else [out]))
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    qat.eval()
    with torch.no_grad():
        for x in batches:  # eval-mode records: what the converted model computes
            qat(x)
    return qat, convert(qat)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    assert isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
    return all(_equal(x, y) for x, y in zip(a, b, strict=True))


def _untraceable(model: nn.Module) -> None:
    with pytest.raises(Exception, match="control flow"):
        torch.fx.symbolic_trace(model)


# --------------------------------------------------------------------------- FPN levels in a list


class FPNDetector(nn.Module):
    """As many pyramid levels as the input allows (down to 4 pixels), collected in a Python list;
    one head and one DeQuantStub per level (codes carry no scale in eager mode, so one quantized
    DeQuantStub cannot serve levels of different scales: eager convert refuses that)."""

    def __init__(self, levels: int = 4) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.stem = _cbr(3, 8)
        self.downs = nn.ModuleList([_cbr(8, 8, stride=2) for _ in range(levels - 1)])
        self.heads = nn.ModuleList([nn.Conv2d(8, 6, 1) for _ in range(levels)])
        self.dequants = nn.ModuleList([DeQuantStub() for _ in range(levels)])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        feats = [self.stem(self.quant(x))]
        while feats[-1].shape[-1] > 4 and len(feats) < len(self.heads):
            feats.append(self.downs[len(feats) - 1](feats[-1]))
        outs = []
        for f, head, dequant in zip(feats, self.heads, self.dequants, strict=False):
            outs.append(dequant(head(f).flatten(2)))
        return outs


def test_fpn_head_over_a_python_list_of_levels() -> None:
    qat, converted = _flow(FPNDetector, [torch.randn(2, 3, 32, 32) for _ in range(3)])
    _untraceable(converted)
    x = torch.randn(1, 3, 32, 32)
    report = check_model(converted, x)
    assert report.ok
    assert any("`while feats[-1].shape[-1] > 4" in s for s in report.specialized)
    compiled = compile_model(converted, [x], opt=1)
    assert _equal(compiled(x), converted(x)) and len(compiled(x)) == 4
    set_fake_quantize(qat, "validation")  # the QAT model validates as the integer model
    assert _equal(qat(x), compiled(x))
    other = torch.randn(1, 3, 32, 32) * 2
    assert _equal(compiled(other), converted(other))
    spec = compiled.program.meta["specialized"]
    assert any("shape = [1, 8, 32, 32], [1, 8, 16, 16], [1, 8, 8, 8], [1, 8, 4, 4]" in line for line in spec)
    assert compiled.program.meta["exact_input_shapes"] is True
    # a 16x16 input takes a shorter path: three levels, compiled as its own program
    small = torch.randn(1, 3, 16, 16)
    compiled_small = compile_model(converted, [small], opt=1)
    assert len(compiled_small(small)) == 3 and _equal(compiled_small(small), converted(small))
    with pytest.raises(InputError, match=r"exactly.*specialized"):
        compiled(small)
    with pytest.raises(InputError, match="exactly"):
        compiled(torch.randn(2, 3, 32, 32))  # the batch too: the path read sizes


# --------------------------------------------------------------------------- a branch on a size


class SizeBranch(nn.Module):
    """Large inputs are pooled once more before the body: ``if x.shape[-1] > 32``."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.stem = _cbr(3, 8)
        self.pool = nn.MaxPool2d(2)
        self.body = _cbr(8, 16)
        self.head = nn.Conv2d(16, 4, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(self.quant(x))
        if x.shape[-1] > 32:
            x = self.pool(x)
        return self.dequant(self.head(self.body(x)))


def test_branch_on_a_size_compiles_per_branch(tmp_path: object) -> None:
    batches = [torch.randn(2, 3, 48, 48), torch.randn(2, 3, 24, 24), torch.randn(2, 3, 48, 48)]
    _, converted = _flow(SizeBranch, batches)
    _untraceable(converted)
    big, small = torch.randn(1, 3, 48, 48), torch.randn(1, 3, 24, 24)
    assert check_model(converted, big).ok and check_model(converted, small).ok
    path = f"{tmp_path}/big.hbm"
    compiled_big = compile_model(converted, [big], hbm=path, opt=1)
    compiled_small = compile_model(converted, [small], opt=1)
    loaded = load_compiled(path)
    assert torch.equal(loaded(big), converted(big)) and torch.equal(compiled_small(small), converted(small))
    assert loaded.program.meta["exact_input_shapes"] is True
    pools = [sum(i.op == "maxpool2d" for i in c.program.instructions) for c in (compiled_big, compiled_small)]
    assert pools == [1, 0]  # each program holds the branch its example took
    assert any("`if x.shape[-1] > 32:`" in line for line in loaded.program.meta["specialized"])
    # as the seeds call it: a torch.jit.trace of the converted model compiles the module it traced
    with torch.no_grad():
        traced = torch.jit.trace(converted, big)
    assert torch.equal(compile_model(traced, [big], opt=1)(big), converted(big))


# --------------------------------------------------------------------------- range(len(self.blocks))


class Stages(nn.Module):
    """``for i in range(len(self.blocks))``: a residual FloatFunctional add (not fused) wherever the
    block keeps the shape, decided by comparing shapes in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.blocks = nn.ModuleList([_cbr(3, 8), _cbr(8, 8), _cbr(8, 16, stride=2), _cbr(16, 16)])
        self.adds = nn.ModuleList([FloatFunctional() for _ in self.blocks])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Conv2d(16, 5, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        for i in range(len(self.blocks)):
            y = self.blocks[i](x)
            x = self.adds[i].add(y, x) if y.shape == x.shape else y
        return self.dequant(self.fc(self.pool(x)).flatten(1))


def test_range_len_blocks_with_float_functional_adds(tmp_path: Path) -> None:
    _, converted = _flow(Stages, [torch.randn(4, 3, 16, 16) for _ in range(3)])
    _untraceable(converted)
    x = torch.randn(2, 3, 16, 16)
    report = check_model(converted, x)
    assert report.ok and "Checked the path the forward took" in str(report)
    compiled = compile_model(converted, [x], opt=1)
    assert torch.equal(compiled(x), converted(x))
    graph, spec = trace_or_record(converted, x)
    assert spec is not None and spec.exact_shapes
    adds = [n.scope for n in graph.nodes if n.op.name == "qadd"]
    assert adds == ["adds.1", "adds.3"]  # the blocks that keep the shape
    # perf_model and visualize_model lower the same recorded path and name its modules
    profile = perf_model(converted, x, out_dir=str(tmp_path))
    svg = visualize_model(converted, x, save_path=f"{tmp_path}/stages.svg")
    assert "adds.3" in str(profile) and "adds.3" in svg.read_text()


# --------------------------------------------------------------------------- fused adds, traceable


class ResNetTiny(nn.Module):
    """conv + bn + relu fused; a residual block fused at its FloatFunctional add; a traceable forward."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.stem = _cbr(3, 8)
        self.conv1 = _cbr(8, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.add = FloatFunctional()
        self.relu = nn.ReLU()
        self.head = nn.Conv2d(8, 4, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(self.quant(x))
        y = self.bn2(self.conv2(self.conv1(x)))
        return self.dequant(self.head(self.relu(self.add.add(y, x))))


def _resnet_tiny() -> nn.Module:
    m = ResNetTiny()
    torch.ao.quantization.fuse_modules(m, ["conv2", "bn2", "add", "relu"], inplace=True, fuser_func=fuse_known_modules)
    return m


def test_recorded_graph_equals_the_symbolic_trace_on_a_traceable_model() -> None:
    _, converted = _flow(_resnet_tiny, [torch.randn(2, 3, 12, 12) for _ in range(3)])
    x = torch.randn(1, 3, 12, 12)
    symbolic = trace(converted, x)
    fx_graph, spec, out = record(converted, (x,))
    assert torch.equal(out, converted(x)) and not spec.exact_shapes and spec.repeated == ()
    _, none = trace_or_record(converted, x)
    assert none is None  # traceable: the symbolic trace is used
    from qir.frontend.convert import _Converter, propagate

    replayed = _Converter(converted, propagate(converted, fx_graph, (x,))).run(fx_graph)
    assert str(replayed) == str(symbolic)
    compiled = compile_model(converted, [x], opt=1)
    assert "specialized" not in compiled.program.meta
    batch = torch.randn(3, 3, 12, 12)
    assert torch.equal(compiled(batch), converted(batch))  # a symbolic trace keeps the batch free


# --------------------------------------------------------------------------- refusals


class ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.stem = _cbr(3, 4)
        self.head = nn.MaxPool2d(3, 1, 1)
        self.peek = DeQuantStub()
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(self.quant(x))
        if self.peek(x).mean() > 0.5:
            x = self.head(x)
        return self.dequant(x)


def test_a_decision_on_tensor_values_is_refused_naming_the_line() -> None:
    _, converted = _flow(ValueBranch, [torch.randn(2, 3, 8, 8) for _ in range(2)])
    x = torch.randn(1, 3, 8, 8)
    with pytest.raises(SpecializationError, match=r"(?s)`if self.peek\(x\).mean\(\) > 0.5:`: Tensor.__bool__ reads"):
        check_model(converted, x)
    with pytest.raises(SpecializationError, match=r"torch\.where"):
        compile_model(converted, [x])


class Stateful(nn.Module):
    """A forward that is not a function of its inputs: a call counter decides whether to pool."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.a = nn.Conv2d(3, 4, 1)
        self.pool = nn.MaxPool2d(3, 1, 1)
        self.dequant = DeQuantStub()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.a(self.quant(x))
        if x.shape[-1] > 2 and self.calls % 2:
            x = self.pool(x)
        return self.dequant(x)


def test_a_path_that_does_not_replay_is_refused() -> None:
    _, converted = _flow(Stateful, [torch.randn(2, 3, 4, 4) for _ in range(4)])
    with pytest.raises(Exception, match="does not reproduce"):
        compile_model(converted, [torch.randn(1, 3, 4, 4)])


# --------------------------------------------------------------------------- QAT validation


def test_eager_qat_validation_is_the_converted_model() -> None:
    qat, converted = _flow(Stages, [torch.randn(4, 3, 16, 16) for _ in range(3)])
    x = torch.randn(16, 3, 16, 16)
    set_fake_quantize(qat, "validation")
    want = converted(x)
    assert torch.equal(qat(x), want)
    assert torch.equal(compile_model(converted, [x], opt=1)(x), want)
    # float fake quantization (opted out): up to an LSB per layer, compounding
    set_exact_validation(qat, False)
    with torch.no_grad():
        simulated = qat(x)
    lsb = float(converted.fc.scale.max())
    assert not torch.equal(simulated, want) and (simulated - want).abs().max() <= 8 * lsb
    set_exact_validation(qat, True)
    # copies keep it; the twin follows the model's state
    assert torch.equal(copy.deepcopy(qat)(x), want)
    assert torch.equal(pickle.loads(pickle.dumps(qat))(x), want)
    with torch.no_grad():
        qat.fc.weight.mul_(1.5)
    assert torch.equal(qat(x), convert(qat)(x)) and not torch.equal(qat(x), want)
    # the converted model has no validating forward of its own
    assert "forward" not in converted.__dict__ and "forward" not in convert(qat).__dict__


def test_eager_validation_of_a_loaded_checkpoint_before_any_forward() -> None:
    """A fresh QAT model that loaded a checkpoint has recorded no forward, so an untraceable one
    cannot convert yet: its first validation forward runs float fake quantization (with a
    warning) and records, the next ones are exact."""
    trained, converted = _flow(SizeBranch, [torch.randn(2, 3, 48, 48), torch.randn(2, 3, 24, 24)])
    torch.manual_seed(0)
    base = _randomize_bn(SizeBranch()).eval()
    _fuse_cbr(base)
    base.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    qat = prepare_qat(base)
    qat.load_state_dict(trained.state_dict(), strict=True)
    qat.eval()
    set_fake_quantize(qat, "validation")
    x = torch.randn(1, 3, 48, 48)
    with pytest.warns(RuntimeWarning, match="convert failed"):
        qat(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = qat(x)
    assert torch.equal(got, converted(x))


# --------------------------------------------------------------------------- the recorder on plain modules


class _Rows(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([r * 2 + 1 for r in x])


class _Writes(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.zeros_like(x)
        if x.shape[-1] > 2:
            y[:, :1] = x[:, :1]
        return y


class _Outside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.offset = torch.ones(1)  # a plain attribute, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : x.shape[1] // 2] + self.offset


def test_recorder_iterates_rows_and_refuses_writes_and_unnamed_tensors() -> None:
    from qir.frontend import TraceError, emit

    x = torch.randn(3, 2, 4)
    graph, spec = trace_or_record(_Rows(), x)  # fx cannot iterate a proxy
    assert spec is not None and any("unbind gives a number of tensors set by a size = 3" in r for r in spec.size_reads)
    assert torch.equal(emit(graph)(x), _Rows()(x))
    with pytest.raises(TraceError, match=r"(?s)_Writes.forward at .*`y\[:, :1\] = x\[:, :1\]`.*torch\.where"):
        record(_Writes(), (x,))
    with pytest.raises(TraceError, match="register it as a buffer"):
        record(_Outside(), (x,))


# --------------------------------------------------------------------------- training on the integer grid


@pytest.mark.parametrize(
    ("make", "shape"),
    [(SizeBranch, (2, 3, 48, 48)), (_resnet_tiny, (2, 3, 12, 12)), (FPNDetector, (2, 3, 32, 32))],
    ids=["size_branch", "fused_add", "fpn_list"],
)
def test_eager_training_steps_are_the_converted_model(make: Callable[[], nn.Module], shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    base = _randomize_bn(make()).eval()
    _fuse_cbr(base)
    base.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    qat = prepare_qat(base).train()
    g = torch.Generator().manual_seed(0)
    qat(torch.randn(*shape, generator=g))  # the first forward records which module feeds which
    report = integer_grid_report(qat)
    assert report and set(report.values()) == {"grid"}, report
    opt = torch.optim.SGD(qat.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        x = torch.randn(*shape, generator=g)
        y = qat(x)
        assert _equal(y, convert(qat)(x))  # each step computes what its state deploys
        loss = sum(o.square().mean() for o in (y if isinstance(y, list) else [y]))
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    set_integer_grid(qat, False)
    assert set(integer_grid_report(qat).values()) == {"integer grid off"}
    x = torch.randn(*shape, generator=g)
    with torch.no_grad():
        assert not _equal(qat(x), convert(qat)(x))  # float fake quantization: LSBs apart
