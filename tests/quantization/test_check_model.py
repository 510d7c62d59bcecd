"""check_model: verdicts on a resnet-like model, the printed report, advice, and every
numeric bound of the tables checked on both sides with real tiny modules."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qir.march import march_scope
from qir.quantization import DeQuantStub, LegalityReport, QuantStub, check_model


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class TinyResNet(nn.Module):
    """conv/bn/relu/maxpool, residual adds, adaptive avgpool, flatten, linear: resnet18's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(Block(8, 8, 1), Block(8, 8, 1))
        self.layer2 = nn.Sequential(Block(8, 16, 2), Block(16, 16, 1))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


@pytest.fixture(scope="module")
def tiny() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TinyResNet().eval(), torch.randn(1, 3, 32, 32)


def test_bernoulli2_refuses_linear_and_adaptive_avgpool(tiny: tuple[nn.Module, torch.Tensor]) -> None:
    model, x = tiny
    report = check_model(model, x, march="bernoulli2")
    assert not report.ok
    assert {(v.module, v.spelling, v.kind) for v in report.violations} == {
        ("fc", "torch.nn.Linear", "unsupported"),
        ("avgpool", "torch.nn.AdaptiveAvgPool2d", "unsupported"),
    }
    assert report.unsupported == report.violations
    assert all(v.ok is False for v in report.violations)
    assert {v.node for v in report.violations} == {"fc", "avgpool"}


def test_bayes_accepts_it_with_advisories(tiny: tuple[nn.Module, torch.Tensor]) -> None:
    model, x = tiny
    report = check_model(model, x, march="bayes")
    assert report.ok and report.violations == ()
    assert report.advisories and all(a.ok is None for a in report.advisories)
    assert {a.spelling for a in report.advisories} >= {"torch.nn.BatchNorm2d", "torch.nn.AdaptiveAvgPool2d"}
    # torch.flatten is in neither table: reported, not silently passed
    assert [(u.node, u.kind) for u in report.unknown] == [("flatten", "unknown")]


def test_report_prints_an_aligned_table_with_fixes(
    tiny: tuple[nn.Module, torch.Tensor], capsys: pytest.CaptureFixture[str]
) -> None:
    model, x = tiny
    report = check_model(model, x, march="bernoulli2", advice=1)
    printed = capsys.readouterr().out
    assert printed.strip() == str(report)
    lines = printed.splitlines()
    assert lines[0].startswith("qir check_model: march bernoulli2: FAILED - 2 error(s)")
    header = next(line for line in lines if line.strip().startswith("kind"))
    fc = next(line for line in lines if "%fc" in line)
    assert fc.index("torch.nn.Linear") == header.index("operator")  # columns line up
    text = "\n".join(lines)
    assert "use Conv2d 1x1 instead of Linear: nn.Conv2d(16, 10, kernel_size=1)" in text
    assert "nn.AvgPool2d(kernel_size=(4, 4), stride=(4, 4))" in text
    assert "hybrid_dict={'module_name': ['fc']}" in text


def test_advice_level_2_shows_the_facts_read(capsys: pytest.CaptureFixture[str]) -> None:
    check_model(nn.Sequential(nn.AvgPool2d(8)), torch.randn(1, 2, 8, 8), march="bernoulli2", advice=2)
    assert "      facts: kernel=(8, 8)" in capsys.readouterr().out


def test_no_advice_no_print(tiny: tuple[nn.Module, torch.Tensor], capsys: pytest.CaptureFixture[str]) -> None:
    model, x = tiny
    report = check_model(model, x, march="bernoulli2")
    assert capsys.readouterr().out == ""
    assert all(v.advice == () for v in report.findings)


def test_adaptive_pool_advice_checks_the_avgpool_bounds() -> None:
    model = nn.Sequential(nn.AdaptiveAvgPool2d(1))
    report = check_model(model, torch.randn(1, 2, 14, 14), march="bernoulli2", advice=True)
    (v,) = report.violations
    assert "kernel_size=(14, 14)" in v.advice[0] and "but it breaks: 1<=kernel<=7" in v.advice[0]
    assert "pool in steps: AvgPool2d((7, 7)) then AvgPool2d((2, 2))" in v.advice[0]


