"""FloatFunctional trio: float (qir.nn.quantized.FloatFunctional) -> QAT -> integer QFunctional."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from nn_helpers import QC8, codes

from backends.common import numerics
from qir.nn import qat, quantized
from qir.quantization import FakeQuantize, disable_observer, get_default_qat_out_qconfig

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")

T = torch.Tensor
# name, call(ff, *inputs), input shapes, input scales, exact when scales are equal
CALLS: list[tuple[str, Callable[..., T], list[tuple[int, ...]], list[float]]] = [
    ("add", lambda f, x, y: f.add(x, y), [(2, 3, 4), (2, 3, 4)], [0.02, 0.03]),
    ("add-broadcast", lambda f, x, y: f.add(x, y), [(2, 3, 4), (1, 3, 1)], [0.02, 0.05]),
    ("add_relu", lambda f, x, y: f.add_relu(x, y), [(2, 3, 4), (2, 3, 4)], [0.02, 0.03]),
    ("sub", lambda f, x, y: f.sub(x, y), [(2, 3, 4), (2, 3, 4)], [0.02, 0.03]),
    ("mul", lambda f, x, y: f.mul(x, y), [(2, 3, 4), (2, 3, 4)], [0.02, 0.03]),
    ("add_scalar", lambda f, x: f.add_scalar(x, 0.7), [(2, 3, 4)], [0.02]),
    ("mul_scalar", lambda f, x: f.mul_scalar(x, -1.5), [(2, 3, 4)], [0.02]),
    ("cat", lambda f, x, y: f.cat([x, y], dim=1), [(2, 3, 4), (2, 2, 4)], [0.02, 0.03]),
    ("stack", lambda f, x, y: f.stack([x, y], dim=0), [(2, 3), (2, 3)], [0.02, 0.03]),
    ("matmul", lambda f, x, y: f.matmul(x, y), [(2, 3, 8), (2, 8, 5)], [0.02, 0.03]),
    ("mean", lambda f, x: f.mean(x, dim=[2, 3], keepdim=True), [(2, 3, 4, 5)], [0.02]),
    ("mean-all", lambda f, x: f.mean(x), [(2, 3, 4)], [0.02]),
    ("sum", lambda f, x: f.sum(x, dim=1), [(2, 3, 4)], [0.02]),
    ("maximum", lambda f, x, y: f.maximum(x, y), [(2, 3, 4), (2, 3, 4)], [0.02, 0.03]),
    ("minimum", lambda f, x, y: f.minimum(x, y), [(2, 3, 4), (2, 3, 4)], [0.02, 0.03]),
    ("exp", lambda f, x: f.exp(x), [(2, 3, 4)], [0.02]),
]


def _trio(
    call: Callable[..., T], shapes: list[tuple[int, ...]], scales: list[float], qconfig: Any = QC8, ff: Any = None
) -> tuple[T, T, Any, list[T]]:
    gen = torch.Generator().manual_seed(0)
    pairs = [codes(s, sc, gen) for s, sc in zip(shapes, scales, strict=True)]
    fl = ff if ff is not None else quantized.FloatFunctional()
    float_out = call(fl, *[p[1] for p in pairs])
    m = qat.FloatFunctional.from_float(fl, qconfig)
    call(m, *[p[1] for p in pairs])
    disable_observer(m)
    qat_out = call(m, *[p[1] for p in pairs])
    if m.activation_post_process is not None:
        assert torch.equal(
            numerics.dequantize(
                numerics.quantize(float_out, m.activation_post_process.scale, "qint8"), m.activation_post_process.scale
            ),
            qat_out,
        )
    q = quantized.QFunctional.from_qat(m, [torch.tensor([s]) for s in scales], "bayes")
    return qat_out, call(q, *[p[0] for p in pairs]), m, [p[0] for p in pairs]


@pytest.mark.parametrize(("name", "call", "shapes", "scales"), CALLS, ids=[c[0] for c in CALLS])
def test_trio_within_one_lsb(
    name: str, call: Callable[..., T], shapes: list[tuple[int, ...]], scales: list[float]
) -> None:
    qat_out, q_out, m, _ = _trio(call, shapes, scales)
    want = numerics.quantize(qat_out, m.activation_post_process.scale, "qint8")
    assert q_out.dtype == torch.int8
    assert int((q_out.to(torch.int64) - want.to(torch.int64)).abs().max()) <= 1


_CODE_REFS: dict[str, Callable[..., T]] = {
    "cat": lambda x, y: torch.cat([x, y], dim=1),
    "stack": lambda x, y: torch.stack([x, y], dim=0),
    "maximum": torch.maximum,
    "minimum": torch.minimum,
}


@pytest.mark.parametrize("name", sorted(_CODE_REFS))
def test_equal_scales_are_exact(name: str) -> None:
    _, call, shapes, _ = next(c for c in CALLS if c[0] == name)
    gen = torch.Generator().manual_seed(3)
    xs = [codes(s, 0.02, gen)[0] for s in shapes]
    m = qat.FloatFunctional(FakeQuantize(scale=0.02))  # output at the inputs' scale
    q = quantized.QFunctional.from_qat(m, [torch.tensor([0.02])] * len(shapes), "bayes")
    assert torch.equal(call(q, *xs), _CODE_REFS[name](*xs))


def test_high_precision_matmul() -> None:
    _, call, shapes, scales = next(c for c in CALLS if c[0] == "matmul")
    qat_out, q_out, _, _ = _trio(call, shapes, scales, qconfig=get_default_qat_out_qconfig())
    assert q_out.dtype == torch.int32
    assert torch.allclose(numerics.dequantize(q_out, 0.02 * 0.03), qat_out, atol=1e-5)


def test_torch_float_functional_converts() -> None:
    from torch.ao.nn.quantized import FloatFunctional as TorchFF

    qat_out, q_out, m, _ = _trio(lambda f, x, y: f.add(x, y), [(4, 4), (4, 4)], [0.02, 0.03], ff=TorchFF())
    want = numerics.quantize(qat_out, m.activation_post_process.scale, "qint8")
    assert int((q_out.to(torch.int64) - want.to(torch.int64)).abs().max()) <= 1


def test_traced_add() -> None:
    _, q_out, m, q_in = _trio(lambda f, x, y: f.add(x, y), [(4, 4), (4, 4)], [0.02, 0.03])
    q = quantized.QFunctional.from_qat(m, [torch.tensor([0.02]), torch.tensor([0.03])], "bayes")

    class Wrap(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ff = q

        def forward(self, x: T, y: T) -> T:
            return self.ff.add(x, y)

    assert torch.equal(torch.jit.trace(Wrap(), tuple(q_in))(*q_in), q_out)


def test_errors() -> None:
    ff = quantized.FloatFunctional()
    with pytest.raises(RuntimeError, match="call one of its methods"):
        ff(torch.zeros(1))
    m = qat.FloatFunctional.from_float(ff, QC8)
    m.add(torch.ones(2), torch.ones(2))
    q = quantized.QFunctional.from_qat(m, [torch.tensor([0.1])], "bayes")
    with pytest.raises(ValueError, match="one scale per tensor input"):
        q.add(torch.ones(2, dtype=torch.int8), torch.ones(2, dtype=torch.int8))
    with pytest.raises(TypeError, match="FloatFunctional"):
        qat.FloatFunctional.from_float(torch.nn.ReLU(), QC8)
