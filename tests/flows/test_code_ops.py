"""Ops that compute exactly on codes, through prepare_qat_fx -> QAT -> convert_fx: the converted model
gives the QAT result bit for bit (indices, booleans, dequantized values), or exactly its fake quant at
the input's scale where the QAT op leaves the grid (clamp bounds, abs of the most negative code, a
constant pad value); errors name the node and the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from code_op_models import (
    EXACT_OPS,
    REQUANTIZED_OPS,
    ROUNDED_OPS,
    CodeOpNet,
    as_tuple,
    converted_pair,
    fake_quant,
    run_both,
)
from torch import nn

from backends.common import numerics
from qir.nn import qat
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert,
    convert_fx,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    hybrid_placement,
    prepare_qat,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.code_ops import abs_codes, clamp_codes, compare_codes
from qir.quantization.convert import ConvertError
from qir.quantization.exact_validation import set_exact_validation

SHAPE = (2, 3, 8, 8)


def _inputs(n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(*SHAPE, generator=g) * s for s in (0.5, 1.5, 3.0, 6.0)[:n]]


@pytest.mark.parametrize("name", sorted(EXACT_OPS))
def test_exact_ops_equal_qat_bit_for_bit(name: str) -> None:
    prepared, converted = converted_pair(CodeOpNet(EXACT_OPS[name]))
    for x in _inputs():
        want, got, _ = run_both(prepared, converted, x)
        for w, o in zip(as_tuple(want), as_tuple(got), strict=True):
            assert w.dtype == o.dtype and w.shape == o.shape
            assert torch.equal(w, o), f"{name}: {(w != o).sum()} of {w.numel()} differ"


@pytest.mark.parametrize("name", sorted(ROUNDED_OPS))
def test_rounded_ops_equal_the_fake_quant_of_qat(name: str) -> None:
    prepared, converted = converted_pair(CodeOpNet(ROUNDED_OPS[name]))
    for x in _inputs():
        want, got, s = run_both(prepared, converted, x)
        assert torch.equal(got, fake_quant(want, s)), name
        on_grid = fake_quant(want, s) == want
        assert torch.equal(got[on_grid], want[on_grid])  # off the grid only at bounds / the pad value / |-128|


@pytest.mark.parametrize("name", ["abs", "clamp", "pad_constant_module"])
def test_qint16_codes(name: str) -> None:
    prepared, converted = converted_pair(CodeOpNet(ROUNDED_OPS[name]), dtype="qint16")
    for x in _inputs():
        want, got, s = run_both(prepared, converted, x)
        assert torch.equal(got, fake_quant(want, s, "qint16")), name
    prepared, converted = converted_pair(
        CodeOpNet(lambda s, x: (x > 0.1, x <= -0.2, torch.topk(x, 2, 1)[1])), dtype="qint16"
    )
    for x in _inputs():
        want, got, _ = run_both(prepared, converted, x)
        assert all(torch.equal(w, o) for w, o in zip(want, got, strict=True))


@pytest.mark.parametrize("name", sorted(REQUANTIZED_OPS))
def test_two_tensor_max_min_get_their_own_scale(name: str) -> None:
    prepared, converted = converted_pair(CodeOpNet(REQUANTIZED_OPS[name]))
    assert any(isinstance(m, qat.FloatFunctional) for m in prepared.modules())
    ff = next(m for m in converted.modules() if type(m).__name__ == "QFunctional")
    for x in _inputs():
        want, got, _ = run_both(prepared, converted, x)
        assert float((want - got).abs().max()) <= float(ff.scale) * 1.0001  # requantization: <= 1 LSB


def test_converted_graph_holds_the_integer_forms() -> None:
    _, converted = converted_pair(
        CodeOpNet(lambda s, x: (s.dq(torch.clamp(x.abs(), max=0.5)), x > 0.1, s.dq2(s.cpad(x))))
    )
    targets = {n.target for n in converted.graph.nodes if n.op == "call_function"}
    assert {abs_codes, clamp_codes, compare_codes} <= targets
    clamp = next(n for n in converted.graph.nodes if n.target is clamp_codes)
    s = converted.conv.scale
    assert clamp.args[1] is None and clamp.args[2] == int(numerics.quantize(torch.tensor([0.5]), s, "qint8")[0])
    assert float(converted.cpad.value) == float(numerics.quantize(torch.tensor([0.25]), s, "qint8")[0])


def test_one_dequant_stub_for_codes_and_indices() -> None:
    # the stub dequantizes the values and passes the indices (exact values) through
    prepared, converted = converted_pair(CodeOpNet(lambda s, x: (s.dq(torch.max(x, 1)[0]), s.dq(torch.max(x, 1)[1]))))
    for x in _inputs(2):
        want, got, _ = run_both(prepared, converted, x)
        assert got[1].dtype == torch.int64 and torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


# ---------------------------------------------------------------------------------------------
# exact ties: inputs on a fixed grid, constants on the grid and half-way between


class _GridNet(nn.Module):
    """QuantStub(scale=1/64) -> op: every input on the grid is exactly its own fake quant."""

    def __init__(self, op: nn.Module | None = None) -> None:
        super().__init__()
        self.quant = QuantStub(scale=1 / 64)
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q = self.quant(x)
        return (
            q > 3 / 64,
            q >= 3 / 64,
            q < -2 / 64,
            q <= 2.5 / 64,
            q == 3 / 64,
            q != 3 / 64,
            0.5 / 64 >= q,
            self.dq(torch.clamp(q, 2.5 / 64, 10.5 / 64)),
            self.dq(torch.clamp(q, -3 / 64, 3 / 64)),
            self.dq(torch.abs(q)),
            torch.argmax(q, dim=-1),
            self.dq(torch.max(q, dim=-1)[0]),
        )


def test_ties_on_the_grid_match_qat() -> None:
    prepared = prepare_qat_fx(_GridNet(), {"": get_default_qat_qconfig()})
    set_fake_quantize(prepared, "validation")
    prepared.eval()
    converted = convert_fx(prepared)
    codes = torch.arange(-130, 131, dtype=torch.float32)
    x = torch.stack([codes, codes.flip(0), codes.roll(7), torch.zeros_like(codes)]) / 64
    x[1, 10:20] = 5 / 64  # ties along the argmax / max dim
    got = converted(x)
    for i, (w, o) in enumerate(zip(prepared(x), got, strict=True)):  # validation runs the integer twin
        assert torch.equal(w, o), f"output {i}"
    set_exact_validation(prepared, False)  # the float fake-quant simulation
    want = prepared(x)
    s = torch.tensor([1 / 64])
    for i, (w, o) in enumerate(zip(want, got, strict=True)):
        if w.dtype == torch.bool or not w.is_floating_point():
            assert torch.equal(w, o), f"output {i}"
        else:
            assert torch.equal(o, fake_quant(w, s)), f"output {i}"
    assert not torch.equal(want[9], got[9])  # |-128/64| = 2 leaves the grid: the codes saturate at 127


# ---------------------------------------------------------------------------------------------
# errors name the node and the fix


def _convert(op: object, qconfig_dict: dict | None = None) -> None:
    prepared = prepare_qat_fx(CodeOpNet(op), qconfig_dict or {"": get_default_qat_qconfig()})  # type: ignore[arg-type]
    prepared(torch.randn(*SHAPE))
    convert_fx(prepared.eval())


def test_clamp_with_a_tensor_bound_is_refused() -> None:
    with pytest.raises(ConvertError, match=r"clamp at node 'clamp'.*tensor min bound.*torch\.maximum"):
        _convert(lambda s, x: s.dq(torch.clamp(x, min=x.flip(1))))


def test_comparing_tensors_at_different_scales_is_refused() -> None:
    with pytest.raises(ConvertError, match=r"different scales .*one scale.*\(x - y\) > 0"):
        _convert(lambda s, x: x > x.flip(1) * 0.5)


def test_pad_value_outside_the_code_range_is_refused() -> None:
    with pytest.raises(ConvertError, match=r"F.pad at node 'pad' pads with 1000.0.*outside qint8's range"):
        _convert(lambda s, x: s.dq(F.pad(x, (1, 1), value=1000.0)))


def test_pad_module_value_outside_the_code_range_is_refused() -> None:
    def op(s: CodeOpNet, x: torch.Tensor) -> torch.Tensor:
        return s.dq(s.cpad(x))

    net = CodeOpNet(op)
    net.cpad.value = -1e6
    prepared = prepare_qat_fx(net, {"": get_default_qat_qconfig()})
    prepared(torch.randn(*SHAPE))
    with pytest.raises(ConvertError, match=r"ConstantPad2d at node 'cpad'.*outside qint8's range"):
        convert_fx(prepared.eval())


def test_comparison_with_nan_is_refused() -> None:
    with pytest.raises(ConvertError, match=r"node 'gt'.*NaN"):
        _convert(lambda s, x: x > float("nan"))


def test_constant_on_per_channel_scales_is_refused() -> None:
    qd = {"": get_default_qat_qconfig(), "module_name": {"conv": get_default_qat_out_qconfig()}}
    with pytest.raises(ConvertError, match=r"node 'gt'.*per-channel scales.*output fake quant"):
        _convert(lambda s, x: x > 0.5, qd)


class _EagerNet(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3)
        self.dequant = DeQuantStub()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.quant(x))
        if self.kind == "abs":
            y = y.abs()
        elif self.kind == "clamp":
            y = y.clamp(0.0, 1.0)
        elif self.kind == "compare":
            return y > 0.5
        elif self.kind == "max":
            y = torch.max(y, dim=1, keepdim=True)[0]
        elif self.kind == "shared_dequant":
            return self.dequant(torch.argmax(y, dim=1)) + self.dequant(y).sum()
        return self.dequant(y)


def _eager(kind: str) -> tuple[nn.Module, nn.Module]:
    model = _EagerNet(kind)
    model.qconfig = get_default_qat_qconfig()
    prepare_qat(model, inplace=True)
    model(torch.randn(*SHAPE))
    return model.eval(), convert(model.eval(), inplace=False)


def test_eager_convert_refuses_one_dequant_stub_for_codes_and_indices() -> None:
    with pytest.raises(ConvertError, match=r"DeQuantStub 'dequant' is called on codes and on indices.*one DeQuantStub"):
        _eager("shared_dequant")


@pytest.mark.parametrize("kind", ["abs", "clamp", "compare"])
def test_eager_convert_refuses_ops_it_cannot_rewrite(kind: str) -> None:
    with pytest.raises(ConvertError, match=r"eager convert cannot rewrite a forward.*prepare_qat_fx / convert_fx"):
        _eager(kind)


def test_eager_convert_keeps_ops_exact_as_written() -> None:
    _, converted = _eager("max")
    out = converted(torch.randn(*SHAPE))
    assert out.shape == (2, 1, 6, 6) and out.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# hybrid preparation keeps them on the BPU


class _HybridNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(8, 2)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.abs(self.conv(self.quant(x)))
        idx = torch.argmax(y, dim=1)
        return self.head(self.dequant(y)), idx


def test_hybrid_places_code_ops_on_the_bpu_and_passes_indices_as_they_are() -> None:
    prepared = prepare_qat_fx(
        _HybridNet(), {"": get_default_qat_qconfig()}, hybrid=True, hybrid_dict={"module_name": ["head"]}
    )
    placement = {p.node: p.device for p in hybrid_placement(prepared).placements}
    assert placement["abs_1"] == "BPU" and placement["argmax"] == "BPU"
    stubs = [b for b in hybrid_placement(prepared).boundaries if b.source == "argmax"]
    assert not stubs  # indices are exact values: no DeQuantStub
    prepared(torch.randn(*SHAPE))
    converted = convert_fx(prepared.eval())
    out, idx = converted(torch.randn(*SHAPE))
    assert idx.dtype == torch.int64 and out.shape == (2, 4, 8, 2)