def test_docs_legality_md_examples_run(capsys: pytest.CaptureFixture[str]) -> None:
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "legality.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, "docs/legality.md", "exec"), {"__name__": "docs_example"})
    assert "FAILED" in capsys.readouterr().out


def test_pool_window_advice_splits_into_steps() -> None:
    report = check_model(nn.Sequential(nn.AvgPool2d(8)), torch.randn(1, 2, 8, 8), march="bernoulli2", advice=1)
    (v,) = report.violations
    assert v.rule == "1<=kernel<=7"
    assert v.advice[0].startswith("pool in steps: AvgPool2d((4, 4)) then AvgPool2d((2, 2))")
    report = check_model(nn.Sequential(nn.AvgPool2d(11)), torch.randn(1, 2, 11, 11), march="bernoulli2", advice=1)
    assert report.violations[0].advice[0].startswith("change %_0 so that 1 <= kernel <= 7 holds")


def test_split_advice_for_channel_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 10000, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x) + 1.0

    report = check_model(M(), torch.randn(1, 1, 1, 1), march="bayes", advice=1)
    out = [v for v in report.violations if v.rule == "out_channel<=8192"]
    assert out and out[0].module == "conv" and (out[0].actual, out[0].bound) == (10000, 8192)
    assert "split the layer: output channels 10000 > 8192 -> 2 Conv2ds of 5000 output channels each" in out[0].advice[0]


def test_int16_and_eager_advice_on_lookup_ops() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.exp(x)

    report = check_model(M(), torch.randn(1, 1, 2, 2), march="bayes", advice=2)
    (a,) = report.advisories
    assert any("use qint16 instead of qint8" in s for s in a.advice)
    assert any("in eager mode use qir.nn.Exp()" in s for s in a.advice)


def test_rules_on_facts_a_float_model_lacks_are_reported_unchecked() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.floor(x)

    report = check_model(M(), torch.randn(1, 1, 2, 2), march="bayes", advice=1)
    assert report.ok
    (u,) = report.unknown
    assert (u.kind, u.ok, u.rule) == ("unchecked", None, "Int8 inputs should not exceed 1e6 in magnitude")
    assert "input_abs_max" in u.message
    assert any("use qint16 instead of qint8" in a for a in u.advice)


def test_unsupported_function_gets_a_cpu_fix() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(x)

    report = check_model(M(), torch.rand(1, 1, 2, 2), march="bernoulli2", advice=1)
    (v,) = report.unsupported
    assert v.module is None and "DeQuantStub before and a QuantStub after %sqrt" in v.advice[0]


def test_march_defaults_to_qir_march(tiny: tuple[nn.Module, torch.Tensor]) -> None:
    model, x = tiny
    with march_scope("bernoulli2"):
        assert check_model(model, x).march == "bernoulli2"


def test_no_march_is_a_clear_error(tiny: tuple[nn.Module, torch.Tensor]) -> None:
    from qir import march as qmarch

    if qmarch.get_march(default=None) is not None:
        pytest.skip("a process-wide march is set")
    with pytest.raises(RuntimeError, match="no march is set"):
        check_model(tiny[0], tiny[1])


@pytest.mark.filterwarnings("ignore:`torch.jit.trace")
def test_a_jit_trace_is_checked_as_the_module_it_was_traced_from(tiny: tuple[nn.Module, torch.Tensor]) -> None:
    model, x = tiny
    traced = torch.jit.trace(model, x)
    direct = check_model(model, x, march="bernoulli2")
    via_trace = check_model(traced, x, march="bernoulli2")
    assert not via_trace.ok
    assert via_trace.violations == direct.violations  # the same findings, named by module path
    assert {v.module for v in via_trace.violations} == {"fc", "avgpool"}


