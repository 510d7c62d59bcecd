"""A YOLOv8-style detector as RDK users write it for the BPU: Conv + BN + SiLU blocks, C2f blocks
that split a feature with ``list(x.chunk(2, 1))`` and grow the list with ``y.extend(m(y[-1]) ...)``,
SPPF with one ``nn.MaxPool2d`` called three times, ``nn.Upsample(None, 2, "nearest")`` + ``torch.cat``
in the neck, and a Detect head that concatenates its box and class convs per level, the head convs
at qint16. Calibration -> QAT -> convert -> check -> compile -> run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from names_flow import fx_flow
from torch import nn

from qir.march import March, march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    fuse_fx,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
)
from qir.quantization.prepare_checks import UnconvertibleModelError


class Conv(nn.Module):
    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    def __init__(self, c: int, shortcut: bool = True) -> None:
        super().__init__()
        self.cv1, self.cv2, self.add = Conv(c, c, 3), Conv(c, c, 3), shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.cv2(self.cv1(x)) if self.add else self.cv2(self.cv1(x))


class C2f(nn.Module):
    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = False) -> None:
        super().__init__()
        self.c = c2 // 2
        self.cv1 = Conv(c1, 2 * self.c, 1)
        self.cv2 = Conv((2 + n) * self.c, c2, 1)
        self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = list(self.cv1(x).chunk(2, 1))
        y.extend(m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


class SPPF(nn.Module):
    def __init__(self, c1: int, c2: int, k: int = 5) -> None:
        super().__init__()
        c_ = c1 // 2
        self.cv1, self.cv2 = Conv(c1, c_, 1), Conv(c_ * 4, c2, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.cv1(x)
        y1 = self.m(x)
        y2 = self.m(y1)
        return self.cv2(torch.cat((x, y1, y2, self.m(y2)), 1))


class Detect(nn.Module):
    def __init__(self, nc: int = 3, ch: tuple[int, ...] = (16, 32), reg_max: int = 4) -> None:
        super().__init__()
        self.nl = len(ch)
        self.cv2 = nn.ModuleList(nn.Sequential(Conv(x, 16, 3), nn.Conv2d(16, 4 * reg_max, 1)) for x in ch)
        self.cv3 = nn.ModuleList(nn.Sequential(Conv(x, 16, 3), nn.Conv2d(16, nc, 1)) for x in ch)

    def forward(self, x: list[torch.Tensor]) -> list[torch.Tensor]:
        for i in range(self.nl):
            x[i] = torch.cat((self.cv2[i](x[i]), self.cv3[i](x[i])), 1)
        return x


class TinyYOLO(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub(scale=1 / 128)
        self.stem = Conv(3, 16, 3, 2)
        self.b1 = nn.Sequential(Conv(16, 32, 3, 2), C2f(32, 32, 1, True))
        self.b2 = nn.Sequential(Conv(32, 32, 3, 2), C2f(32, 32, 1, True), SPPF(32, 32))
        self.up = nn.Upsample(None, 2, "nearest")
        self.h1 = C2f(64, 16)
        self.down = Conv(16, 16, 3, 2)
        self.h2 = C2f(48, 32)
        self.detect = Detect()
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = self.stem(self.quant(x))
        p3 = self.b1(x)
        p4 = self.b2(p3)
        n3 = self.h1(torch.cat([self.up(p4), p3], 1))
        n4 = self.h2(torch.cat([self.down(n3), p4], 1))
        return [self.dequant(o) for o in self.detect([n3, n4])]


HEAD_CONVS = [f"detect.cv{j}.{i}.1" for j in (2, 3) for i in (0, 1)]


def _image() -> tuple[torch.Tensor]:
    return (torch.rand(1, 3, 32, 32) * 2 - 1,)


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def test_c2f_chunk_into_a_list_traces_and_computes_the_float_model() -> None:
    model = TinyYOLO().eval()
    fused = fuse_fx(model)
    x = _image()
    with torch.no_grad():
        for got, want in zip(fused(*x), model(*x), strict=True):
            assert torch.allclose(got, want, atol=1e-5)
    # the two chunk pieces are two getitem nodes of one chunk call
    chunks = [n for n in fused.graph.nodes if n.target in ("chunk", torch.chunk)]
    assert len(chunks) == 4
    assert all(sorted(u.args[1] for u in c.users) == [0, 1] for c in chunks)  # type: ignore[union-attr]


def test_a_split_with_literal_sizes_iterates_too() -> None:
    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()
            self.conv = nn.Conv2d(6, 6, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            parts = [p * 2 for p in self.conv(self.quant(x)).split((2, 4), 1)]
            return self.dequant(torch.cat(parts[::-1], 1))

    model = Split().eval()
    x = torch.randn(1, 6, 4, 4)
    assert torch.allclose(fuse_fx(model)(x), model(x), atol=1e-6)


class ChunkFewer(nn.Module):
    """``chunk(4)`` of 5 channels: torch returns 3 pieces of 2, 2 and 1 (fewer than asked)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 5, 1)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self.dequant(p.relu()) for p in self.conv(self.quant(x)).chunk(4, 1)]


