"""convert_fx by the ``quantize`` pass and by module swapping give the same integer model.

With example inputs (given to prepare_qat_fx or convert_fx, to type the QAT model's IR) a
model whose layers the pass covers (conv / linear, fused add / ReLU / ReLU6, high-precision
output, stubs, layout ops) converts by the pass; otherwise by module swapping, and
``meta[CONVERT_PATH_KEY]`` says why. The module-swap result is the oracle: outputs,
state-dict keys (in order) and tensors equal exactly.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import passes
import qir
import qir.nn as qnn
from passes.quantize import Quantize, QuantizeError, uncovered
from qir.frontend import trace
from qir.nn.quantized import QUANTIZED_MODULE_MAP, FloatFunctional
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    compile_model,
    convert_fx,
    default_pipeline,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
)
from qir.quantization.convert import CONVERT_PATH_KEY
from qir.quantization.prepare import PREPARE_RECORD_KEY
from qir.utils.fx_helper import wrap
from tests.quantization.path_blocks import Block, InvertedResidual
from tests.quantization.path_op_nets import AddRelu, Anchors, Attention, Leftovers, Recurrent, RoIPool
from tests.quantization.test_convert_untouched import _assert_same, _snapshot


class ResNetShaped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1, self.layer2 = Block(8, 8, 1), Block(8, 16, 2)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer2(self.layer1(self.stem(self.quant(x))))
        return self.dequant(self.fc(torch.flatten(y, 1)))


class MobileNetShaped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6())
        self.blocks = nn.Sequential(InvertedResidual(8, 4), InvertedResidual(8, 6))
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks(self.stem(self.quant(x)))
        return self.dequant(self.head(y.permute(0, 2, 3, 1).reshape(-1, 8)))


class AddCat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        y = self.a(x)
        return self.dequant(torch.cat([y + self.b(x), y], dim=1))


def _qat(model: nn.Module, march: str, qconfig: dict[str, Any] | None = None) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    qir.set_march(march)
    x = torch.randn(2, 3, 16, 16)
    qat = prepare_qat_fx(model, qconfig or {"": get_default_qat_qconfig()}, x)
    for _ in range(3):
        qat(torch.randn(2, 3, 16, 16) * 2)
    return qat.eval(), x


def _swapped(qat: nn.Module) -> nn.Module:
    """convert_fx by module swapping: the default mapping given as ``mapping=``, which only module
    swapping honours."""
    out = convert_fx(qat, mapping=dict(QUANTIZED_MODULE_MAP))
    assert out.meta[CONVERT_PATH_KEY].startswith("module swap: a custom mapping=")
    return out


def _unrun(qat: nn.Module) -> nn.Module:
    """convert_fx of the model without the example inputs prepare recorded (a checkpoint flow)."""
    bare = copy.deepcopy(qat)
    bare.meta[PREPARE_RECORD_KEY].example_inputs = None
    return convert_fx(bare)


def _equal(a: Any, b: Any) -> bool:
    """Outputs equal exactly: tensors (dtype too), or tuples of them."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and len(a) == len(b) and all(_equal(p, q) for p, q in zip(a, b, strict=True))


def _same(a: nn.Module, b: nn.Module, x: torch.Tensor) -> None:
    assert _equal(a(x), b(x))
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


def _pass_equals_swap(model: nn.Module, march: str, scaled: bool = False) -> tuple[nn.Module, torch.Tensor]:
    """``model`` prepared and trained, converted by the quantize pass: equal to module swapping on its
    input (and on 3x that input with ``scaled``). Returns the converted model and the input."""
    qat, x = _qat(model, march)
    by_pass = convert_fx(qat)
    assert by_pass.meta[CONVERT_PATH_KEY] == "quantize pass"
    _same(_swapped(qat), by_pass, x)
    unrun = _unrun(qat)  # typed with unknown sizes where the model allows it: the same model again
    if unrun.meta[CONVERT_PATH_KEY] == "quantize pass":
        _same(unrun, by_pass, x)
    if scaled:
        assert _equal(_swapped(qat)(x * 3), by_pass(x * 3))
    return by_pass, x


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize("net", [ResNetShaped, MobileNetShaped])
def test_pass_path_equals_module_swap(net: type[nn.Module], march: str) -> None:
    torch.manual_seed(1)
    qat, x = _qat(net(), march)
    swapped = _swapped(qat)
    by_pass = convert_fx(qat)  # typed by the example inputs prepare_qat_fx recorded
    assert by_pass.meta[CONVERT_PATH_KEY] == "quantize pass"
    _same(swapped, by_pass, x)
    unrun = _unrun(qat)
    if net is MobileNetShaped:  # typed with unknown batch and image sizes: the same integer model
        assert unrun.meta[CONVERT_PATH_KEY] == "quantize pass"
        _same(swapped, unrun, x)
    else:  # its fc reads 16*4*4 features of a flatten: the image size must be 16x16
        assert "without example inputs the model was typed at the input sizes" in unrun.meta[CONVERT_PATH_KEY]
        _same(swapped, unrun, x)
    _same(swapped, convert_fx(qat, example_inputs=torch.randn(1, 3, 16, 16)), x)
    batch = torch.randn(4, 3, 16, 16) * 3
    assert torch.equal(swapped(batch), by_pass(batch))
    if march == "bayes":  # bernoulli2's tables refuse the linear head
        assert torch.equal(compile_model(by_pass, [x])(x), by_pass(x))


