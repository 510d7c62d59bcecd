"""prepare_qat_fx by the ``insert-observers`` pass and by module swapping give the same model.

A model whose quantized layers all have QAT ops (conv / linear with fused add / ReLU / ReLU6,
stubs, pools, FloatFunctional methods, table lookups, resizes, softmax, layer norm, PReLU, GLU,
Div) is prepared by the pass on the fused IR and emitted; any other is swapped whole, and
``meta[PREPARE_PATH_KEY]`` says why. Module swapping is the oracle: the same state-dict keys
(in order) and tensors, the same outputs in calibration, QAT and validation after a few
optimizer steps, and the same converted model.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

import passes
import qir
import qir.quantization.prepare as prepare_module
from passes.insert_observers import InsertObservers
from qir.nn.modules.functional import FloatFunctional
from qir.nn.quantized import QUANTIZED_MODULE_MAP
from qir.quantization import (
    DeQuantStub,
    FakeQuantState,
    QuantStub,
    convert_fx,
    default_pipeline,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    hybrid_placement,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.convert import CONVERT_PATH_KEY
from qir.quantization.prepare import PREPARE_BY_PASS, PREPARE_PATH_KEY, PREPARE_RECORD_KEY
from qir.quantization.prepare_checks import UnconvertibleModelError
from tests.flows.hybrid_models import HybridModel, NoBPUForm, Residual, seed_hybrid_dict
from tests.quantization.path_blocks import Block, InvertedResidual
from tests.quantization.path_op_nets import (
    AddRelu,
    Anchors,
    Attention,
    Leftovers,
    NormsAndLuts,
    NumberOperands,
    PoolsAndFunctionals,
    Recurrent,
    RoIPool,
    SharedFusions,
    TorchFunctionals,
)


class ResNetShaped(nn.Module):
    """Residual blocks, a 1x1 conv called twice, a linear head, a float layer after the dequant."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1, self.layer2 = Block(8, 8, 1), Block(8, 16, 2)
        self.proj = nn.Conv2d(16, 16, 1)
        self.fc = nn.Linear(16 * 4 * 4, 10)
        self.post = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(self.proj(self.layer2(self.layer1(self.stem(self.quant(x))))))
        return self.post(self.dequant(self.fc(torch.flatten(y, 1))))


class MobileNetShaped(nn.Module):
    """Inverted residuals, a linear head; one DeQuantStub called for both outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6())
        self.blocks = nn.Sequential(InvertedResidual(8, 4), InvertedResidual(8, 6))
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feat = self.blocks(self.stem(self.quant(x)))
        return self.dequant(self.head(feat.permute(0, 2, 3, 1).reshape(-1, 8))), self.dequant(feat)


def _qconfig(net: type[nn.Module], calib: bool, march: str) -> dict[str, Any]:
    make = get_default_calib_qconfig if calib else get_default_qat_qconfig
    wide = "qint16" if march == "bayes" else "qint8"  # bernoulli2 convs have no qint16 output
    if net is ResNetShaped:
        slow = make() if calib else make(activation_qkwargs={"averaging_constant": 0.5})
        return {
            "": make(),
            "module_type": [(nn.Linear, make(dtype=wide))],  # fc: a qint16 output (bayes)
            "module_name": [("post", None), ("layer1.conv1", slow)],
        }
    if net is MobileNetShaped:
        return {"": make(), "module_name": [("blocks.1.pw.0", make(dtype=wide))]}
    if net is PoolsAndFunctionals:  # the FloatFunctional's calls and the sigmoid: a qint16 output (bayes)
        return {"": make(), "module_name": [("ff", make(dtype=wide)), ("sig", make(dtype=wide))]}
    return {"": make(), "module_type": [(nn.Softmax, make(dtype=wide))]}


@contextmanager
def _module_swap() -> Iterator[None]:
    """prepare_qat_fx with the pass path switched off: today's module swap, the oracle."""
    saved = prepare_module._observe_by_pass
    prepare_module._observe_by_pass = lambda *args, **kwargs: (None, "the oracle")  # type: ignore[assignment]
    try:
        yield
    finally:
        prepare_module._observe_by_pass = saved  # type: ignore[assignment]


def _outputs(y: Any) -> list[torch.Tensor]:
    return list(y) if isinstance(y, tuple) else [y]


def _same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)
    assert [n for n, _ in a.named_modules()][1:] == [n for n, _ in b.named_modules()][1:]
    assert all(type(m) is type(b.get_submodule(n)) for n, m in list(a.named_modules())[1:])
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]