@pytest.mark.filterwarnings("ignore:`torch.jit.trace")
def test_a_trace_whose_module_is_gone_is_a_clear_error(tmp_path: Any) -> None:
    from qir.quantization.jit_source import TracedSourceError

    model, x = nn.Sequential(nn.Conv2d(1, 2, 1)).eval(), torch.randn(1, 1, 4, 4)
    path = tmp_path / "m.pt"
    torch.jit.save(torch.jit.trace(model, x), str(path))
    loaded = torch.jit.load(str(path))  # fresh tensors: no live module shares them
    with pytest.raises(TracedSourceError, match="check_model: the module this TorchScript module was traced"):
        check_model(loaded, x, march="bayes")


def test_the_model_is_not_changed() -> None:
    torch.manual_seed(1)
    model = TinyResNet().train()
    before = copy.deepcopy(model.state_dict())
    check_model(model, torch.randn(2, 3, 32, 32), march="bayes")
    assert model.training
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_report_views() -> None:
    report = check_model(nn.Sequential(nn.Linear(4, 4), nn.Dropout()).eval(), torch.randn(1, 4), march="bernoulli2")
    assert isinstance(report, LegalityReport)
    assert report.for_module("0") == report.violations
    assert report.checked == 1  # dropout in eval is optimized out


# ----------------------------------------------------------------------------- QAT and converted models


class Deployable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from qir.quantization import DeQuantStub, QuantStub

        self.quant, self.body, self.dequant = QuantStub(scale=1 / 128), TinyResNet(), DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.body(self.quant(x)))


def _flow(march: str, out_qconfig: bool = False) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    from qir.quantization import convert_fx, get_default_qat_out_qconfig, get_default_qat_qconfig, prepare_qat_fx

    torch.manual_seed(0)
    x = torch.randn(1, 3, 32, 32)
    qconfig: dict[str, Any] = {"": get_default_qat_qconfig()}
    if out_qconfig:
        qconfig["module_name"] = {"body.fc": get_default_qat_out_qconfig()}
    with march_scope(march):
        qat = prepare_qat_fx(Deployable().eval(), qconfig, x)
        qat.train()
        qat(x)
        qat.eval()
        return qat, convert_fx(qat), x


@pytest.mark.parametrize("march", ["bernoulli2", "bayes"])
def test_qat_and_converted_models_get_the_float_verdicts(march: str) -> None:
    qat, converted, x = _flow(march)
    for model in (qat, converted):
        report = check_model(model, x, march=march)
        errors = {(v.module, v.spelling) for v in report.violations}
        if march == "bernoulli2":
            assert errors == {("body.fc", "torch.nn.Linear"), ("body.avgpool", "torch.nn.AdaptiveAvgPool2d")}
        else:
            assert errors == set()
        spellings = {f.spelling for f in report.findings}
        assert {"torch.quantization.QuantStub", "torch.quantization.DeQuantStub"} <= spellings
        assert [u.node for u in report.unknown] == ["flatten"]  # every QAT / integer module has its row


def test_converted_high_precision_linear_output_on_bayes() -> None:
    # legal: the plugin runs Linear as a 1x1 conv, and Bayes convs give qint32 (docs/operators.md)
    _, converted, x = _flow("bayes", out_qconfig=True)
    assert check_model(converted, x, march="bayes").violations == ()


class _Upsample(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.up = nn.ConvTranspose2d(3, 4, 2, stride=2)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.up(self.quant(x)))


def test_converted_high_precision_output_refused_on_bayes_with_advice() -> None:
    from qir.quantization import convert_fx, get_default_qat_out_qconfig, get_default_qat_qconfig, prepare_qat_fx

    x = torch.randn(1, 3, 8, 8)
    with march_scope("bayes"):
        qat = prepare_qat_fx(
            _Upsample(), {"": get_default_qat_qconfig(), "module_name": {"up": get_default_qat_out_qconfig()}}
        )
        qat(x)
        qat.eval()
        report = check_model(convert_fx(qat), x, advice=1)
    (v,) = report.violations
    assert (v.module, v.rule, v.actual, v.bound) == ("up", "Output: qint8", "qint32", ("qint8",))
    assert "get_default_qat_qconfig() instead of get_default_qat_out_qconfig()" in v.advice[0]


