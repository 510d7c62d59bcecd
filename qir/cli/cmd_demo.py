"""``qir demo``: the built-in example, end to end on what the compiler does today.

Traces the built-in digits CNN into the IR, runs the pipeline (BN absorption,
fusion, dead-code elimination) with timing and verification, emits a torch
module back, and checks the emitted module against the original.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from qir.cli.errors import UserError

DEFAULT_PIPELINE = "absorb-bn,fuse,dce"


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the built-in example end to end")
    p.add_argument("--pipeline", default=DEFAULT_PIPELINE, help=f"pass pipeline (default {DEFAULT_PIPELINE!r})")
    p.add_argument("--out", default="qir-demo", help="output folder (default ./qir-demo)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    import passes
    from qir.examples import DigitsNet
    from qir.frontend import emit, trace
    from qir.ir.printer import print_graph

    torch.manual_seed(args.seed)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output folder {out}: {e}") from None
    model = DigitsNet().eval()
    # Non-trivial batch-norm statistics, so BN absorption has real work to do.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                assert m.running_mean is not None and m.running_var is not None
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    x = torch.randn(8, 1, 28, 28)

    stages: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    graph = trace(model, (x,))
    stages.append(("trace", time.perf_counter() - t0))
    (out / "traced.qir").write_text(print_graph(graph))

    timing = passes.TimingInstrument()
    t0 = time.perf_counter()
    try:
        result = passes.run_pipeline(graph, args.pipeline, instruments=[timing])
    except passes.PipelineError as e:
        raise UserError(str(e)) from None
    stages.append((f"pipeline ({args.pipeline})", time.perf_counter() - t0))
    (out / "optimized.qir").write_text(print_graph(result.graph))

    t0 = time.perf_counter()
    emitted = emit(result.graph)
    stages.append(("emit", time.perf_counter() - t0))
    with torch.no_grad():
        diff = (emitted(x) - model(x)).abs().max().item()

    ops_before = _count_ops(graph)
    ops_after = _count_ops(result.graph)
    print(f"qir demo: built-in DigitsNet, input {tuple(x.shape)}\n")
    print(f"{'stage':<40} {'seconds':>9}")
    for name, secs in stages:
        print(f"{name:<40} {secs:>9.4f}")
    print()
    print(timing.report())
    print()
    print(f"{'op':<14} {'before':>7} {'after':>7}")
    for op in sorted(set(ops_before) | set(ops_after)):
        print(f"{op:<14} {ops_before.get(op, 0):>7} {ops_after.get(op, 0):>7}")
    print()
    print(f"emitted vs original: max |diff| = {diff:.3g}  ({'equal' if diff <= 1e-4 else 'DIFFERENT'})")
    print(f"IR written to {out / 'traced.qir'} and {out / 'optimized.qir'}")
    return 0 if diff <= 1e-4 else 3


def _count_ops(graph: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in graph.nodes:
        if n.op.name != "constant":
            counts[n.op.name] = counts.get(n.op.name, 0) + 1
    return counts