def _same_outputs(a: nn.Module, b: nn.Module, x: torch.Tensor) -> None:
    outs = []
    for m in (a, b):
        torch.manual_seed(3)  # the same dropout masks in training
        outs.append(_outputs(m(x)))
    for ya, yb in zip(*outs, strict=True):
        assert torch.equal(ya, yb)


def _train(model: nn.Module, steps: int) -> None:
    torch.manual_seed(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        loss = sum(y.square().mean() for y in _outputs(model(torch.randn(2, 3, 16, 16) * 2)))
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()


def _flow(net: type[nn.Module], march: str) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """Calibrate, then QAT, then validate; returns the QAT model, its convert_fx result, and an input."""
    qir.set_march(march)
    torch.manual_seed(0)
    model = net()
    x = torch.randn(2, 3, 16, 16)
    calib = prepare_qat_fx(model, _qconfig(net, True, march), x)
    set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    torch.manual_seed(1)
    for _ in range(3):
        calib(torch.randn(2, 3, 16, 16) * 2)
    qat = prepare_qat_fx(calib, _qconfig(net, False, march), x)
    _train(qat, 3)
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    qat.eval()
    return calib, qat, x


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize(
    "net",
    [
        ResNetShaped,
        MobileNetShaped,
        PoolsAndFunctionals,
        NormsAndLuts,
        TorchFunctionals,
        AddRelu,
        NumberOperands,
        Leftovers,
        Recurrent,
        RoIPool,
        Anchors,
        Attention,
        SharedFusions,
    ],
)
def test_the_pass_path_equals_module_swap(net: type[nn.Module], march: str) -> None:
    if net is Recurrent and march == "bernoulli2":  # its cell state is qint16: both paths refuse it at prepare
        for swap in (False, True):
            with _module_swap() if swap else contextlib.nullcontext():
                with pytest.raises(UnconvertibleModelError, match=r"bernoulli2 requantizes to qint8 only"):
                    _flow(net, march)
        return
    calib, qat, x = _flow(net, march)
    with _module_swap():
        calib_swap, qat_swap, _ = _flow(net, march)
    for by_pass, by_swap in ((calib, calib_swap), (qat, qat_swap)):
        assert by_pass.meta[PREPARE_PATH_KEY] == PREPARE_BY_PASS
        assert by_swap.meta[PREPARE_PATH_KEY] == "module swap: the oracle"
        _same_state(by_pass, by_swap)
        _same_outputs(by_pass, by_swap, x)
    set_fake_quantize(qat, FakeQuantState.QAT)
    set_fake_quantize(qat_swap, FakeQuantState.QAT)
    _same_outputs(qat.train(), qat_swap.train(), x * 3)
    _same_state(qat, qat_swap)
    qat.eval()
    qat_swap.eval()
    converted, converted_swap = convert_fx(qat), convert_fx(qat_swap)
    _same_state(converted, converted_swap)
    _same_outputs(converted, converted_swap, x)


#: hybrid cases: (model, hybrid_dict, example inputs given to prepare)
_HYBRID: dict[str, tuple[type[nn.Module], Any, bool]] = {
    "seed003": (HybridModel, seed_hybrid_dict(), False),  # as the seed calls it: no example inputs
    "residual": (Residual, {"module_name": ["branch"]}, True),
    "automatic": (NoBPUForm, None, True),  # placement by the ops alone: GroupNorm, cumsum
}


def _hybrid_flow(case: str, march: str) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """A hybrid model calibrated, then QAT (the seed's conv1 a high-precision output), then validated."""
    net, hybrid_dict, examples = _HYBRID[case]
    qir.set_march(march)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    kw: dict[str, Any] = {"hybrid": True, "hybrid_dict": hybrid_dict, "example_inputs": x if examples else None}
    calib = prepare_qat_fx(net(), {"": get_default_calib_qconfig()}, **kw)
    set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    torch.manual_seed(1)
    for _ in range(3):
        calib(torch.randn(2, 3, 16, 16) * 2)
    qat_dict: dict[str, Any] = {"": get_default_qat_qconfig()}
    if case == "seed003":
        qat_dict["module_name"] = [("conv1", get_default_qat_out_qconfig())]
    qat = prepare_qat_fx(calib, qat_dict, **kw)
    _train(qat, 3)
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    qat.eval()
    return calib, qat, x


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize("case", list(_HYBRID))
def test_hybrid_models_by_the_pass_equal_module_swap(case: str, march: str) -> None:
    calib, qat, x = _hybrid_flow(case, march)
    with _module_swap():
        calib_swap, qat_swap, _ = _hybrid_flow(case, march)
    for by_pass, by_swap in ((calib, calib_swap), (qat, qat_swap)):
        assert by_pass.meta[PREPARE_PATH_KEY] == PREPARE_BY_PASS
        _same_state(by_pass, by_swap)
        assert hybrid_placement(by_pass) == hybrid_placement(by_swap)  # the CPU modules and the generated stubs
        assert str(by_pass.graph) == str(by_swap.graph)
        _same_outputs(by_pass, by_swap, x)
    converted, converted_swap = convert_fx(qat), convert_fx(qat_swap)
    _same_state(converted, converted_swap)
    _same_outputs(converted, converted_swap, x)
    # convert: by the quantize pass (typed by the recorded inputs) == by module swapping (test_convert_paths'
    # oracle: state dicts and outputs; the emitted model leaves out the modules no call reads)
    assert converted.meta[CONVERT_PATH_KEY] == "quantize pass"
    swapped = convert_fx(qat, mapping=dict(QUANTIZED_MODULE_MAP))  # a mapping= only module swapping honours
    assert swapped.meta[CONVERT_PATH_KEY].startswith("module swap: a custom mapping=")
    sa, sb = converted.state_dict(), swapped.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)
    _same_outputs(converted, swapped, x)
    bare = copy.deepcopy(qat)  # without the recorded inputs: typed with unknown sizes where the model allows it
    bare.meta[PREPARE_RECORD_KEY].example_inputs = None
    unrun = convert_fx(bare)  # (seed 003's input meets a CPU selu first: its rank is not known, module swap)
    su = unrun.state_dict()
    assert list(sa) == list(su) and all(torch.equal(sa[k], su[k]) and sa[k].dtype == su[k].dtype for k in sa)
    _same_outputs(converted, unrun, x)
    _same_outputs(converted, swapped, x * 3)
    assert hybrid_placement(converted) == hybrid_placement(swapped)


