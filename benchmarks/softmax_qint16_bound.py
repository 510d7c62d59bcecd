"""How close the QAT forward of a qint16-input softmax comes to its proven bound (docs/semantics.md,
"What stays float fake quantization in training"), over random rows built to line the exp table's
rounding errors up: ``--rows`` rows of 2 to 300 logits (spreads 0.25 to 40) with a random share of them
at the offset below the maximum where ``exp`` is a random fraction of a table step; a fresh module per
row (its output observer sees the row first). Prints the worst element measured, the bound at that
element, the largest bound met, and the constructed worst rows (every other exp just under half a step).
tests/quantization/test_softmax_qint16_bound.py checks every element against the same bound.

    PYTHONPATH=. python benchmarks/softmax_qint16_bound.py [--rows 400] [--seed 1]
"""

from __future__ import annotations

import argparse
import math
import random

import torch
from torch import nn

from backends.common.math_rules import SOFTMAX_EXP_SCALE

__all__ = ["bound_lsb", "measure", "prepare", "row", "worst_row"]


class _Softmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from qir.quantization import DeQuantStub, QuantStub

        self.quant = QuantStub()
        self.sm = nn.Softmax(dim=-1)
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dq(self.sm(self.quant(x)))


def prepare(out16: bool) -> nn.Module:
    """A QAT model (Bayes) whose softmax reads qint16 codes; its output qint16 (``out16``) or qint8."""
    from qir.march import march_scope
    from qir.quantization import get_default_qat_qconfig, prepare_qat_fx

    q16 = get_default_qat_qconfig(dtype="qint16")
    qconfig = {"": q16 if out16 else get_default_qat_qconfig(), "module_name": {"quant": q16}}
    with march_scope("bayes"):
        return prepare_qat_fx(_Softmax(), qconfig, example_inputs=(torch.randn(2, 8),)).train()


#: float32's unit roundoff
_U = 2.0**-24


def bound_lsb(x: torch.Tensor, s_out: float) -> torch.Tensor:
    """Output LSBs between the QAT forward ``fq_out(e / sum(e))``, ``e = fq_e(exp(x - max))``, and
    ``round(softmax(x) / s_out)``, per element, from the row's exact exps ``E = exp(x - max)``
    (docs/semantics.md gives the proof):

    * each exp code's error ``|e_j - E_j|`` is at most ``a_j = min(s_e / 2, E_j)`` (an exp below half
      a step rounds to 0, losing all of itself and no more), plus float32's exp and subtraction
      (``(|x_j - max| + 2) u E_j``); the row maximum's is ``|32767 s_e - 1|`` (``exp(0) = 1`` is a code);
    * ``e_i / sum(e) - p_i = (d_i (1 - p_i) - p_i sum_{j != i} d_j) / (S + sum_j d_j)`` with
      ``d = e - E`` and ``S = sum(E) = 1 / max(p)``: at most ``(a_i (1 - p_i) + p_i (A - a_i)) / (S - A)``,
      ``A = sum(a)`` (``S - A >= 1 - a_max``: the maximum's exp is 1);
    * float32's sum, products and division move the ratio by at most ``(n + 6) u`` of itself;
    * two values ``err`` apart round to codes at most ``ceil(err / s_out)`` apart (the clamp to the
      output range only brings them closer)."""
    x64 = x.to(torch.float64)
    d = x64 - x64.amax(dim=-1, keepdim=True)
    e = torch.exp(d)
    s = e.sum(dim=-1, keepdim=True)
    p = e / s
    a = torch.minimum(e, torch.full_like(e, SOFTMAX_EXP_SCALE / 2)) + (d.abs() + 2) * _U * e
    a = torch.where(d == 0, torch.full_like(e, abs(32767 * SOFTMAX_EXP_SCALE - 1) + 2 * _U), a)
    total = a.sum(dim=-1, keepdim=True)
    err = (a * (1 - p) + p * (total - a)) / (s - total)
    err = err + (p + err) * (x.shape[-1] + 6) * _U
    return torch.ceil(err / s_out)


def measure(sm: nn.Module, x: torch.Tensor, out16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The QAT forward's distance from the exact softmax rounded to the output grid, and its bound (LSBs)."""
    out = sm(x)
    s_out = float(sm.activation_post_process.scale)
    got = (out.to(torch.float64) / s_out).round()
    lo, hi = (-32768, 32767) if out16 else (-128, 127)
    want = torch.floor(torch.softmax(x.to(torch.float64), dim=-1) / s_out + 0.5).clamp(lo, hi)
    return (got - want).abs(), bound_lsb(x, s_out)


def row(n: int, spread: float, seed: int, cluster: int, ratio: float) -> torch.Tensor:
    """A row of ``n`` qint16 logits at scale ``spread * 3 / 32767``: random, with ``cluster`` of them at
    the offset below the maximum where ``exp`` is ``ratio`` exp-table steps (``ratio`` near 1/2 or
    3/2: every one of them rounds by almost half a step the same way: the proof's worst case)."""
    s_in = float(torch.tensor(spread * 3 / 32767, dtype=torch.float32))
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(1, n, generator=g) * spread / s_in).round().clamp(-32768, 32767)
    top = float(codes.max())
    codes[0, :cluster] = max(-32768.0, top + round(math.log(ratio * SOFTMAX_EXP_SCALE) / s_in))
    return (codes * s_in).to(torch.float32)


def worst_row(n: int) -> torch.Tensor:
    """The maximum alone, the other ``n - 1`` logits where ``exp`` is just under half a table step."""
    s_in = float(torch.tensor(90 / 32767, dtype=torch.float32))
    codes = torch.full((1, n), float(round(math.log(0.4999 * SOFTMAX_EXP_SCALE) / s_in)))
    codes[0, -1] = 0
    return (codes * s_in).to(torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    worst, at, largest = 0.0, 0.0, 0.0
    for _ in range(args.rows):
        n = rng.randint(2, 300)
        x = row(n, rng.uniform(0.25, 40.0), rng.randint(0, 2**16), int(rng.random() * (n - 1)), rng.uniform(0.01, 2.0))
        diff, bound = measure(prepare(True).get_submodule("sm"), x, True)
        if not bool((diff <= bound).all()):
            raise AssertionError(f"a row of {n} breaks the bound: {float((diff - bound).max())} LSB over")
        largest = max(largest, float(bound.max()))
        k = int(diff.argmax())
        if float(diff.flatten()[k]) > worst:
            worst, at = float(diff.flatten()[k]), float(bound.flatten()[k])
    print(
        f"{args.rows} random rows, qint16 output: worst element {worst:.0f} LSB (its bound {at:.0f}); "
        f"largest bound {largest:.0f}"
    )
    for n in (8, 64, 300):
        diff, bound = measure(prepare(True).get_submodule("sm"), worst_row(n), True)
        print(f"worst row of {n}: measured {float(diff.max()):.0f} LSB, bound {float(bound.max()):.0f}")


if __name__ == "__main__":
    main()