# ----------------------------------------------------------------------------- bounds


def _conv(cin: int, cout: int, k: int, size: int, **kw: Any) -> tuple[nn.Module, torch.Tensor]:
    # channel counts are cheap with a 1x1 input; the input is one pixel larger than the window
    return nn.Sequential(nn.Conv2d(cin, cout, k, **kw), nn.ReLU()), torch.randn(1, cin, size, size)


class Add(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x * 2


Build = Callable[[int], tuple[nn.Module, torch.Tensor]]
#: (march, rule text, build(value), largest legal value): the seed's numbers, not the tables'.
BOUNDS: dict[str, tuple[str, str, Build, int]] = {
    "bayes conv out_channels": ("bayes", "out_channel<=8192", lambda v: _conv(1, v, 1, 1), 8192),
    "bayes conv in_channels": ("bayes", "Input channel<=8192", lambda v: _conv(v, 1, 1, 1), 8192),
    "bayes conv kernel": ("bayes", "kernel<32", lambda v: _conv(1, 1, v, v), 31),
    "bayes conv dilation": ("bayes", "dilation<=16", lambda v: _conv(1, 1, 2, v + 1, dilation=v), 16),
    "bayes conv stride with dilation": (
        "bayes",
        "stride=1 when dilation!=1",
        lambda v: _conv(1, 1, 2, 8, dilation=2, stride=v),
        1,
    ),
    "bayes linear in_features": (
        "bayes",
        "in_features <= 8192",
        lambda v: (nn.Sequential(nn.Linear(v, 1)), torch.randn(1, v)),
        8192,
    ),
    "bayes linear out_features": (
        "bayes",
        "out_features <= 8192.",
        lambda v: (nn.Sequential(nn.Linear(1, v), nn.ReLU()), torch.randn(1, 1)),
        8192,
    ),
    "bayes maxpool kernel": (
        "bayes",
        "1<=kernel, stride<=256",
        lambda v: (nn.Sequential(nn.MaxPool2d(v, stride=1)), torch.randn(1, 1, v, v)),
        256,
    ),
    "bernoulli2 avgpool kernel": (
        "bernoulli2",
        "1<=kernel<=7",
        lambda v: (nn.Sequential(nn.AvgPool2d(v)), torch.randn(1, 1, v, v)),
        7,
    ),
    "bernoulli2 avgpool stride": (
        "bernoulli2",
        "1<=stride<=185",
        lambda v: (nn.Sequential(nn.AvgPool2d(1, stride=v)), torch.randn(1, 1, 1, 1)),
        185,
    ),
    "bernoulli2 add in_channels": ("bernoulli2", "in_channel<=2048", lambda v: (Add(), torch.randn(1, v, 1, 1)), 2048),
}


@st.composite
def bound_cases(draw: st.DrawFn) -> tuple[str, int]:
    name = draw(st.sampled_from(sorted(BOUNDS)))
    limit = BOUNDS[name][3]
    value = draw(st.one_of(st.integers(-1, 2).map(lambda d: limit + d), st.integers(1, limit + 40)))
    return name, max(value, 1)


def _verdict(name: str, value: int) -> bool:
    march, rule, build, _ = BOUNDS[name]
    model, x = build(value)
    report = check_model(model, x, march=march)
    return not any(v.rule == rule for v in report.violations)


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_each_bound_flips_exactly_at_the_limit(name: str) -> None:
    limit = BOUNDS[name][3]
    assert _verdict(name, limit) is True
    assert _verdict(name, limit + 1) is False


@settings(max_examples=40, deadline=None)
@given(bound_cases())
def test_bounds_on_both_sides(case: tuple[str, int]) -> None:
    name, value = case
    assert _verdict(name, value) is (value <= BOUNDS[name][3])