def test_a_weight_two_fused_layers_share_stays_one_parameter() -> None:
    _, qat, _ = _flow(SharedFusions, "bayes")
    convs = [m for m in qat.modules() if type(m).__name__ in ("ConvReLU2d", "ConvAdd2d")]
    assert len(convs) == 2 and convs[0].weight is convs[1].weight and convs[0].bias is convs[1].bias
    assert convs[0].weight_fake_quant is not convs[1].weight_fake_quant  # as module swapping leaves them


def test_the_overrides_reach_the_pass_path() -> None:
    _, qat, _ = _flow(ResNetShaped, "bayes")
    assert type(qat.post) is nn.Linear  # module_name None: float
    assert qat.fc.activation_post_process.dtype.name == "qint16"  # module_type
    assert qat.layer1.conv1.activation_post_process.observer.averaging_constant == 0.5  # module_name
    # one output observer per call of proj; one weight (and weight fake quant) for both calls
    assert qat.proj_call1.weight is qat.proj.weight
    assert qat.proj_call1.weight_fake_quant is qat.proj.weight_fake_quant
    assert qat.proj_call1.activation_post_process is not qat.proj.activation_post_process
    assert not any(k.startswith("proj_call1.weight") for k in qat.state_dict())


def test_an_op_the_pass_refuses_prepares_the_whole_model_by_module_swap() -> None:
    class WithNumberMinus(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()
            self.conv, self.ff = nn.Conv2d(3, 4, 3), FloatFunctional()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(self.quant(x))
            return self.dequant(self.ff.sub(2.0, y))  # a number minus a tensor: no BPU form

    qir.set_march("bayes")
    x = torch.randn(1, 3, 8, 8)
    qat = prepare_qat_fx(WithNumberMinus(), {"": get_default_qat_qconfig()}, x)
    why = qat.meta[PREPARE_PATH_KEY]
    assert why.startswith("module swap: insert-observers: %sub (module ff): ")
    assert "FloatFunctional.sub: op 'sub' has its operands reversed" in why
    with pytest.raises(TypeError, match=r"FloatFunctional\.sub got the number 2\.0 as its operand x"):
        qat(x)  # the swapped module refuses it by name at its first call
    assert type(qat.conv).__name__ == "Conv2d" and hasattr(qat.conv, "weight_fake_quant")  # swapped too


def test_a_qconfig_without_a_data_form_prepares_by_module_swap() -> None:
    qir.set_march("bayes")
    qat = prepare_qat_fx(
        MobileNetShaped(), {"": get_default_qat_qconfig(activation_fake_quant="lsq")}, torch.randn(2, 3, 16, 16)
    )
    why = qat.meta[PREPARE_PATH_KEY]
    assert why.startswith("module swap: ") and "LSQFakeQuantize is not a FakeQuantize the IR can describe" in why


def test_default_prepare_pipeline_ends_with_insert_observers_and_parses_back() -> None:
    p = default_pipeline("prepare")
    assert str(p) == "fuse{force_bn=true},dce,insert-observers"
    assert passes.Pipeline.parse(str(p)) == p


def test_options_of_its_own_in_prepare_are_refused() -> None:
    qir.set_march("bayes")
    with pytest.raises(ValueError, match="has options of its own"):
        prepare_qat_fx(
            MobileNetShaped(),
            {"": get_default_qat_qconfig()},
            torch.randn(1, 3, 16, 16),
            pipeline=[InsertObservers(qconfigs=(("stem.0", None, None),))],
        )


def test_a_user_pass_after_insert_observers_reaches_training_conversion_and_the_artifact() -> None:
    from pathlib import Path

    from qir.quantization import compile_model

    if "test-qat-out-qint16" not in passes.available_passes():
        passes.load_pass_module(str(Path(__file__).resolve().parents[1] / "data" / "qat_out_qint16_pass.py"))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()
            self.conv1, self.bn1, self.relu1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
            self.conv2 = nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.conv2(self.relu1(self.bn1(self.conv1(self.quant(x))))))

    qir.set_march("bayes")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8) * 4
    pipeline = str(default_pipeline("prepare")) + ",test-qat-out-qint16{scope=conv1}"
    plain = prepare_qat_fx(Net(), {"": get_default_qat_qconfig()}, x)
    torch.manual_seed(0)
    qat = prepare_qat_fx(Net(), {"": get_default_qat_qconfig()}, x, pipeline=pipeline)
    assert qat.meta[PREPARE_PATH_KEY] == PREPARE_BY_PASS
    # the trained model: conv1's output fake quant is qint16, conv2's stays qint8
    assert qat.conv1.activation_post_process.dtype.name == "qint16"
    assert plain.conv1.activation_post_process.dtype.name == "qint8"
    assert qat.conv2.activation_post_process.dtype.name == "qint8"
    assert list(qat.state_dict()) == list(plain.state_dict())
    _train(qat, 2)
    qat.eval()
    converted = convert_fx(qat)
    assert converted.conv1.dtype.name == "qint16" and converted.conv2.dtype.name == "qint8"
    compiled = compile_model(converted, [x])
    convs = [i.attrs["out_dtype"] for i in compiled.program.instructions if i.op == "conv2d"]
    assert convs == ["qint16", "qint8"]
    assert torch.equal(compiled(x), converted(x))