def test_a_chunk_into_fewer_pieces_than_asked_matches_torch() -> None:
    model = ChunkFewer().eval()
    x = torch.randn(2, 3, 4, 4)
    assert [p.shape[1] for p in model(x)] == [2, 2, 1]
    # with example inputs the tracer measures the piece count (the call's 4 indexed a missing piece)
    assert [p.shape[1] for p in fuse_fx(model, (x,))(x)] == [2, 2, 1]
    result = fx_flow(model, lambda: (torch.randn(2, 3, 4, 4),), steps=2, example_inputs=True)
    assert [p.shape[1] for p in result.integer_out] == [2, 2, 1]
    assert result.max_error() <= 2.01 * float(result.qat.get_submodule("conv").activation_post_process.scale)
    # without them the graph has the call's count: the run fails loudly, never a silently wrong list,
    # and the prepared model's error names the chunk call and the fix
    with pytest.raises(IndexError):
        fuse_fx(model)(x)
    prepared = prepare_qat_fx(model, {"": get_default_qat_qconfig()})
    with pytest.raises(IndexError, match=r"without example inputs.*'chunk' \(chunk\(4, dim=1\)\).*example_inputs="):
        prepared(x)


def test_the_detector_calibrates_trains_converts_and_compiles_with_qint16_heads() -> None:
    calib_int16 = get_default_calib_qconfig("qint16")
    calib = {"": get_default_calib_qconfig(), "module_name": dict.fromkeys(HEAD_CONVS, calib_int16)}
    qat = {"": get_default_qat_qconfig(), "module_name": dict.fromkeys(HEAD_CONVS, get_default_qat_qconfig("qint16"))}
    result = fx_flow(TinyYOLO().eval(), _image, calib, qat, steps=2)
    assert [tuple(o.shape) for o in result.integer_out] == [(1, 19, 8, 8), (1, 19, 4, 4)]
    lsb = max(float(result.qat.get_submodule(p).activation_post_process.scale) for p in HEAD_CONVS)
    assert result.max_error() <= 2.01 * lsb  # the integer grid in validation mode: within 2 qint16 LSB


def test_a_high_precision_conv_into_the_detect_cat_is_refused_at_prepare() -> None:
    # get_default_qat_out_qconfig on convs whose outputs Detect concatenates: the converted cat
    # would need one scale per input; prepare says which modules and what to change, before training
    # (convert refused it only after training)
    with pytest.raises(
        UnconvertibleModelError, match=r"detect\._generated_cat_0.*detect\.cv2\.0\.1.*high-precision.*DeQuantStub"
    ):
        prepare_qat_fx(
            TinyYOLO().eval(),
            {"": get_default_qat_qconfig(), "module_name": dict.fromkeys(HEAD_CONVS, get_default_qat_out_qconfig())},
        )
