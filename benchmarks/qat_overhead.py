"""QAT training-step overhead: float vs qir QAT (integer grid on / off) vs torch.ao QAT (x86), in one run.

For torchvision resnet18 and mobilenet_v2 (random weights, no download), times one
training step (forward + cross-entropy backward + SGD step) on a random batch of 8
224x224 images with a fixed number of threads: the float model, qir's QAT model
(``prepare_qat_fx`` with ``get_default_qat_qconfig``, march bayes) training on the integer
grid (the default, docs/semantics.md "Training on the integer grid") and with float fake
quantization (``set_integer_grid(model, False)``), and torch.ao's QAT model
(``torch.ao.quantization.quantize_fx.prepare_qat_fx`` with the x86 qconfig mapping;
deprecated upstream, its deprecation warnings are suppressed). The four run round-robin
after a warm-up; the figure is the median of ``--repeats`` steps, in wall time and in this
process's CPU time (steadier on a shared machine: other processes' load does not count).
Prints the overhead ratios against float; writes JSON and a bar chart.

    /work/tvenv/bin/python benchmarks/qat_overhead.py [--repeats 10] [--json out.json] [--png out.png]

``--op-times N``: instead, the CPU time of every dispatched tensor operator, per step, for the float
and the grid step (``N`` steps each, alternating, after the warm-up), summed by operator name: each
operator is timed with ``time.thread_time_ns`` inside a ``TorchDispatchMode``, so with ``--threads 1``
the figures are the work itself, not the wait of a thread descheduled on a loaded machine (the
mode's own Python overhead is outside the timed calls). The grid's native kernels, ctypes calls that no
dispatch mode sees, are timed around ``native.run`` and listed as ``native <entry point>``. Only the float
and grid models are built.

``--count-ops``: instead, the tensor operations one float and one grid step dispatch (after the warm-up;
a ``TorchDispatchMode`` count, the fixed per-step work as a number the machine's load does not blur), with
``--batch 2 --size 32`` for the fixed cost alone. Only the float and grid models are built.

Needs torchvision and matplotlib (``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Stubbed(nn.Module):
    """``dequant(model(quant(x)))``: the stubs a float torchvision model lacks (qir quantizes between them)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        from qir.quantization import DeQuantStub, QuantStub

        self.quant = QuantStub()
        self.model = model
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.model(self.quant(x)))


GRID = "qir QAT (grid)"
FLOAT_FQ = "qir QAT (float fq)"


def _model(name: str) -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, name)(weights=None)


def _step_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-5, momentum=0.9)

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def qir_qat(float_model: nn.Module, grid: bool = True) -> nn.Module:
    from qir.march import march_scope
    from qir.quantization import get_default_qat_qconfig, prepare_qat_fx, set_integer_grid

    with march_scope("bayes"):
        qat = prepare_qat_fx(Stubbed(copy.deepcopy(float_model)), {"": get_default_qat_qconfig()})
    return set_integer_grid(qat, grid)


def ao_qat(float_model: nn.Module, x: torch.Tensor) -> nn.Module:
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    torch.backends.quantized.engine = "x86"
    with warnings.catch_warnings():  # the fx flow is deprecated upstream: silence its warnings
        warnings.simplefilter("ignore")
        return prepare_qat_fx(copy.deepcopy(float_model).train(), get_default_qat_qconfig_mapping("x86"), (x,))