def _ctor_draws(qat: nn.Module) -> None:
    """Build the float conv / linear of every QAT conv / linear in ``qat`` (module order): the
    random initialization each one's construction draws from the global stream."""
    from qir.nn.qat.conv import QATConvBase

    for m in qat.modules():
        if isinstance(m, QATConvBase):
            w = m.weight
            if m.float_conv is nn.Linear:
                nn.Linear(w.shape[1], w.shape[0], bias=m.bias is not None)
            else:
                conv: Any = m
                m.float_conv(
                    conv.in_channels, conv.out_channels, conv.kernel_size, groups=conv.groups, bias=m.bias is not None
                )


def test_prepare_draws_one_random_init_per_quantized_layer_on_either_path() -> None:
    """The global random stream a script sees after prepare_qat_fx: each QAT conv / linear is
    built once with torch's random initialization (as module swapping and torch.ao do), so a
    seeded script draws the same numbers after prepare whichever path ran (building QAT modules
    on the meta device, or twice, would change them)."""
    qir.set_march("bayes")
    torch.manual_seed(0)
    model, x = ResNetShaped(), torch.randn(2, 3, 16, 16)
    after: list[torch.Tensor] = []
    for oracle in (False, True):
        with _module_swap() if oracle else contextlib.nullcontext():
            torch.manual_seed(7)
            qat = prepare_qat_fx(model, _qconfig(ResNetShaped, False, "bayes"), x)
            after.append(torch.rand(8))
    torch.manual_seed(7)
    _ctor_draws(qat)
    assert torch.equal(after[0], after[1])
    assert torch.equal(after[0], torch.rand(8))