def test_high_precision_head_by_the_pass() -> None:
    qc = {"": get_default_qat_qconfig(), "module_name": {"fc": get_default_qat_out_qconfig()}}
    qat, x = _qat(ResNetShaped(), "bayes", qc)
    by_pass = convert_fx(qat, example_inputs=x)
    assert by_pass.meta[CONVERT_PATH_KEY] == "quantize pass"
    assert by_pass.fc.dtype.name == "qint32"
    _same(_swapped(qat), by_pass, x)


class Functional(nn.Module):
    """FloatFunctional methods of every family, generated by prepare (``-``, ``cat``, ``mean``, ``*``,
    ``sum``, ``+``, scalars, ``stack``) and the user's own (``matmul``, ``maximum``, ``div``)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)
        self.mm, self.mx, self.dv = FloatFunctional(), FloatFunctional(), FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        y, w = self.a(x), self.b(x)
        z = torch.cat([y - w, y], dim=1)
        z = z * y.mean(dim=1, keepdim=True) + z.sum(dim=(2, 3), keepdim=True)
        z = torch.stack([z, z * 0.5 + 1.0], dim=1).sum(dim=1)
        m = self.mx.maximum(y, self.mm.matmul(y, w.transpose(-2, -1)))
        return self.dequant(torch.cat([z, self.dv.div(m, w * w + 1.0)], dim=1))


class Scaled(nn.Module):
    """A number computed at run time from a shape (``add_scalar`` / ``mul_scalar`` with an operand)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.quant(x))
        return self.dequant(y * (1.0 / y.shape[-1]) + y.shape[1])


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize("net", [AddCat, Functional, Scaled, AddRelu])
def test_float_functional_nets_by_the_pass_equal_module_swap(net: type[nn.Module], march: str) -> None:
    _pass_equals_swap(net(), march, scaled=True)


