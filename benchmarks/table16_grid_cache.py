"""A QAT forward on the integer grid through table lookups of qint16 codes: with the table cache
(backends.common.table16_cache) and without it (every call builds the segmented table and
interpolates through its knots, as before the cache), in one run.

The net: QuantStub, then three conv (qint16 output) + table blocks (tanh, sigmoid, SiLU: each a
segmented table of qint16 codes), a 1x1 conv head, DeQuantStub; ``prepare_qat_fx`` on Bayes, batch
``--batch``, 16 channels at ``--size`` x ``--size``. Two cases, each timed with and without the
cache, round-robin, in this process's CPU time with 1 torch thread; the figure is the minimum over
``--rounds`` of ``--steps`` forwards (autograd on, training mode):

* ``observers on``: every forward moves the scales, so every forward needs new tables (a miss per
  table op; the cache still saves the interpolation: a lookup is one gather);
* ``observers frozen`` (``disable_observer``, as late in QAT or a QAT-state model under ``eval()``):
  the scales stay, every forward after the first finds its tables.

Both modes' outputs are compared first (equal, bit for bit). Prints ms per forward and the ratio.

Then the cost of building one version-2 table (``lut_int16(..., measure=False)``, what a cache miss
pays) against the plain per-level build of benchmarks/table16_reference.py, per function, and the
``observers on`` forward (cache on) with each build, in the same run: the ratios are the speed-up of
the vectorised build. Both builds' tables are compared first (equal).

    PYTHONPATH=. python benchmarks/table16_grid_cache.py [--batch 8] [--size 32] [--rounds 5] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


class _Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from qir.quantization import DeQuantStub, QuantStub

        self.quant = QuantStub()
        self.convs = nn.ModuleList([nn.Conv2d(3 if i == 0 else 16, 16, 3, padding=1) for i in range(3)])
        self.acts = nn.ModuleList([nn.Tanh(), nn.Sigmoid(), nn.SiLU()])
        self.head = nn.Conv2d(16, 4, 1)
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        for conv, act in zip(self.convs, self.acts, strict=True):
            x = act(conv(x))
        return self.dq(self.head(x))


def _prepare() -> nn.Module:
    from qir.march import march_scope
    from qir.quantization import get_default_qat_qconfig, prepare_qat_fx

    q16 = get_default_qat_qconfig(dtype="qint16")
    qconfig = {"": get_default_qat_qconfig(), "module_name": {f"convs.{i}": q16 for i in range(3)}}
    torch.manual_seed(0)
    with march_scope("bayes"):
        return prepare_qat_fx(_Tables(), qconfig).train()


def cpu_per_call(fn: Callable[[], object], steps: int) -> float:
    t = time.process_time()
    for _ in range(steps):
        fn()
    return (time.process_time() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from backends.common.table16_cache import TABLE16_CACHE
    from qir.quantization import disable_observer, integer_grid_report

    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(args.batch, 3, args.size, args.size, generator=g) * 2 for _ in range(7)]
    x = batches[0]
    qat = _prepare()
    qat(x)
    assert all(r == "grid" for r in integer_grid_report(qat).values()), integer_grid_report(qat)
    seen = [0]

    def run(cached: bool) -> torch.Tensor:
        seen[0] += 1  # a new batch every step: the observers move the scales
        b = batches[seen[0] % len(batches)]
        if cached:
            return qat(b)
        with TABLE16_CACHE.disabled():
            return qat(b)

    frozen = _prepare()
    frozen(x)
    disable_observer(frozen)

    def run_frozen(cached: bool) -> torch.Tensor:
        if cached:
            return frozen(x)
        with TABLE16_CACHE.disabled():
            return frozen(x)

    # the same forward both ways: equal outputs (the frozen model, so both see the same scales)
    assert torch.equal(run_frozen(True), run_frozen(False))
    cases = {"observers on": run, "observers frozen": run_frozen}
    best: dict[tuple[str, bool], float] = {}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            for cached in (False, True):
                t = cpu_per_call(lambda fn=fn, cached=cached: fn(cached), args.steps)  # type: ignore[misc]
                best[(name, cached)] = min(best.get((name, cached), float("inf")), t)
    load = os.getloadavg()
    print(
        f"QAT forward, 3 qint16 table ops, batch {args.batch}, 16x{args.size}x{args.size}, 1 thread, "
        f"min of {args.rounds} x {args.steps}; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print(f"{'case':<18} {'no cache ms':>12} {'cache ms':>9} {'ratio':>6}")
    for name in cases:
        before, after = best[(name, False)] * 1e3, best[(name, True)] * 1e3
        print(f"{name:<18} {before:>12.2f} {after:>9.2f} {before / after:>5.2f}x")
    print(f"cache: {len(TABLE16_CACHE)} tables, {TABLE16_CACHE.hits} hits, {TABLE16_CACHE.misses} misses")
    _build_cost(run, args)
    _converted_lookup(frozen, x, args)


@contextmanager
def _reference_build() -> Iterator[None]:
    """Inside the block ``lut_int16`` places its knots by the plain per-level rule."""
    from backends.common import lut_segmented
    from benchmarks.table16_reference import reference_knots

    fast = lut_segmented._bounded_knots
    lut_segmented._bounded_knots = reference_knots
    try:
        yield
    finally:
        lut_segmented._bounded_knots = fast


def _build_cost(run: Callable[[bool], torch.Tensor], args: argparse.Namespace) -> None:
    from backends.common.lut_segmented import lut_int16
    from benchmarks.table16_reference import reference_table16

    functions: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "tanh": torch.tanh,
        "sigmoid": torch.sigmoid,
        "silu": nn.functional.silu,
        "gelu": nn.functional.gelu,
        "hardsigmoid": nn.functional.hardsigmoid,
        "exp": torch.exp,
    }
    s_in, s_out = 8 / 32767.5, 1 / 32767.5
    print(f"version-2 table build (qint16 output, input range 8), min of {args.rounds} x {args.steps}:")
    print(f"{'function':<18} {'reference ms':>12} {'build ms':>9} {'ratio':>6}")
    for name, fn in functions.items():
        got = lut_int16(fn, s_in, s_out, "qint16", measure=False).entries
        assert torch.equal(got, reference_table16(fn, s_in, s_out, "qint16", 512)), name
        before = after = float("inf")
        for _ in range(args.rounds):
            with _reference_build():
                before = min(
                    before, cpu_per_call(lambda fn=fn: lut_int16(fn, s_in, s_out, "qint16", measure=False), args.steps)
                )  # type: ignore[misc]
            after = min(
                after, cpu_per_call(lambda fn=fn: lut_int16(fn, s_in, s_out, "qint16", measure=False), args.steps)
            )  # type: ignore[misc]
        print(f"{name:<18} {before * 1e3:>12.2f} {after * 1e3:>9.2f} {before / after:>5.2f}x")
    before = after = float("inf")
    for _ in range(args.rounds):
        with _reference_build():
            before = min(before, cpu_per_call(lambda: run(True), args.steps))
        after = min(after, cpu_per_call(lambda: run(True), args.steps))
    print(
        f"observers on, cache on: reference build {before * 1e3:.2f} ms, vectorised build {after * 1e3:.2f} ms, "
        f"{before / after:.2f}x"
    )


def _converted_lookup(qat: nn.Module, x: torch.Tensor, args: argparse.Namespace) -> None:
    """The converted model's tanh (a qint16 UnaryLUT) on an activation of the same size: interpolating
    through the knots (before) against its table evaluated at every code (what its forward does)."""
    from backends.common.lut_segmented import lut_int16_apply
    from qir.march import march_scope
    from qir.quantization import convert_fx

    with march_scope("bayes"):
        lut = convert_fx(qat).get_submodule("acts.0")
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-32768, 32768, (args.batch, 16, args.size, args.size), generator=g, dtype=torch.int16)
    assert torch.equal(lut(codes), lut_int16_apply(lut.table16, codes, lut.dtype, lut.table16_version))
    before = after = float("inf")
    for _ in range(args.rounds):
        before = min(
            before, cpu_per_call(lambda: lut_int16_apply(lut.table16, codes, lut.dtype, lut.table16_version), 5)
        )
        after = min(after, cpu_per_call(lambda: lut(codes), 5))
    print(
        f"converted qint16 tanh, {codes.numel()} codes: interpolation {before * 1e3:.2f} ms, "
        f"full table {after * 1e3:.2f} ms, {before / after:.1f}x"
    )


if __name__ == "__main__":
    main()
