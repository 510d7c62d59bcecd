"""Pipeline cost vs graph size: is qir linear in the number of nodes?

Builds chains of N conv-bn-relu blocks (N = 200, 1,000, 5,000 by default), then times
each stage: qir trace (fx trace + shape propagation + IR build), the pass pipeline
(absorb-bn, fuse, with verification between passes), a final verify, and emit back to
a torch GraphModule, beside ``torch.fx.symbolic_trace`` alone on the same model as the
baseline measured in the same run. Prints seconds per 1,000 IR nodes per stage and the
growth of that figure from the smallest to the largest size (flat = linear cost).

    python benchmarks/pipeline_cost.py [--sizes 200 1000 5000] [--repeat 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import passes
from qir.frontend import emit, trace
from qir.ir.verifier import verify


def chain(n: int, ch: int = 4) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(n):
        layers += [nn.Conv2d(ch, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU()]
    return nn.Sequential(*layers).eval()


def best_of(repeat: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure(n: int, repeat: int) -> dict[str, Any]:
    model = chain(n)
    x = torch.randn(1, 4, 4, 4)
    t_fx, _ = best_of(repeat, lambda: torch.fx.symbolic_trace(model))
    t_trace, graph = best_of(repeat, lambda: trace(model, (x,)))
    nodes = len(graph) + len(graph.inputs)
    t_pipe, result = best_of(repeat, lambda: passes.run_pipeline(graph, "absorb-bn,fuse"))
    t_verify, _ = best_of(repeat, lambda: verify(result.graph))
    t_emit, gm = best_of(repeat, lambda: emit(result.graph))
    with torch.no_grad():
        diff = (gm(x) - model(x)).abs().max().item()
    if diff > 1e-3:
        raise SystemExit(f"chain({n}): emitted model differs from the original by {diff}")
    stages = {"fx.symbolic_trace": t_fx, "qir trace": t_trace, "absorb-bn,fuse": t_pipe,
              "verify": t_verify, "emit": t_emit}
    total = t_trace + t_pipe + t_verify + t_emit
    return {"blocks": n, "nodes": nodes, "seconds": stages, "qir_total": total,
            "per_1000_nodes": {k: v / nodes * 1000 for k, v in {**stages, "qir total": total}.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[200, 1000, 5000])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    # Warm up one-time costs (lazy torch imports, meta kernels) outside the measurement.
    measure(20, 1)
    rows = [measure(n, args.repeat) for n in args.sizes]
    stages = list(rows[0]["per_1000_nodes"])
    print(f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}")
    print(f"seconds per 1,000 IR nodes (best of {args.repeat})")
    print(f"{'blocks':>7} {'nodes':>7} " + " ".join(f"{s:>18}" for s in stages))
    for r in rows:
        print(f"{r['blocks']:>7} {r['nodes']:>7} " + " ".join(f"{r['per_1000_nodes'][s]:>18.4f}" for s in stages))
    first, last = rows[0], rows[-1]
    print(f"\ngrowth of s/node from {first['blocks']} to {last['blocks']} blocks (1.0 = perfectly linear):")
    worst = 0.0
    for s in stages:
        g = last["per_1000_nodes"][s] / first["per_1000_nodes"][s]
        worst = max(worst, g) if s != "fx.symbolic_trace" else worst
        print(f"  {s:<20} {g:6.2f}x")
    qir_vs_fx = last["qir_total"] / last["seconds"]["fx.symbolic_trace"]
    print(f"\nqir total / fx.symbolic_trace at {last['blocks']} blocks: {qir_vs_fx:.1f}x")
    print(f"worst qir stage growth: {worst:.2f}x (target <= 1.5x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "python": platform.python_version(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
