"""GridSample: float, QAT and integer modules; the integer rule against QAT and a float reference.

The converted module is compared with the QAT module on the same input and grid codes:
nearest selects the same codes (exact), bilinear is within 1 output LSB (docs/semantics.md,
"Grid sample").
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from backends.common import numerics
from backends.common.sampling_rules import grid_axis, source_fixed
from qir.nn import GridSample, qat, quantized
from qir.nn.qat.grid_sample import GRID_COORD_BITS, grid_sample_nearest
from qir.quantization import get_default_qat_qconfig

QC = get_default_qat_qconfig()
CASES = list(itertools.product(["bilinear", "nearest"], ["zeros", "border"], [False, True], ["qint8", "qint16"]))


def _pair(
    mode: str, pad: str, ac: bool, s_in: float, s_g: float, s_out: float
) -> tuple[torch.nn.Module, torch.nn.Module]:
    m = qat.GridSample.from_float(GridSample(mode, pad, ac), QC).eval()
    if m.activation_post_process is not None:
        m.activation_post_process.disable_observer().scale.fill_(s_out)  # a fixed output scale
    return m, quantized.GridSample.from_qat(m, [torch.tensor(s_in), torch.tensor(s_g)], "bayes")


@pytest.mark.parametrize(("mode", "pad", "ac", "gdt"), CASES)
def test_integer_matches_qat(mode: str, pad: str, ac: bool, gdt: str) -> None:
    gmax = 32767 if gdt == "qint16" else 127
    for seed in range(12):
        gen = torch.Generator().manual_seed(seed)
        s_in = float(torch.empty(1).uniform_(0.005, 0.2, generator=gen))
        s_out = s_in * float(torch.empty(1).uniform_(0.6, 1.5, generator=gen))
        s_g = float(torch.empty(1).uniform_(1.0, 1.3, generator=gen)) / gmax  # grid beyond [-1, 1] too
        h, w = (int(v) for v in torch.randint(1, 20, (2,), generator=gen))
        q = torch.randint(-128, 128, (2, 3, h, w), generator=gen, dtype=torch.int8)
        g = torch.randint(-gmax - 1, gmax + 1, (2, 7, 9, 2), generator=gen).to(numerics.qdtype(gdt).to_torch())
        m, qm = _pair(mode, pad, ac, s_in, s_g, s_out)
        with torch.no_grad():
            ref = m(numerics.dequantize(q, s_in), numerics.dequantize(g, s_g))
        got = qm(q, g)
        assert got.dtype == torch.int8 and got.shape == (2, 3, 7, 9)
        want = numerics.quantize(ref, s_in if mode == "nearest" else s_out, "qint8")
        bound = 0 if mode == "nearest" else 1
        assert int((got.to(torch.int64) - want.to(torch.int64)).abs().max()) <= bound


def _float_reference(x: torch.Tensor, grid: torch.Tensor, pad: str, ac: bool) -> torch.Tensor:
    """Bilinear grid sampling written out per output position (float64)."""
    n, c, h, w = x.shape
    out = torch.zeros(n, c, grid.shape[1], grid.shape[2], dtype=torch.float64)
    for b, i, j in itertools.product(range(n), range(grid.shape[1]), range(grid.shape[2])):
        gx, gy = float(grid[b, i, j, 0]), float(grid[b, i, j, 1])
        sx = (gx + 1) / 2 * (w - 1) if ac else ((gx + 1) * w - 1) / 2
        sy = (gy + 1) / 2 * (h - 1) if ac else ((gy + 1) * h - 1) / 2
        if pad == "border":
            sx, sy = min(max(sx, 0.0), w - 1.0), min(max(sy, 0.0), h - 1.0)
        x0, y0 = int(torch.floor(torch.tensor(sx))), int(torch.floor(torch.tensor(sy)))
        for yy, xx in itertools.product((y0, y0 + 1), (x0, x0 + 1)):
            if 0 <= yy < h and 0 <= xx < w:
                wgt = (1 - abs(sx - xx)) * (1 - abs(sy - yy))
                out[b, :, i, j] += wgt * x[b, :, yy, xx].double()
    return out


@pytest.mark.parametrize(("pad", "ac"), list(itertools.product(["zeros", "border"], [False, True])))
def test_float_module_and_reference_agree_with_torch(pad: str, ac: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 5, 6, generator=gen)
    grid = torch.rand(1, 4, 3, 2, generator=gen) * 2.4 - 1.2
    got = GridSample("bilinear", pad, ac)(x, grid)
    torch.testing.assert_close(got.double(), _float_reference(x, grid, pad, ac), atol=1e-5, rtol=1e-5)


def test_nearest_rounds_half_up_where_torch_rounds_to_even() -> None:
    x = torch.arange(4.0).reshape(1, 1, 1, 4)
    grid = torch.zeros(1, 1, 1, 2)  # the centre: source x = 1.5 without align_corners
    assert float(F.grid_sample(x, grid, "nearest", "zeros", False)) == 2.0  # torch: half to even
    assert float(grid_sample_nearest(x, grid, "zeros", False)) == 2.0
    grid[..., 0] = -0.5  # source x = 0.5: torch gives 0, the deployed rule 1
    assert float(F.grid_sample(x, grid, "nearest", "zeros", False)) == 0.0
    assert float(grid_sample_nearest(x, grid, "zeros", False)) == 1.0


def test_fixed_point_coordinates_are_within_half_a_step_plus_the_multiplier_error() -> None:
    bits = GRID_COORD_BITS
    for size, ac, s_g in ((1, True, 1 / 127), (17, False, 1 / 127), (1024, True, 1.1 / 32767), (640, False, 3e-5)):
        ax = grid_axis(size, s_g, ac, bits)
        g = torch.arange(-32768, 32768, 7)
        span = size - 1 if ac else size
        exact = (g.double() * numerics.dequantize(torch.ones(1), s_g).double() + 1) * span
        exact = (exact - (0 if ac else 1)) / 2 * 2**bits
        # the 31-bit multiplier's relative error is below 2**-30 of |g * s_g * span * 2**(B-1)|
        bound = 0.5 + float((exact - (size - 1) * 2 ** (bits - 1)).abs().max()) * 2**-30
        assert float((source_fixed(g, ax).double() - exact).abs().max()) <= bound


def test_qat_gradients_flow() -> None:
    m = qat.GridSample.from_float(GridSample("bilinear", "zeros", False), QC).train()
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    grid = (torch.rand(2, 4, 4, 2) * 2 - 1).requires_grad_()
    m(x, grid).square().sum().backward()
    assert x.grad is not None and grid.grad is not None and bool(grid.grad.abs().sum() > 0)
    mn = qat.GridSample.from_float(GridSample("nearest", "border", True), QC)
    assert mn.activation_post_process is None and mn.is_scale_preserving
    x.grad = None
    mn(x, grid).sum().backward()
    assert x.grad is not None and float(x.grad.sum()) == 2 * 3 * 16


def test_errors_name_the_module_and_the_fix() -> None:
    with pytest.raises(ValueError, match="padding_mode must be one of zeros, border"):
        GridSample("bilinear", "reflection")
    with pytest.raises(ValueError, match="mode must be one of bilinear, nearest"):
        GridSample("bicubic")
    with pytest.raises(TypeError, match=r"takes qir\.nn\.GridSample"):
        qat.GridSample.from_float(torch.nn.ReLU(), QC)
    _, qm = _pair("bilinear", "zeros", False, 0.1, 1 / 127, 0.1)
    with pytest.raises(TypeError, match="grid must be integer codes"):
        qm(torch.zeros(1, 1, 2, 2, dtype=torch.int8), torch.zeros(1, 1, 1, 2))
    with pytest.raises(ValueError, match=r"grid must be \(N=1, Ho, Wo, 2\)"):
        qm(torch.zeros(1, 1, 2, 2, dtype=torch.int8), torch.zeros(1, 1, 2, dtype=torch.int8))
