"""``load_state_dict`` into a quantized module runs the checkpoint's requantizations: two modules
converted from other scales, one's state dict loaded into the other, compute the same codes bit for
bit, for every quantized module class that derives plain integers from its scales."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from nn_cases import CONV_CASES
from torch import nn

import qir.nn as qnn
from backends.common import numerics
from qir.nn import QAT_MODULE_MAP, QUANTIZED_MODULE_MAP
from qir.nn.quantized import QuantizedModule
from qir.nn.quantized.derived_state import DERIVED_KEY
from qir.quantization import FakeQuantize, disable_observer, get_default_qat_qconfig

QC = get_default_qat_qconfig()
Call = Callable[..., Any]


def _plain(m: nn.Module, *xs: torch.Tensor) -> Any:
    return m(*xs)


def _lstm(m: nn.Module, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> Any:
    return m(x, (h, c))


_BOXES = [torch.tensor([[0.0, 0.0, 10.0, 9.0], [2.0, 3.0, 7.0, 11.0]]), torch.tensor([[1.0, 1.0, 6.0, 5.0]])]


def _roi(m: nn.Module, x: torch.Tensor) -> Any:
    return m(x, _BOXES)


def _ms_roi(m: nn.Module, p3: torch.Tensor, p4: torch.Tensor) -> Any:
    return m({"p3": p3, "p4": p4}, [b * 8 for b in _BOXES], [(96, 96)])


IMG = (2, 3, 8, 8)
#: name -> (float module factory, inputs as (shape, dtype, scale), call)
CASES: dict[str, tuple[Callable[[], nn.Module], list[tuple[tuple[int, ...], str, float]], Call]] = {
    **{
        c.name: (c.make, [(s, "qint8", sc) for s, sc in zip(c.shapes, c.scales, strict=True)], _plain)
        for c in CONV_CASES
    },
    "ReLU6": (nn.ReLU6, [(IMG, "qint8", 0.05)], _plain),
    "AdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d((3, 2)), [((2, 3, 7, 5), "qint8", 0.02)], _plain),
    "AvgPool2d": (lambda: nn.AvgPool2d(3, 2, 1), [(IMG, "qint8", 0.02)], _plain),
    "Interpolate": (lambda: qnn.Interpolate(scale_factor=2, mode="bilinear"), [(IMG, "qint8", 0.02)], _plain),
    "UnaryLUT": (nn.Sigmoid, [(IMG, "qint8", 0.05)], _plain),
    "UnaryLUT-qint16": (nn.Sigmoid, [(IMG, "qint16", 0.0004)], _plain),
    "Div": (qnn.Div, [(IMG, "qint8", 0.05), (IMG, "qint8", 0.03)], _plain),
    "PReLU": (lambda: nn.PReLU(3, init=0.2), [(IMG, "qint8", 0.05)], _plain),
    "GLU": (lambda: nn.GLU(1), [((2, 4, 6, 6), "qint8", 0.05)], _plain),
    "Softmax": (lambda: nn.Softmax(1), [(IMG, "qint8", 0.05)], _plain),
    "LayerNorm": (lambda: nn.LayerNorm(8), [((2, 3, 8), "qint8", 0.05)], _plain),
    "GridSample": (
        lambda: qnn.GridSample("bilinear", "zeros", False),
        [(IMG, "qint8", 0.05), ((2, 5, 6, 2), "qint16", 1.0 / 30000)],
        _plain,
    ),
    "RoIAlign": (lambda: qnn.RoIAlign((3, 4), 0.5, 2, False), [((2, 3, 12, 12), "qint8", 0.05)], _roi),
    "MultiScaleRoIAlign": (
        lambda: qnn.MultiScaleRoIAlign(["p3", "p4"], 2, 2),
        [((2, 3, 12, 12), "qint8", 0.05), ((2, 3, 6, 6), "qint8", 0.04)],
        _ms_roi,
    ),
    "QFunctional-mean": (
        qnn.quantized.FloatFunctional,
        [(IMG, "qint8", 0.05)],
        lambda m, x: m.mean(x, dim=[2, 3], keepdim=True),
    ),
    "QFunctional-mul": (qnn.quantized.FloatFunctional, [(IMG, "qint8", 0.05)] * 2, lambda m, x, y: m.mul(x, y)),
    "LSTMCell": (
        lambda: nn.LSTMCell(4, 6),
        [((3, 4), "qint8", 0.02), ((3, 6), "qint8", 0.008), ((3, 6), "qint16", 0.0001)],
        _lstm,
    ),
    "MultiheadAttention": (lambda: nn.MultiheadAttention(8, 2), [((5, 2, 8), "qint8", 0.02)] * 3, _plain),
}


def _codes(spec: Sequence[tuple[tuple[int, ...], str, float]], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype, _ in spec:
        lo, hi = numerics.qrange(dtype)
        out.append(numerics.saturate(torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64), dtype))
    return out


def _pair(name: str) -> tuple[Any, Any, list[torch.Tensor], Call]:
    """The module converted from two QAT states: the second's activation scales and input scales
    differ (x 1.37 and x 1.21), its weights too (x 0.9)."""
    make, spec, call = CASES[name]
    torch.manual_seed(0)
    qat = QAT_MODULE_MAP[type(make())].from_float(make(), QC).eval()  # type: ignore[attr-defined]
    codes = _codes(spec, 1)
    with torch.no_grad():
        call(qat, *(numerics.dequantize(c, torch.tensor([s])) for c, (_, _, s) in zip(codes, spec, strict=True)))
    disable_observer(qat)
    other = copy.deepcopy(qat)
    with torch.no_grad():
        for n, m in other.named_modules():
            if isinstance(m, FakeQuantize) and "weight" not in n and not m.has_fixed_scale:
                m.scale.mul_(1.37)
        for p in other.parameters():
            p.mul_(0.9)
    qcls: Any = QUANTIZED_MODULE_MAP[type(qat)]
    a = qcls.from_qat(qat, [torch.tensor([s]) for _, _, s in spec], "bayes")
    b = qcls.from_qat(other, [torch.tensor([s * 1.21]) for _, _, s in spec], "bayes")
    return a, b, codes, call


def _outputs(out: Any) -> list[torch.Tensor]:
    return [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]


def _plain_attrs(m: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_loaded_state_dict_runs_its_own_requantizations(name: str) -> None:
    a, b, codes, call = _pair(name)
    for (pa, ma), (pb, mb) in zip(a.named_modules(), b.named_modules(), strict=True):
        assert pa == pb
        if isinstance(ma, QuantizedModule):
            # a plain attribute that depends on the scales is one the state dict carries
            differ = {k for k, v in _plain_attrs(ma).items() if v != _plain_attrs(mb).get(k)}
            assert differ <= set(type(ma).derived), (pa or name, differ - set(type(ma).derived))
    want = _outputs(call(a, *codes))
    call(b, *codes)  # lazily derived parameters (QFunctional, AdaptiveAvgPool2d) from b's own scales
    result = b.load_state_dict(a.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    got = _outputs(call(b, *codes))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (name, int((g.to(torch.int64) - w.to(torch.int64)).abs().max()))


def test_every_class_with_derived_integers_is_covered() -> None:
    seen: set[type] = set()
    for name in CASES:
        a, _, _, _ = _pair(name)
        seen.update(type(m) for m in a.modules())
    need = {c for c in _subclasses(QuantizedModule) if c.derived and not c.__subclasses__()}
    assert need <= seen, sorted(c.__name__ for c in need - seen)


def _subclasses(cls: type) -> set[type]:
    out = set()
    for c in cls.__subclasses__():
        out |= {c, *_subclasses(c)}
    return out


def test_a_checkpoint_without_the_derived_integers_loads_only_with_the_model_s_own_scales() -> None:
    a, b, codes, call = _pair("Interpolate")
    old = {k: v for k, v in a.state_dict().items() if not k.endswith(DERIVED_KEY)}  # written before the key
    same = copy.deepcopy(a)
    assert not same.load_state_dict(old, strict=True).missing_keys
    assert torch.equal(call(same, *codes), call(a, *codes))
    with pytest.raises(RuntimeError, match=r"Interpolate.*has no 'derived_ints'.*convert it again"):
        b.load_state_dict(old, strict=True)
    bad = {**a.state_dict(), DERIVED_KEY: torch.tensor([1, 2, 3])}
    with pytest.raises(RuntimeError, match="3 derived integers"):
        copy.deepcopy(a).load_state_dict(bad, strict=True)