def measure(name: str, batch: int, size: int, repeats: int, warmup: int) -> dict[str, Any]:
    float_model = _model(name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, 1000, (batch,), generator=g)
    steps = {
        "float": _step_fn(float_model, x, y),
        GRID: _step_fn(qir_qat(float_model), x, y),
        FLOAT_FQ: _step_fn(qir_qat(float_model, grid=False), x, y),
        "torch.ao QAT": _step_fn(ao_qat(float_model, x), x, y),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn in steps.values():
            for _ in range(warmup):
                fn()
        ts: dict[str, list[float]] = {k: [] for k in steps}
        cpu: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(repeats):  # round-robin: the four share the machine's load
            for k, fn in steps.items():
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                ts[k].append((time.perf_counter() - t0) * 1e3)
                cpu[k].append((time.process_time() - c0) * 1e3)
    med = {k: statistics.median(v) for k, v in ts.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "model": name,
        "median_ms": med,
        "min_ms": {k: min(v) for k, v in ts.items()},
        "median_cpu_ms": med_cpu,
        "ratios": {k: med[k] / med["float"] for k in steps if k != "float"},
        "cpu_ratios": {k: med_cpu[k] / med_cpu["float"] for k in steps if k != "float"},
    }


def op_times(name: str, batch: int, size: int, steps: int, warmup: int) -> dict[str, dict[str, tuple[int, float]]]:
    """``{"float" | GRID: {operator: (calls, CPU ms)}}`` per step of model ``name`` (see ``--op-times``)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    float_model = _model(name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, 1000, (batch,), generator=g)
    fns = {"float": _step_fn(float_model, x, y), GRID: _step_fn(qir_qat(float_model), x, y)}
    # one thread: the calling thread's CPU time is the operator's; else the process's
    clock = time.thread_time_ns if torch.get_num_threads() == 1 else time.process_time_ns
    totals: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in fns}
    calls: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in fns}

    class _Timed(TorchDispatchMode):
        def __init__(self, kind: str) -> None:
            super().__init__()
            self.kind = kind

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            t0 = clock()
            out = func(*args, **(kwargs or {}))
            op = str(func.overloadpacket.__name__)
            totals[self.kind][op] += clock() - t0
            calls[self.kind][op] += 1
            return out

    # the grid's native kernels (qir.quantization.integer_grid_native) are ctypes calls, not dispatched
    # operators: timed here by wrapping native.run, under "native <entry point>"
    from backends.common.kernels import native

    current: list[str] = []
    real_run = native.run

    def timed_run(name: str, *args: Any, **kwargs: Any) -> int:
        t0 = clock()
        out = real_run(name, *args, **kwargs)
        if current:
            totals[current[0]][f"native {name}"] += clock() - t0
            calls[current[0]][f"native {name}"] += 1
        return out

    native.run = timed_run  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for fn in fns.values():
                for _ in range(warmup):
                    fn()
            for _ in range(steps):
                for k, fn in fns.items():
                    current[:] = [k]
                    with _Timed(k):
                        fn()
                    current.clear()
    finally:
        native.run = real_run  # type: ignore[assignment]
    return {k: {op: (n // steps, totals[k][op] / steps / 1e6) for op, n in calls[k].items()} for k in fns}


def count_step_ops(name: str, batch: int, size: int, warmup: int) -> dict[str, int]:
    """``{"float" | GRID: tensor operations dispatched by one training step}`` of model ``name``."""
    from grid_conv_fixed_cost import count_ops

    float_model = _model(name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, 1000, (batch,), generator=g)
    fns = {"float": _step_fn(float_model, x, y), GRID: _step_fn(qir_qat(float_model), x, y)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn in fns.values():
            for _ in range(max(1, warmup)):
                fn()
        return {k: sum(count_ops(fn).values()) for k, fn in fns.items()}


def print_op_times(name: str, t: dict[str, dict[str, tuple[int, float]]], top: int = 25) -> None:
    sums = {k: sum(ms for _, ms in v.values()) for k, v in t.items()}
    print(
        f"{name}: operator CPU ms per step, float {sums['float']:.0f}, grid {sums[GRID]:.0f} "
        f"({sums[GRID] / sums['float']:.2f}x)"
    )
    ops = sorted(
        set(t["float"]) | set(t[GRID]),
        key=lambda op: -max(t["float"].get(op, (0, 0.0))[1], t[GRID].get(op, (0, 0.0))[1]),
    )
    print(f"{'operator':<32} {'float calls':>11} {'ms':>8} {'grid calls':>11} {'ms':>8}")
    for op in ops[:top]:
        (fc, fm), (gc, gm) = t["float"].get(op, (0, 0.0)), t[GRID].get(op, (0, 0.0))
        print(f"{op:<32} {fc:>11} {fm:>8.1f} {gc:>11} {gm:>8.1f}")


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ["float", GRID, FLOAT_FQ, "torch.ao QAT"]
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.2
    for i, kind in enumerate(kinds):
        xs = [j + (i - 1.5) * width for j in range(len(rows))]
        ys = [r["median_ms"][kind] for r in rows]
        bars = ax.bar(xs, ys, width, label=kind)
        for b, r in zip(bars, rows, strict=True):
            ratio = "" if kind == "float" else f"\n{r['median_ms'][kind] / r['median_ms']['float']:.2f}x float"
            ax.annotate(
                f"{b.get_height():.0f} ms{ratio}",
                (b.get_x() + b.get_width() / 2, b.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(range(len(rows)), [r["model"] for r in rows])
    ax.set_ylabel("training step, median (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.set_ylim(0, max(max(r["median_ms"].values()) for r in rows) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--op-times", type=int, default=0, metavar="N", help="per-operator CPU time over N steps instead")
    ap.add_argument("--count-ops", action="store_true", help="tensor operations per step instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.count_ops:
        for m in args.models:
            n = count_step_ops(m, args.batch, args.size, args.warmup)
            print(f"{m}, batch {args.batch}, {args.size}x{args.size}: tensor operations per step, {n}")
        return 0
    if args.op_times:
        for m in args.models:
            print_op_times(m, op_times(m, args.batch, args.size, args.op_times, args.warmup))
        return 0
    rows = [measure(m, args.batch, args.size, args.repeats, args.warmup) for m in args.models]
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {args.threads} threads, "
        f"batch {args.batch}, {args.size}x{args.size}, median of {args.repeats} steps after {args.warmup} warm-up"
    )
    kinds = [GRID, FLOAT_FQ, "torch.ao QAT"]
    print(f"{'model':<14} {'float':>8} " + " ".join(f"{k:>19}" for k in kinds) + "   (ratio to float: wall / CPU)")
    for r in rows:
        m, q, c = r["median_ms"], r["ratios"], r["cpu_ratios"]
        cells = " ".join(f"{m[k]:>6.0f}ms {q[k]:>4.2f}x/{c[k]:>4.2f}x" for k in kinds)
        print(f"{r['model']:<14} {m['float']:>6.0f}ms {cells}")
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": args.threads,
        "batch": args.batch,
        "size": args.size,
        "repeats": args.repeats,
        "warmup": args.warmup,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=2)
    if args.png:
        plot(
            rows,
            args.png,
            f"QAT training step (fwd+bwd+SGD), batch {args.batch}, {args.size}x{args.size}, "
            f"{args.threads} threads, median of {args.repeats}\n"
            f"torch {torch.__version__}; shared noisy machine: compare bars within one model",
        )
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