class Layers(nn.Module):
    """Pools, activations, table lookups (with a function argument), resizes (one with a run-time
    size), slicing, Identity and Dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool, self.avg, self.gap = nn.MaxPool2d(2), nn.AvgPool2d(3, 1, 1), nn.AdaptiveAvgPool2d((None, 1))
        self.sig, self.lrelu, self.exp = nn.Sigmoid(), nn.LeakyReLU(0.2), qnn.Exp()
        self.up = qnn.Interpolate(scale_factor=2, mode="bilinear", align_corners=False)
        self.near, self.lateral = qnn.Interpolate(scale_factor=2, mode="nearest"), qnn.Interpolate()
        self.relu, self.relu6, self.drop, self.id = nn.ReLU(), nn.ReLU6(), nn.Dropout(0.0), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.conv(self.quant(x)) + 0.0)
        z = self.sig(self.pool(y)) + self.lrelu(self.avg(y[:, :, ::2, ::2]))
        z = self.up(z) + self.near(self.relu6(z)) + self.lateral(z, size=y.shape[2:])
        z = self.exp(self.drop(self.id(z)))
        return self.dequant(z + self.gap(z))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_layer_nets_by_the_pass_equal_module_swap(march: str) -> None:
    by_pass, x = _pass_equals_swap(Layers(), march, scaled=True)
    if march == "bayes":
        assert torch.equal(compile_model(by_pass, [x])(x), by_pass(x))


class Math(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 1)
        self.ln, self.ln2 = nn.LayerNorm(256), nn.LayerNorm(256, elementwise_affine=False)
        self.sm, self.glu, self.pr, self.pr4 = nn.Softmax(dim=-1), nn.GLU(dim=1), nn.PReLU(), nn.PReLU(2)
        self.div = qnn.Div()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(self.conv(self.quant(x)).flatten(2))
        g = self.pr4(self.glu(self.sm(y) + self.ln2(y)))
        return self.dequant(self.div(self.pr(g), g * g + 1.0))


def test_lstm_cells_by_the_pass_equal_module_swap() -> None:
    # bayes only: bernoulli2 has no qint16 output for the cell state (test_prepare_paths checks both refuse it)
    by_pass, x = _pass_equals_swap(Recurrent(), "bayes", scaled=True)
    assert type(by_pass.cell_call1).__name__ == "LSTMCell"  # the second call site, converted for its own scales
    assert torch.equal(compile_model(by_pass, [x])(x), by_pass(x))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize("net", [RoIPool, Anchors, Attention])
def test_attention_and_detection_layers_by_the_pass_equal_module_swap(net: type[nn.Module], march: str) -> None:
    qat, x = _qat(net(), march)
    by_pass = convert_fx(qat)
    assert by_pass.meta[CONVERT_PATH_KEY] == "quantize pass"
    swapped = _swapped(qat)
    for a, b in zip(swapped(x * 3), by_pass(x * 3), strict=True):  # several outputs
        assert torch.equal(a, b)
    sa, sb = swapped.state_dict(), by_pass.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_unread_modules_and_buffer_expressions_by_the_pass_equal_module_swap(march: str) -> None:
    qat, x = _qat(Leftovers(), march)
    assert "_tensor_constant0" not in dict(qat.named_buffers()) and not hasattr(qat, "_tensor_constant0")
    by_pass, swapped = convert_fx(qat), _swapped(qat)
    assert by_pass.meta[CONVERT_PATH_KEY] == "quantize pass"
    for model in (by_pass, swapped):
        assert next(iter(model.state_dict())) == "boxes"  # the model's own buffer, read at run time
        assert not any(k.startswith("_tensor_constant") for k in model.state_dict())
        assert {"bn", "unused", "spare", "spare.0", "spare.1"} <= {n for n, _ in model.named_modules()}
    assert list(by_pass.state_dict()) == list(swapped.state_dict())
    assert [(n, type(m)) for n, m in by_pass.named_modules()][1:] == [(n, type(m)) for n, m in swapped.named_modules()][
        1:
    ]
    before = by_pass(x)[0]
    by_pass.boxes.mul_(0.5)  # the boxes are computed from the buffer when the model runs
    swapped.boxes.mul_(0.5)
    assert not torch.equal(before, by_pass(x)[0])
    for a, b in zip(swapped(x * 3), by_pass(x * 3), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_math_nets_by_the_pass_equal_module_swap(march: str) -> None:
    _pass_equals_swap(Math(), march, scaled=True)


class Warp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv, self.offset = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)
        self.bilinear = qnn.GridSample(mode="bilinear", padding_mode="zeros", align_corners=False)
        self.nearest = qnn.GridSample(mode="nearest", padding_mode="border", align_corners=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        y, grid = self.conv(x), torch.tanh(self.offset(x)).permute(0, 2, 3, 1)
        return self.dequant(self.bilinear(y, grid) + self.nearest(y, grid))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_grid_sample_nets_by_the_pass_equal_module_swap(march: str) -> None:
    _pass_equals_swap(Warp(), march)


class Copies(nn.Module):
    """Codes copied by repeat / expand / flip / roll (a DETR decoder's query repeat)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.quant(x))
        z = y[:1].repeat(2, 1, 1, 1) + y.mean(dim=(2, 3), keepdim=True).expand(-1, -1, 16, 16)
        return self.dequant(torch.cat([z.flip(-1), z.roll(1, dims=2)], dim=1))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_copies_of_codes_by_the_pass_equal_module_swap(march: str) -> None:
    _pass_equals_swap(Copies(), march)


class Splits(nn.Module):
    """Codes split into tuples (``chunk``, ``torch.split``, ``unbind``) and indexed (a C2f block's split)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv, self.c2, self.c3 = nn.Conv2d(3, 8, 1), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.quant(x))
        a, b = y.chunk(2, 1)
        p, q = torch.split(a, [2, 2], dim=1)
        rows = b.unbind(2)
        return self.dequant(torch.cat([self.c2(b), self.c3(p), q, rows[0].unsqueeze(2).expand(-1, -1, 16, -1)], dim=1))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_splits_of_codes_by_the_pass_equal_module_swap(march: str) -> None:
    _pass_equals_swap(Splits(), march)


def test_a_model_the_quantize_pass_refuses_converts_by_module_swap_saying_why() -> None:
    class Table16(nn.Module):  # a qint16 input to softmax's qint8 exp table: refused at run time
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()
            self.conv, self.sm = nn.Conv2d(3, 4, 1), nn.Softmax(1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.sm(self.conv(self.quant(x))))

    qat, x = _qat(
        Table16(),
        "bayes",
        {"": get_default_qat_qconfig(), "module_name": {"conv": get_default_qat_qconfig(dtype="qint16")}},
    )
    out = convert_fx(qat)
    why = out.meta[CONVERT_PATH_KEY]
    assert why.startswith("module swap: the quantize pass refused the model: ") and "qint8" in why
    with pytest.raises(NotImplementedError, match="only qint8 input"):
        out(x)


@pytest.mark.parametrize("net", [Functional, Layers, Math, Warp])
def test_the_pass_path_leaves_the_qat_model_untouched(net: type[nn.Module]) -> None:
    qat, _ = _qat(net(), "bayes")
    qat.train()
    before = _snapshot(qat)
    out = convert_fx(qat)
    assert out.meta[CONVERT_PATH_KEY] == "quantize pass"
    _assert_same(before, _snapshot(qat))
    qat_storage = {t.untyped_storage().data_ptr() for t in [*qat.parameters(), *qat.buffers()] if t.numel()}
    assert [k for k, t in out.state_dict().items() if t.numel() and t.untyped_storage().data_ptr() in qat_storage] == []


class FloatTail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3)
        self.tail = nn.Linear(14, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.dequant(self.conv(self.quant(x))))


def test_a_module_without_a_qat_op_falls_back_to_module_swap_before_tracing() -> None:
    qat, x = _qat(FloatTail(), "bayes", {"": get_default_qat_qconfig(), "module_name": [("tail", None)]})
    assert type(qat.tail) is nn.Linear  # left float: no QAT op to convert
    out = convert_fx(qat, example_inputs=x)
    why = out.meta[CONVERT_PATH_KEY]
    assert why == "module swap: the quantize pass does not cover module 'tail' (Linear): it has no QAT op"
    _same(_swapped(qat), out, x)


def _lsq_cat() -> dict[str, Any]:
    from qir.quantization.lsq import LSQFakeQuantize
    from qir.quantization.qconfig import QConfig

    qc = get_default_qat_qconfig()
    return {"": qc, "module_name": {"_generated_cat_0": QConfig(activation=LSQFakeQuantize.with_args(), weight=None)}}


def test_an_opaque_call_falls_back_to_module_swap_and_says_which() -> None:
    qat, x = _qat(AddCat(), "bayes", _lsq_cat())
    assert type(qat._generated_cat_0.activation_post_process).__name__ == "LSQFakeQuantize"
    out = convert_fx(qat, example_inputs=x)
    why = out.meta[CONVERT_PATH_KEY]
    assert why.startswith("module swap: the quantize pass does not cover %cat: call of ")  # found in the IR
    _same(_swapped(qat), out, x)


def test_the_pass_refuses_an_uncovered_graph_naming_the_node() -> None:
    qat, x = _qat(AddCat(), "bayes", _lsq_cat())
    g = trace(qat, (x,))
    (node, reason), *_ = uncovered(g)
    with pytest.raises(passes.PassFailure) as e:
        passes.run_pipeline(g, Quantize(march="bayes"))
    assert isinstance(e.value.__cause__, QuantizeError) and f"%{node}" in str(e.value.__cause__)
    assert reason in str(e.value.__cause__)


def test_default_convert_pipeline_is_quantize_and_parses_back() -> None:
    p = default_pipeline("convert", "bernoulli2")
    assert str(p) == "quantize{march=bernoulli2}"
    assert passes.Pipeline.parse(str(p)) == p


def test_the_pass_leaves_an_integer_graph_alone() -> None:
    qat, x = _qat(ResNetShaped(), "bayes")
    converted = convert_fx(qat)
    g = trace(converted, (x,))
    assert uncovered(g) == []
    result = passes.run_pipeline(g, Quantize(march="bayes"))
    assert not result.any_changed


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.conv2, self.relu2 = nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.relu2(self.conv2(self.relu1(self.bn1(self.conv1(self.quant(x)))))))


def test_a_user_pass_from_its_own_module_changes_the_converted_model_and_the_artifact() -> None:
    from pathlib import Path

    if "test-qat-relu-to-relu6" not in passes.available_passes():
        passes.load_pass_module(str(Path(__file__).resolve().parents[1] / "data" / "qat_relu6_pass.py"))
    torch.manual_seed(0)
    qir.set_march("bayes")
    x = torch.randn(2, 3, 8, 8) * 20
    qat = prepare_qat_fx(Tiny(), {"": get_default_qat_qconfig()}, x)
    qat(x)
    qat.eval()
    plain = convert_fx(qat, example_inputs=x)
    clipped = convert_fx(qat, pipeline="test-qat-relu-to-relu6", example_inputs=x)  # quantize is appended
    assert clipped.meta[CONVERT_PATH_KEY] == "quantize pass"
    assert type(plain.conv2).__name__ == "ConvReLU2d" and type(clipped.conv2).__name__ == "ConvReLU62d"
    assert float(plain(x).max()) > 6.5 and float(clipped(x).max()) <= 6.0
    compiled = compile_model(clipped, [x])
    assert [i.attrs["act"] for i in compiled.program.instructions if i.op == "conv2d"] == ["relu6", "relu6"]
    assert torch.equal(compiled(x), clipped(x))


def test_the_pass_moves_codes_through_any_op_with_the_moves_codes_trait() -> None:
    """What the pass retypes is decided by the ``MovesCodes`` trait, not by op names: a user's op
    with the trait carries the codes' spec through; the same op without it is uncovered."""
    import attrs

    from qir.ir.op import MovesCodes, Pure
    from qir.ir.ops.shape import Flatten

    @attrs.frozen
    class UserFlatten(Flatten):
        name = "user_flatten"
        traits = frozenset({Pure, MovesCodes})

    @attrs.frozen
    class OpaqueFlatten(Flatten):
        name = "opaque_flatten"
        traits = frozenset({Pure})

    qat, x = _qat(ResNetShaped(), "bayes")
    for cls, covered in ((UserFlatten, True), (OpaqueFlatten, False)):
        g = trace(qat, (x,))
        node = next(n for n in g.nodes if n.op.name == "flatten")
        node.op = cls(**node.op.attributes())
        bad = uncovered(g)
        if not covered:
            assert bad == [(node.name, f"op {cls.name!r} on quantized values has no quantize rule")]
            continue
        assert bad == []
        passes.run_pipeline(g, Quantize(march="bayes"), inplace=True)
        src = node.operands[0].type
        assert node.type.quant is not None and node.type.quant == src.quant and node.type.dtype == src.dtype


class OnCodes(nn.Module):
    """Float ops called on codes: clamps and pads whose constants become codes, ReLU6 / hardtanh(0, 6),
    abs, ops exact on codes as written (relu, max / min, topk, argmax, reflect pad), a float32 cast."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.cpad, self.zpad = nn.ConstantPad2d(1, 0.5), nn.ZeroPad2d(1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.conv(self.quant(x))
        a = torch.clamp(y, -0.5, 0.7) + y.clamp(min=0.1) + F.relu6(y) + F.hardtanh(y, 0.0, 6.0) + y.abs()
        b = F.pad(y, (1, 1, 1, 1), value=0.25) + self.cpad(y) + F.pad(y, (1, 1, 1, 1), mode="reflect") + self.zpad(y)
        v, i = y.max(dim=1, keepdim=True)
        t, _ = y.flatten(1).topk(3, dim=1)
        c = F.relu(y) + y.float() + v + y.min() + torch.max(y) - y.to(torch.float32).relu()
        return self.dequant(a), self.dequant(b), self.dequant(c), self.dequant(t), i, y.argmax(1)


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_float_ops_on_codes_by_the_pass_equal_module_swap(march: str) -> None:
    by_pass, _ = _pass_equals_swap(OnCodes(), march, scaled=True)
    value = by_pass.cpad.value  # the pad value is a code: 0.5 / the conv's output scale, rounded
    assert value == int(value) and abs(value * float(by_pass.conv.scale) - 0.5) <= float(by_pass.conv.scale) / 2


@wrap()
def _decode(score: torch.Tensor, box: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    s, i = score[:, 0].flatten(1).topk(k, dim=1)
    return s.sigmoid(), box.flatten(2).gather(2, i.unsqueeze(1).expand(-1, box.shape[1], -1))


class Wrapped(nn.Module):
    """Post-processing kept opaque with ``fx_helper.wrap`` (a function and a method) on quantized
    values; one value read by two wrapped calls and by a DeQuantStub."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv, self.box = nn.Conv2d(3, 2, 3, padding=1), nn.Conv2d(3, 4, 1)

    @wrap()
    def _post_process(self, s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (s.sigmoid() > 0.5).sum() + b.mean()

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        x = self.quant(x)
        s, b = self.conv(x), self.box(x)
        return _decode(s, b, 5), self._post_process(s, b), self.dequant(b)


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_wrapped_calls_on_codes_by_the_pass_equal_module_swap(march: str) -> None:
    by_pass, _ = _pass_equals_swap(Wrapped(), march, scaled=True)
    stubs = [n for n, _ in by_pass.named_modules() if n.startswith("_generated_wrap_dequant_")]
    assert stubs == ["_generated_wrap_dequant_0", "_generated_wrap_dequant_1"]  # one per quantized value


class Queried(nn.Module):
    """Codes split into a tuple and their shape read (``chunk``, ``size``, ``len``)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.conv(self.quant(x)).chunk(2, 1)
        return self.dequant(a.reshape(len(a), b.size(1), -1))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_split_and_queried_codes_by_the_pass_equal_module_swap(march: str) -> None:
    _pass_equals_swap(Queried(), march)


@pytest.mark.parametrize(("op_name", "trait"), [("chunk", "MovesCodes"), ("size", "ReadsShape"), ("len", "ReadsShape")])
def test_what_the_pass_splits_and_queries_is_decided_by_traits(op_name: str, trait: str) -> None:
    """A user's op carrying ``MovesCodes`` (a split into a tuple of codes) or ``ReadsShape`` (a
    number from a shape) is covered as the built-in op is; the same op without the trait is not."""
    import attrs

    import qir.ir.op as ir_op
    from qir.ir.op import OP_REGISTRY

    base = OP_REGISTRY[op_name]
    with_trait = attrs.frozen(type(f"User_{op_name}", (base,), {"name": f"user_{op_name}"}))
    without = attrs.frozen(
        type(
            f"Opaque_{op_name}",
            (base,),
            {"name": f"opaque_{op_name}", "traits": base.traits - {getattr(ir_op, trait)}},
        )
    )
    assert with_trait.has_trait(getattr(ir_op, trait)) and not without.has_trait(getattr(ir_op, trait))
    qat, x = _qat(Queried(), "bayes")
    assert uncovered(trace(qat, (x,))) == []
    for cls, covered in ((with_trait, True), (without, False)):
        g = trace(qat, (x,))
        node = next(n for n in g.nodes if n.op.name == op_name)
        node.op = cls(**node.op.attributes())
        bad = uncovered(g)
        if not covered:
            assert bad and bad[0] == (node.name, f"op {cls.name!r} on quantized values has no quantize rule")
            continue
        assert bad == []
        passes.run_pipeline(g, Quantize(march="bayes"), inplace=True)


class Compares(nn.Module):
    """Comparisons of codes with numbers (either side) and of two tensors at one scale."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.conv(self.quant(x))
        return y > 0.3, 0.2 <= y, y.eq(0.0), y != -0.4, y.lt(0.1), y >= y.flip(-1), y < 1e9


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_comparisons_of_codes_by_the_pass_equal_module_swap(march: str) -> None:
    by_pass, x = _pass_equals_swap(Compares(), march, scaled=True)
    assert all(t.dtype == torch.bool for t in by_pass(x))
    assert "compare_codes" in by_pass.code


class NearestFunctional(nn.Module):
    """A functional nearest resize on codes, by scale factor and by a size read from another map
    (an FPN's top-down path written with F.interpolate): nearest_interpolate_codes on both paths."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.c1, self.c2 = nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Conv2d(4, 4, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p1 = self.c1(self.quant(x))
        p2 = self.c2(p1)
        up = F.interpolate(p2, scale_factor=2, mode="nearest")
        return self.dequant(torch.cat([up, F.interpolate(p2, size=p1.shape[2:], mode="nearest")], dim=1))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_functional_nearest_resize_by_the_pass_equals_module_swap(march: str) -> None:
    by_pass, x = _pass_equals_swap(NearestFunctional(), march)
    assert torch.equal(compile_model(by_pass, [x])(x), by_pass(x))
