"""Hybrid (CPU + BPU) preparation: placement, generated stubs, convert / check / compile of a hybrid model."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hybrid_models import ConvBNReLU, HybridModel, NoBPUForm, Residual, _SeluModule, seed_hybrid_dict
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import qir
from qir.nn import intrinsic, qat, quantized
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    hybrid_placement,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.hybrid import BPU, CPU, HybridPlan

QAT = get_default_qat_qconfig()
CALIB = get_default_calib_qconfig()
SHAPE = (1, 3, 16, 16)


def seed_flow(model: nn.Module) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Seed 003 steps 3-4: calibration (5 batches), then QAT with a high-precision conv1."""
    calibration_model = prepare_qat_fx(model, {"": CALIB}, hybrid=True, hybrid_dict=seed_hybrid_dict())
    calibration_model.eval()
    for _ in range(5):
        calibration_model(torch.rand(SHAPE))
    qat_model = prepare_qat_fx(
        calibration_model,
        {"": QAT, "module_name": [("conv1", get_default_qat_out_qconfig())]},
        hybrid=True,
        hybrid_dict=seed_hybrid_dict(),
    )
    return calibration_model, qat_model


def frozen(qat_model: torch.fx.GraphModule) -> torch.fx.GraphModule:
    qat_model.eval()
    set_fake_quantize(qat_model, "validation")
    return qat_model


