"""Python arithmetic on sizes stays exact ints in every mode: float, calibration, QAT, validation,
converted, checked and compiled (the artifact computes them at run time, so the batch stays free).

Before the fix, ``b * heads`` with ``b = x.shape[0]`` became a generated FloatFunctional
``mul_scalar`` that fake-quantized the int (8 became 7, reshape failed or, worse, ran), and
``x.view(x.shape[0], -1)`` could not be compiled (``.shape`` had no lowering rule)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from shape_models import SHAPE_MODELS, HeadsAttention
from torch import nn
from torch.ao.quantization import DeQuantStub

import qir
from qir.frontend import emit, trace
from qir.march import march_scope
from qir.quantization import (
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)


class _IntsOut(nn.Module):
    """Returns the size arithmetic itself, so an int that became a fake-quantized float shows."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = HeadsAttention()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        q = self.inner.quant(x)
        b, n, _ = q.shape
        return self.inner.dequant(q), b * self.inner.heads, n // 2 + b % 3


def _generated(m: nn.Module) -> list[str]:
    return [p for p, _ in m.named_children() if "_generated_" in p]


@pytest.mark.parametrize("kind", ["qat", "calibration"])
def test_size_arithmetic_is_never_quantized(kind: str) -> None:
    qconfig = get_default_qat_qconfig() if kind == "qat" else get_default_calib_qconfig()
    x = torch.randn(8, 6, 16) * 4
    prepared = prepare_qat_fx(HeadsAttention().eval(), {"": qconfig})
    assert _generated(prepared) == ["_generated_matmul_0", "_generated_matmul_1", "_generated_softmax_0"]
    ints = prepare_qat_fx(_IntsOut().eval(), {"": qconfig})
    assert not _generated(ints)  # no FloatFunctional (and so no fake quant) for b * heads
    for state in ("calibration", "qat", "validation"):
        set_fake_quantize(ints, state)
        for train in (True, False):
            ints.train(train)
            _, bh, half = ints(x)
            assert (type(bh), bh, type(half), half) == (int, 32, int, 3 + 8 % 3), (state, train)
            assert prepared.train(train)(x).shape == (8, 6, 16)


def _flow(model: nn.Module, shape: tuple[int, ...], march: str) -> tuple[nn.Module, nn.Module]:
    """calibrate -> one QAT step -> validation -> convert_fx, under ``march``; (prepared, converted)."""
    g = torch.Generator().manual_seed(0)
    with march_scope(march):
        calib = prepare_qat_fx(model, {"": get_default_calib_qconfig()})
        with torch.no_grad():
            for _ in range(2):
                calib(torch.randn(*shape, generator=g))
        qat = prepare_qat_fx(calib, {"": get_default_qat_qconfig()})
        qat.train()
        opt = torch.optim.SGD(qat.parameters(), lr=1e-3)
        loss = qat(torch.randn(*shape, generator=g)).square().mean()
        loss.backward()
        opt.step()
        qat.eval()
        set_fake_quantize(qat, "validation")
        return qat, convert_fx(qat)


@pytest.mark.parametrize("march_name", ["bayes", "bernoulli2"])
@pytest.mark.parametrize("name", sorted(SHAPE_MODELS))
def test_shape_model_through_every_stage(tmp_path: Path, name: str, march_name: str) -> None:
    cls, shape, legal = SHAPE_MODELS[name]
    float_model = cls().eval()
    x = torch.randn(*shape) * 2
    with torch.no_grad():
        want_shape = float_model(x).shape
    qat, converted = _flow(float_model, shape, march_name)
    with torch.no_grad():
        q, c = qat(x), converted(x)
    assert q.shape == c.shape == want_shape
    assert (c - q).norm() <= 0.05 * q.norm()  # validation vs integer: within a few LSB
    report = check_model(converted, (x,), march=march_name)
    size_ops = ("getattr", "size", "len", "numel", "dim", "floordiv", "mod", "mul", "add", "sub")
    # size arithmetic has no module; a FloatFunctional add of tensors (module _generated_add_0) is checked
    assert not any(f.op.rsplit(".", 1)[-1] in size_ops and not f.module for f in report.findings), report
    if march_name not in legal:
        assert not report.ok  # an op of the model (Linear, reshape) is illegal there
        return
    assert report.ok, report
    path = tmp_path / f"{name}.hbm"
    compile_model(converted, [x], hbm=path, march=march_name)
    run = qir.load_compiled(path)
    for batch in (shape[0], 3):  # sizes are computed at run time: another batch works too
        xb = torch.randn(batch, *shape[1:]) * 2
        with torch.no_grad():
            want = converted(xb)
        got = run(xb)
        assert got.shape == want.shape and torch.equal(got, want), (name, batch)


def test_len_traces_into_the_ir() -> None:
    """``len(x)`` is recorded (fx alone refuses it) and emitted back as ``len``."""

    class Net(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.reshape(len(x), -1)

    x = torch.randn(5, 2, 3)
    g = trace(Net(), (x,))
    assert [n.op.name for n in g.nodes if n.op.name == "len"] == ["len"]
    assert torch.equal(emit(g)(x), x.reshape(5, -1))
    assert "len" not in Net.forward.__globals__  # the name is only there while tracing


class _ResizeToOther(nn.Module):
    """Resize one input to the size of a second input (read only for its shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.dequant = DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        y = F.interpolate(self.conv(self.quant(x)), size=like.shape[2:], mode="bilinear", align_corners=False)
        return self.dequant(y)


def test_run_time_resize_size_is_checked_by_the_artifact(tmp_path: Path) -> None:
    """The resize tables are computed for the compiled sizes: another output size is refused
    at run time, never computed with the wrong tables."""
    x, like = torch.randn(2, 3, 6, 6), torch.randn(1, 1, 9, 11)
    prepared = prepare_qat_fx(_ResizeToOther().eval(), {"": get_default_qat_qconfig()})
    with torch.no_grad():
        prepared(x, like)
    converted = convert_fx(prepared.eval())
    compile_model(converted, [x, like], hbm=tmp_path / "r.hbm", march="bayes")
    run = qir.load_compiled(tmp_path / "r.hbm")
    assert torch.equal(run(x, like), converted(x, like))
    assert run(x, like).shape == (2, 4, 9, 11)
    with pytest.raises(RuntimeError, match=r"compiled for output size 9x11, asked for \(10, 11\)"):
        run(x, torch.randn(1, 1, 10, 11))


def test_tensors_built_from_sizes_are_bounded() -> None:
    """The artifact's zeros / ones / arange take sizes from run time or the file: bounded."""
    from backends.common.kernels.shape import MAX_BUILT_ELEMENTS, SHAPE_FUNCTIONS

    assert SHAPE_FUNCTIONS["zeros"]((2, 3)).shape == (2, 3)
    assert torch.equal(SHAPE_FUNCTIONS["arange"](4), torch.arange(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="elements"):
        SHAPE_FUNCTIONS["ones"](2**15, 2**15)
    with pytest.raises(ValueError, match="elements"):
        SHAPE_FUNCTIONS["arange"](0, MAX_BUILT_ELEMENTS + 1)
    with pytest.raises(ValueError, match="non-negative int"):
        SHAPE_FUNCTIONS["zeros"]((2, -1))