def feeding(gm: torch.fx.GraphModule) -> list[tuple[str, list[str]]]:
    """(called module, the modules producing its inputs; 'input' for a model input), in graph order."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            out.append((str(n.target), [str(a.target) if a.op == "call_module" else a.op for a in n.all_input_nodes]))
    return out


# ---------------------------------------------------------------------------------------------- seed 003


def test_seed_placement() -> None:
    _, qat_model = seed_flow(HybridModel())
    plan = hybrid_placement(qat_model)
    cpu = [p.target for p in plan.on(CPU) if p.placed]
    assert cpu == ["selu", "selu", "layer1.conv", "conv0", "selu"]  # three selu call sites
    reasons = {p.target: p.reason for p in plan.placements}
    assert reasons["selu"] == "hybrid_dict module_type _SeluModule"
    assert reasons["layer1.conv"] == "hybrid_dict module_name 'layer1.conv'"
    assert reasons["conv0"] == "hybrid_dict module_name 'conv0'"
    assert [p.target for p in plan.on(BPU)] == ["layer0.0", "layer1.relu", "layer2.0", "conv1"]
    assert plan.cpu_modules() == ["selu", "layer1.conv", "conv0"]
    # the seed's trailing DeQuantStub receives selu's float output: an identity, on the CPU side
    assert reasons["dequant"] == "DeQuantStub of a float value: identity"
    text = str(plan)
    assert text.startswith("hybrid placement: 4 BPU, 6 CPU call(s)")
    assert "layer1.conv  Conv2d" in text and "generated stubs:" in text


def test_seed_stubs_sit_at_the_boundaries() -> None:
    _, qat_model = seed_flow(HybridModel())
    assert feeding(qat_model) == [
        ("selu", ["placeholder"]),  # first op on the CPU: no QuantStub needed
        ("layer0._generated_quant_0", ["selu"]),
        ("layer0.0", ["layer0._generated_quant_0"]),
        ("_generated_dequant_0", ["layer0.0"]),
        ("selu", ["_generated_dequant_0"]),
        ("layer1.conv", ["selu"]),  # CPU after CPU: no stubs
        ("layer1._generated_quant_0", ["layer1.conv"]),
        ("layer1.relu", ["layer1._generated_quant_0"]),
        ("layer2.0", ["layer1.relu"]),
        ("_generated_dequant_1", ["layer2.0"]),
        ("conv0", ["_generated_dequant_1"]),
        ("_generated_quant_0", ["conv0"]),
        ("conv1", ["_generated_quant_0"]),
        ("_generated_dequant_2", ["conv1"]),
        ("selu", ["_generated_dequant_2"]),
        ("dequant", ["selu"]),
    ]
    plan = hybrid_placement(qat_model)
    assert plan.stubs("quant") == ["layer0._generated_quant_0", "layer1._generated_quant_0", "_generated_quant_0"]
    assert plan.stubs("dequant") == ["_generated_dequant_0", "_generated_dequant_1", "_generated_dequant_2"]
    for path in plan.stubs("quant"):
        assert isinstance(qat_model.get_submodule(path), qat.QuantStub)
    for path in plan.stubs("dequant"):
        assert isinstance(qat_model.get_submodule(path), qat.DeQuantStub)


def test_seed_cpu_modules_stay_float_and_unfused() -> None:
    _, qat_model = seed_flow(HybridModel())
    assert type(qat_model.get_submodule("selu")) is _SeluModule
    assert type(qat_model.get_submodule("conv0")) is nn.Conv2d
    # layer1.conv (CPU) is not fused with layer1.relu (BPU); without hybrid they fuse
    assert type(qat_model.get_submodule("layer1.conv")) is nn.Conv2d
    assert isinstance(qat_model.get_submodule("layer1.relu"), qat.ReLU)
    plain = prepare_qat_fx(HybridModel(), {"": QAT})
    assert isinstance(plain.get_submodule("layer1.conv"), qat.ConvReLU2d)
    assert isinstance(qat_model.get_submodule("layer0.0"), qat.ConvReLU2d)  # BPU modules still fuse
    assert isinstance(qat_model.get_submodule("conv1"), qat.Conv2d)
    assert qat_model.get_submodule("conv1").activation_post_process is None  # high-precision output


def test_seed_calibrated_scales_carry_into_qat() -> None:
    calibration_model, qat_model = seed_flow(HybridModel())
    for path in hybrid_placement(qat_model).stubs("quant"):
        calibrated = calibration_model.get_submodule(path).activation_post_process
        started = qat_model.get_submodule(path).activation_post_process
        assert torch.equal(started.scale, calibrated.scale)
    calibrated = calibration_model.get_submodule("layer2.0").activation_post_process
    assert torch.equal(qat_model.get_submodule("layer2.0").activation_post_process.scale, calibrated.scale)


def test_seed_convert_matches_qat() -> None:
    _, qat_model = seed_flow(HybridModel())
    data = torch.rand(SHAPE)
    qat_model(data)  # one QAT step's observation, as the seed runs qat_model(data)
    frozen(qat_model)
    quantize_model = convert_fx(qat_model)
    with torch.no_grad():
        want, got = qat_model(data), quantize_model(data)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # conv1's input LSB: the last int8 scale before the float tail (conv1 -> selu)
    lsb = float(qat_model.get_submodule("_generated_quant_0").activation_post_process.scale)
    assert (got - want).abs().max() <= 2 * lsb
    assert (got - want).norm() <= 1e-2 * want.norm()
    # CPU modules run in float on dequantized inputs, BPU modules on codes
    assert type(quantize_model.get_submodule("conv0")) is nn.Conv2d
    assert isinstance(quantize_model.get_submodule("layer0.0"), quantized.ConvReLU2d)
    assert isinstance(quantize_model.get_submodule("_generated_dequant_0"), quantized.DeQuantStub)
    assert isinstance(quantize_model.get_submodule("layer0._generated_quant_0"), quantized.QuantStub)
    assert hybrid_placement(quantize_model).cpu_modules() == ["selu", "layer1.conv", "conv0"]


def test_seed_input_model_not_mutated() -> None:
    model = HybridModel()
    before = copy.deepcopy(model.state_dict())
    tree = repr(model)
    _, qat_model = seed_flow(model)
    convert_fx(frozen(qat_model))
    assert repr(model) == tree
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert qat_model.get_submodule("selu") is not model.selu and qat_model.get_submodule("conv0") is not model.conv0


def test_seed_literal_layer1_names_no_module() -> None:
    with pytest.raises(ValueError) as err:
        prepare_qat_fx(HybridModel(literal=True), {"": CALIB}, hybrid=True, hybrid_dict=seed_hybrid_dict())
    assert str(err.value) == (
        "hybrid_dict['module_name'] entry 'layer1.conv' names no module; modules under 'layer1': "
        "layer1.0 (Conv2d), layer1.1 (BatchNorm2d), layer1.2 (ReLU)"
    )


def test_check_model_lists_cpu_placements() -> None:
    _, qat_model = seed_flow(HybridModel())
    data = torch.rand(SHAPE)
    quantize_model = convert_fx(frozen(qat_model))
    for model in (quantize_model, qat_model):
        report = check_model(model, data)
        assert report.ok, str(report)
        assert not [f for f in report.findings if f.module in ("selu", "layer1.conv", "conv0", "dequant")]
        assert report.hybrid_cpu[:3] == (
            "selu (3 calls): hybrid_dict module_type _SeluModule",
            "layer1.conv (1 call): hybrid_dict module_name 'layer1.conv'",
            "conv0 (1 call): hybrid_dict module_name 'conv0'",
        )
        assert "Placed on the CPU (hybrid; float, not checked against the march):" in str(report)
    # BPU operators are still checked: conv1's findings come from the march table
    assert report.for_module("conv1")


def test_compile_model_runs_the_cpu_part_as_float_kernels(tmp_path: Path) -> None:
    """The CPU modules (a user module wrapping F.selu, called three times; two float convs) become the
    program's float part: float_fn steps calling the converted model's torch functions, bit for bit."""
    _, qat_model = seed_flow(HybridModel())
    data = torch.rand(SHAPE)
    quantize_model = convert_fx(frozen(qat_model))
    path = tmp_path / "hybrid.hbm"
    compile_model(quantize_model, [data], hbm=path)
    program = qir.load_compiled(path)
    fns = [i.attrs["fn"] for i in program.program.instructions if i.op == "float_fn"]
    assert fns == ["F.selu", "F.selu", "F.conv2d", "F.conv2d", "F.selu"]
    traced = compile_model(torch.jit.trace(quantize_model, data), [data])
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.rand(SHAPE, generator=g)
        want = quantize_model(x)
        assert torch.equal(program(x), want) and torch.equal(traced(x), want)


# ---------------------------------------------------------------------------------------------- rules


def test_named_parent_puts_its_children_on_the_cpu() -> None:
    model = Residual()
    prepared = prepare_qat_fx(model, {"": QAT}, hybrid=True, hybrid_dict={"module_name": ["branch"]})
    assert type(prepared.get_submodule("branch")) is ConvBNReLU  # one call, its forward as written
    assert isinstance(prepared.get_submodule("branch.1"), nn.BatchNorm2d)  # not folded into anything
    plan = hybrid_placement(prepared)
    assert plan.cpu_modules() == ["branch"]
    # the sigmoid after the CPU branch is BPU work (a generated module), so is the add joining the branch
    assert isinstance(prepared.get_submodule("_generated_sigmoid_0"), qat.UnaryLUT)
    assert isinstance(prepared.get_submodule("_generated_add_0"), qat.FloatFunctional)
    assert [b.stub for b in plan.boundaries if b.source == "branch"] == ["_generated_quant_1"]
    x = torch.randn(2, 3, 8, 8)
    prepared(x)
    converted = convert_fx(frozen(prepared))
    torch.testing.assert_close(converted(x), prepared(x), atol=0.05, rtol=0.05)


def test_functional_and_module_without_bpu_form_go_to_the_cpu() -> None:
    prepared = prepare_qat_fx(NoBPUForm(), {"": QAT}, hybrid=True)  # no hybrid_dict: automatic placement only
    plan = hybrid_placement(prepared)
    auto = [(p.target, p.kind, p.reason) for p in plan.placements if p.placed]
    assert auto == [("gn", "GroupNorm", "no BPU form"), ("cumsum", "function", "no BPU form")]
    # no QuantStub in the model: one is generated for the input; cumsum's float result leaves as it is
    assert feeding(prepared)[0] == ("_generated_quant_0", ["placeholder"])
    x = torch.randn(2, 3, 8, 8)
    prepared(x)
    converted = convert_fx(frozen(prepared))
    out = converted(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, prepared(x), atol=0.05, rtol=0.05)


def test_bpu_output_gets_a_generated_dequant() -> None:
    model = nn.Sequential(_SeluModule(), nn.Conv2d(3, 3, 1))
    prepared = prepare_qat_fx(model, {"": QAT}, hybrid=True, hybrid_dict={"module_type": [_SeluModule]})
    assert hybrid_placement(prepared).boundaries[-1].consumers == ("output",)
    x = torch.randn(1, 3, 4, 4)
    prepared(x)
    assert convert_fx(frozen(prepared))(x).dtype == torch.float32


def test_module_without_qconfig_receiving_codes_goes_to_the_cpu() -> None:
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1))
    prepared = prepare_qat_fx(model, {"": QAT, "module_name": {"1": None}}, hybrid=True)
    (p,) = [p for p in hybrid_placement(prepared).placements if p.placed]
    assert (p.target, p.reason) == ("1", "no qconfig (stays float)")


def test_cpu_float_functional_is_not_fused() -> None:
    from qir.nn.quantized import FloatFunctional

    class AddNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.add = FloatFunctional()
            self.head = nn.Conv2d(3, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.add.add(self.conv(x), x))

    prepared = prepare_qat_fx(AddNet(), {"": QAT}, hybrid=True, hybrid_dict={"module_name": ["add"]})
    assert isinstance(prepared.get_submodule("conv"), qat.Conv2d)  # not ConvAdd2d: the add is on the CPU
    assert type(prepared.get_submodule("add")) is FloatFunctional
    x = torch.randn(1, 3, 4, 4)
    prepared(x)
    torch.testing.assert_close(convert_fx(frozen(prepared))(x), prepared(x), atol=0.05, rtol=0.05)


def test_placement_errors() -> None:
    model = HybridModel()
    with pytest.raises(ValueError, match=r"module_type.*Linear matches no module of HybridModel"):
        prepare_qat_fx(model, {"": QAT}, hybrid=True, hybrid_dict={"module_type": [nn.Linear]})
    with pytest.raises(ValueError, match="names the whole model"):
        prepare_qat_fx(model, {"": QAT}, hybrid=True, hybrid_dict={"module_name": [""]})
    with pytest.raises(ValueError, match="matches the model itself"):
        prepare_qat_fx(model, {"": QAT}, hybrid=True, hybrid_dict={"module_type": [HybridModel]})
    with pytest.raises(ValueError, match=r"'conv1' \(Conv2d\) has no submodules: name 'conv1'"):
        prepare_qat_fx(model, {"": QAT}, hybrid=True, hybrid_dict={"module_name": ["conv1.weight"]})
    fused = nn.Sequential(intrinsic.ConvReLU2d(nn.Conv2d(3, 3, 1), nn.ReLU()))
    with pytest.raises(ValueError, match=r"lies inside '0' \(ConvReLU2d\), which is traced as one module"):
        prepare_qat_fx(fused, {"": QAT}, hybrid=True, hybrid_dict={"module_name": ["0.conv"]})
    with pytest.raises(ValueError, match="pass prepare_qat_fx"):
        prepare_qat_fx(model, {"": QAT}, hybrid_dict={"module_name": ["conv0"]})


def test_calibration_and_qat_must_agree_on_placement() -> None:
    calibrated = prepare_qat_fx(HybridModel(), {"": CALIB}, hybrid=True, hybrid_dict=seed_hybrid_dict())
    with pytest.raises(ValueError, match=r"prepared with hybrid=True.*has hybrid=False"):
        prepare_qat_fx(calibrated, {"": QAT})
    with pytest.raises(ValueError, match="calibration and QAT must agree"):
        prepare_qat_fx(calibrated, {"": QAT}, hybrid=True, hybrid_dict={"module_name": ["conv0"]})
    same = {"module_type": [_SeluModule], "module_name": ["conv0", "layer1.conv", "conv0"]}  # order, repeats
    prepare_qat_fx(calibrated, {"": QAT}, hybrid=True, hybrid_dict=same)


def test_qat_prepare_keeps_the_calibration_placement() -> None:
    class TwoSelus(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.selu = nn.SELU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.selu(self.conv(self.selu(x)))  # a module selu, then a functional one

    spec = {"module_type": [nn.SELU]}
    calibrated = prepare_qat_fx(TwoSelus(), {"": CALIB}, hybrid=True, hybrid_dict=spec)
    qat_model = prepare_qat_fx(calibrated, {"": QAT}, hybrid=True, hybrid_dict=spec)
    # the functional selu became a generated nn.SELU module in the first prepare: it stays on the BPU
    for model in (calibrated, qat_model):
        assert hybrid_placement(model).cpu_modules() == ["selu"]
        assert isinstance(model.get_submodule("_generated_selu_0"), qat.UnaryLUT)


def test_hybrid_placement_of_a_plain_model() -> None:
    with pytest.raises(ValueError, match="was not prepared with prepare_qat_fx"):
        hybrid_placement(prepare_qat_fx(HybridModel(), {"": QAT}))


# ---------------------------------------------------------------------------------------------- property


class Chain(nn.Module):
    """Layers in a row; ``res`` is ``x + conv(x)`` (a generated add joining the layer's input and output)."""

    def __init__(self, kinds: list[str], channels: int, quant: bool, dequant: bool) -> None:
        super().__init__()
        conv = lambda: nn.Conv2d(channels, channels, 1)
        make = {"conv": conv, "res": conv, "relu": nn.ReLU, "pool": lambda: nn.MaxPool2d(1), "selu": _SeluModule}
        self.kinds = kinds
        self.quant = QuantStub() if quant else None
        self.layers = nn.ModuleList(make[k]() for k in kinds)
        self.dequant = DeQuantStub() if dequant else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            x = self.quant(x)
        for kind, layer in zip(self.kinds, self.layers, strict=True):
            x = x + layer(x) if kind == "res" else layer(x)
        if self.dequant is not None:
            x = self.dequant(x)
        return x


@st.composite
def chains(draw: st.DrawFn) -> tuple[list[str], list[int], bool, bool, int]:
    kinds = draw(st.lists(st.sampled_from(["conv", "res", "relu", "pool", "selu"]), min_size=1, max_size=6))
    on_cpu = draw(st.lists(st.sampled_from(range(len(kinds))), unique=True))
    return kinds, sorted(on_cpu), draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2**16))


@given(chains())
def test_random_chains(case: tuple[list[str], list[int], bool, bool, int]) -> None:
    """Random CPU subsets: prepare never fails, BPU modules get codes and CPU modules floats, convert ~ QAT."""
    kinds, on_cpu, quant, dequant, seed = case
    torch.manual_seed(seed)
    model = Chain(kinds, 3, quant, dequant)
    names = [f"layers.{i}" for i in on_cpu]
    prepared = prepare_qat_fx(model, {"": QAT}, hybrid=True, hybrid_dict={"module_name": names})
    plan: HybridPlan = hybrid_placement(prepared)
    cpu = set(plan.cpu_modules())
    assert cpu == set(names)  # everything else (selu too, as a LUT) has a BPU form
    x = torch.randn(2, 3, 4, 4)
    for _ in range(2):
        prepared(x)
    converted = convert_fx(frozen(prepared))
    seen: set[str] = set()

    def check(path: str, codes: bool) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen.add(path)
            for a in args:
                assert a.is_floating_point() != codes, f"{path} got {a.dtype}"

        return hook

    for path, m in converted.named_modules():
        if path in cpu:
            m.register_forward_pre_hook(check(path, codes=False))
        elif isinstance(m, quantized.QuantizedModule) and not isinstance(m, quantized.QuantStub):
            m.register_forward_pre_hook(check(path, codes=True))
    with torch.no_grad():
        got, want = converted(x), prepared(x)
    assert seen >= cpu
    assert got.is_floating_point()
    assert (got - want).abs().max() <= 0.05 * want.abs().max() + 0.05


class _Split(nn.Module):
    """Data-dependent control flow (fx cannot trace it) and a tuple result: fine on the CPU."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.sum() > 0:
            return x[:, :2], x[:, 2:]
        return x[:, 2:], x[:, :2]


class _SplitNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(4, 4, 1)
        self.split = _Split()
        self.d = nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.split(self.c(x))
        return self.d(a) + b


@pytest.mark.parametrize("example", [False, True], ids=["rank-only", "example-inputs"])
def test_untraceable_cpu_module_with_tuple_output(example: bool) -> None:
    x = torch.randn(2, 4, 6, 6)
    prepared = prepare_qat_fx(
        _SplitNet(), {"": QAT}, (x,) if example else None, hybrid=True, hybrid_dict={"module_type": [_Split]}
    )
    plan = hybrid_placement(prepared)
    assert plan.cpu_modules() == ["split"]
    assert [b.kind for b in plan.boundaries] == ["quant", "quant", "quant", "dequant", "dequant"]
    prepared(x)
    converted = convert_fx(frozen(prepared))
    torch.testing.assert_close(converted(x), prepared(x), atol=0.05, rtol=0.05)
