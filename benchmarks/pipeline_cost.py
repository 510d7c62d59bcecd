"""Pipeline cost vs graph size: is qir linear in the number of nodes?

Builds chains of N conv-bn-relu blocks (N = 200, 1,000, 5,000 by default), then times
each stage: qir trace (fx trace + shape propagation + IR build), the pass pipeline
(absorb-bn, fuse, with verification between passes), a final verify, and emit back to
a torch GraphModule, beside ``torch.fx.symbolic_trace`` alone on the same model as the
baseline measured in the same run. Prints seconds per 1,000 IR nodes per stage and the
growth of that figure from the smallest to the largest size (flat = linear cost).

It also times the user-facing flow on the same chains (between a QuantStub and a
DeQuantStub, march bayes): qir's ``prepare_qat_fx`` and ``convert_fx`` (by module swapping,
and with ``example_inputs`` by the ``quantize`` pass) beside torch.ao's
``torch.ao.quantization.quantize_fx.prepare_qat_fx`` / ``convert_fx`` with the x86
(fbgemm) qconfig mapping, and prints the qir / torch.ao ratio per stage. torch.ao's fx
flow is deprecated upstream; its deprecation warnings are suppressed here. torch.ao runs
on chains up to ``--ao-max-blocks`` blocks (default 5,000); larger sizes print "capped".
The flows print wall time and process CPU time (``time.process_time``) side by side: on a
shared machine the wall time counts the time other processes held the cores, the CPU time
does not, so the CPU ratios stay comparable under load.

    python benchmarks/pipeline_cost.py [--sizes 200 1000 5000] [--repeat 2] [--ao-max-blocks 5000]
        [--json out.json] [--png out.png]

``--resnet50`` measures instead prepare_qat_fx + convert_fx on torchvision's resnet50 (between
stubs, march bayes, a 1x3x64x64 input) beside torch.ao's on the same network, and prints the
ratios (wall and CPU); it needs torchvision (``PYTHONPATH=. /work/tvenv/bin/python benchmarks/pipeline_cost.py
--resnet50`` on the development machine).

The plot needs matplotlib (``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import sys
import time
import warnings
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


class Stubbed(nn.Module):
    """``dequant(body(quant(x)))``: where the quantization flows start and stop."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        from torch.ao.quantization import DeQuantStub

        from qir.quantization import QuantStub

        self.quant = QuantStub()
        self.body = body
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.body(self.quant(x)))


def profiled_model(resnet50: bool, blocks: int) -> tuple[nn.Module, torch.Tensor, str]:
    """The profile scripts' model, input and name (1 torch thread, seed 0): torchvision's resnet50 at
    64x64, or the chain of ``blocks`` conv-bn-relu blocks, between stubs, in training mode."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if resnet50:
        try:
            from torchvision.models import resnet50 as build
        except ImportError as e:
            raise SystemExit(f"--resnet50 needs torchvision ({e})") from e
        return Stubbed(build()).train(), torch.randn(1, 3, 64, 64), "resnet50"
    return Stubbed(chain(blocks)).train(), torch.randn(1, 4, 8, 8), f"chain({blocks})"


def measure_flows(n: int, repeat: int, nodes: int, with_ao: bool) -> dict[str, Any]:
    """Seconds of prepare_qat_fx / convert_fx for qir and (when ``with_ao``) torch.ao on chain(n)."""
    from qir.march import march_scope
    from qir.quantization import convert_fx, get_default_qat_qconfig, prepare_qat_fx

    model = Stubbed(chain(n)).train()
    x = torch.randn(1, 4, 4, 4)
    out: dict[str, float] = {}
    cpu: dict[str, float] = {}

    def run(key: str, fn: Callable[[], Any]) -> Any:
        out[key], cpu[key], result = timed(repeat, fn)
        return result

    with march_scope("bayes"):
        prepared = run("qir prepare_qat_fx", lambda: prepare_qat_fx(model, {"": get_default_qat_qconfig()}))
        prepared.eval()
        with torch.no_grad():
            prepared(x)
        swapped = run("qir convert_fx", lambda: convert_fx(prepared))
        # with example inputs the chain converts by the quantize pass (trace -> quantize -> emit)
        by_pass = run("qir convert_fx (quantize pass)", lambda: convert_fx(prepared, example_inputs=x))
        if by_pass.meta.get("qir.convert_path") != "quantize pass" or not torch.equal(by_pass(x), swapped(x)):
            raise SystemExit(f"chain({n}): the quantize pass path did not run or differs from module swapping")
    if with_ao:
        from torch.ao.quantization import get_default_qat_qconfig_mapping
        from torch.ao.quantization.quantize_fx import convert_fx as ao_convert_fx
        from torch.ao.quantization.quantize_fx import prepare_qat_fx as ao_prepare_qat_fx

        torch.backends.quantized.engine = "x86"
        mapping = get_default_qat_qconfig_mapping("x86")
        body = chain(n).train()  # torch.ao needs no stubs: it quantizes the graph's inputs itself
        # qir's prepare_qat_fx / convert_fx deep-copy their input (the user's model is untouched); torch.ao's
        # modify theirs, so the timed torch.ao calls include a deep copy too (same work, same contract)
        with warnings.catch_warnings():  # torch.ao's fx flow is deprecated upstream: silence its warnings
            warnings.simplefilter("ignore")
            ao_prepared = run("torch.ao prepare_qat_fx", lambda: ao_prepare_qat_fx(copy.deepcopy(body), mapping, (x,)))
            ao_prepared.eval()
            with torch.no_grad():
                ao_prepared(x)
            run("torch.ao convert_fx", lambda: ao_convert_fx(copy.deepcopy(ao_prepared)))
    return {
        "seconds": out,
        "cpu_seconds": cpu,
        "per_1000_nodes": {k: v / nodes * 1000 for k, v in out.items()},
        "cpu_per_1000_nodes": {k: v / nodes * 1000 for k, v in cpu.items()},
    }


def best_of(repeat: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    wall, _, out = timed(repeat, fn)
    return wall, out


def timed(repeat: int, fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """The least wall time and the least process CPU time of ``repeat`` calls, and the last result.

    On a shared machine the wall time counts the time other processes held the cores; the
    process CPU time (``time.process_time``, all threads of this process) does not, so its
    ratios stay comparable under load (the flows run with one torch thread)."""
    wall, cpu, out = float("inf"), float("inf"), None
    for _ in range(repeat):
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall = min(wall, time.perf_counter() - t0)
        cpu = min(cpu, time.process_time() - c0)
    return wall, cpu, out


def measure(n: int, repeat: int, ao_max_blocks: int = 0) -> dict[str, Any]:
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
    stages = {
        "fx.symbolic_trace": t_fx,
        "qir trace": t_trace,
        "absorb-bn,fuse": t_pipe,
        "verify": t_verify,
        "emit": t_emit,
    }
    total = t_trace + t_pipe + t_verify + t_emit
    flows = measure_flows(n, repeat, nodes, with_ao=n <= ao_max_blocks)
    return {
        "blocks": n,
        "nodes": nodes,
        "seconds": stages,
        "qir_total": total,
        "per_1000_nodes": {k: v / nodes * 1000 for k, v in {**stages, "qir total": total}.items()},
        "flows": flows,
    }


def measure_resnet50(repeat: int) -> dict[str, Any]:
    """Seconds of prepare_qat_fx and convert_fx on torchvision's resnet50, qir vs torch.ao (x86)."""
    try:
        from torchvision.models import resnet50
    except ImportError as e:
        raise SystemExit(f"--resnet50 needs torchvision ({e}); install it or use an environment that has it") from e
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx as ao_convert_fx
    from torch.ao.quantization.quantize_fx import prepare_qat_fx as ao_prepare_qat_fx

    from qir.march import march_scope
    from qir.quantization import convert_fx, get_default_qat_qconfig, prepare_qat_fx

    torch.manual_seed(0)
    x = torch.randn(1, 3, 64, 64)
    out: dict[str, float] = {}
    cpu: dict[str, float] = {}

    def run(key: str, fn: Callable[[], Any]) -> Any:
        out[key], cpu[key], result = timed(repeat, fn)
        return result

    with march_scope("bayes"):
        model = Stubbed(resnet50()).train()
        prepared = run("qir prepare_qat_fx", lambda: prepare_qat_fx(model, {"": get_default_qat_qconfig()}, x))
        with torch.no_grad():
            prepared(x)  # one QAT step: observers hold data
        prepared.eval()
        converted = run("qir convert_fx", lambda: convert_fx(prepared))
        path = str(converted.meta.get("qir.convert_path"))
        prepare_path = str(prepared.meta.get("qir.prepare_path"))
    torch.backends.quantized.engine = "x86"
    mapping = get_default_qat_qconfig_mapping("x86")
    body = resnet50().train()
    with warnings.catch_warnings():  # torch.ao's fx flow is deprecated upstream: silence its warnings
        warnings.simplefilter("ignore")
        # torch.ao modifies its input: its timed calls include a deep copy (qir's leave theirs untouched)
        ao_prepared = run("torch.ao prepare_qat_fx", lambda: ao_prepare_qat_fx(copy.deepcopy(body), mapping, (x,)))
        with torch.no_grad():
            ao_prepared(x)
        ao_prepared.eval()
        run("torch.ao convert_fx", lambda: ao_convert_fx(copy.deepcopy(ao_prepared)))
    return {
        "seconds": out,
        "cpu_seconds": cpu,
        "prepare_path": prepare_path,
        "convert_path": path,
        "qir_over_ao": _ratios(out),
        "cpu_qir_over_ao": _ratios(cpu),
    }


def _ratios(sec: dict[str, float]) -> dict[str, float]:
    """qir / torch.ao of prepare_qat_fx, convert_fx and their sum."""
    qp, qc = sec["qir prepare_qat_fx"], sec["qir convert_fx"]
    ap, ac = sec["torch.ao prepare_qat_fx"], sec["torch.ao convert_fx"]
    return {"prepare_qat_fx": qp / ap, "convert_fx": qc / ac, "prepare + convert": (qp + qc) / (ap + ac)}


def report_resnet50(repeat: int) -> int:
    r = measure_resnet50(repeat)
    print(f"torch {torch.__version__}, python {platform.python_version()}, load average {_load()}")
    print(f"resnet50 (1x3x64x64, march bayes), seconds (best of {repeat}):")
    print(f"  {'':<26} {'wall':>8} {'CPU':>8}")
    for k, v in r["seconds"].items():
        print(f"  {k:<26} {v:8.3f} {r['cpu_seconds'][k]:8.3f}")
    print(f"qir prepare_qat_fx path: {r['prepare_path']}; convert_fx path: {r['convert_path']}")
    for label, key in (("wall", "qir_over_ao"), ("CPU ", "cpu_qir_over_ao")):
        q = r[key]
        print(
            f"qir / torch.ao, {label}: prepare_qat_fx {q['prepare_qat_fx']:.2f}x   convert_fx {q['convert_fx']:.2f}x   "
            f"prepare + convert {q['prepare + convert']:.2f}x"
        )
    return 0


def _load() -> str:
    try:
        return ", ".join(f"{v:.1f}" for v in os.getloadavg())
    except (OSError, AttributeError):
        return "unknown"


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key, title in (
        (ax1, "per_1000_nodes", "qir compiler stages (IR level)"),
        (ax2, "flows", "prepare_qat_fx / convert_fx: qir vs torch.ao (x86)"),
    ):
        names: list[str] = []
        for r in rows:
            d = r[key]["per_1000_nodes"] if key == "flows" else r[key]
            names += [k for k in d if k not in names]
        for name in names:
            pts = [(r["nodes"], (r[key]["per_1000_nodes"] if key == "flows" else r[key]).get(name)) for r in rows]
            xs = [p[0] for p in pts if p[1] is not None]
            ys = [p[1] for p in pts if p[1] is not None]
            style = "--" if name.startswith(("torch", "fx.")) else "-"
            ax.plot(xs, ys, style, marker="o", label=name)
        ax.set_xscale("log")
        ax.set_xticks([r["nodes"] for r in rows], [f"{r['nodes']:,}" for r in rows])
        ax.minorticks_off()
        ax.set_xlabel("graph size (IR nodes, log scale)")
        ax.set_ylabel("seconds per 1,000 nodes (best of repeats)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    blocks = ", ".join(f"{r['blocks']:,}" for r in rows)
    fig.suptitle(
        f"Pipeline cost vs size: chains of {blocks} conv-bn-relu blocks (flat line = linear cost); "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), shared machine"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[200, 1000, 5000])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument(
        "--ao-max-blocks", type=int, default=5000, help="run torch.ao's flow only on chains up to this many blocks"
    )
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--png", help="write the plot here (needs matplotlib)")
    ap.add_argument("--resnet50", action="store_true", help="prepare + convert on torchvision's resnet50 instead")
    args = ap.parse_args(argv)
    # The chains use 4x4 feature maps: intra-op threads add only spin contention, so one thread
    # measures the pipeline itself (and is stable on a shared machine).
    torch.set_num_threads(1)
    if args.resnet50:
        return report_resnet50(args.repeat)
    # Warm up one-time costs (lazy torch imports, meta kernels) outside the measurement.
    measure(20, 1, 20)
    rows = []
    for n in args.sizes:
        t0 = time.perf_counter()
        rows.append(measure(n, args.repeat, args.ao_max_blocks))
        print(f"  measured {n} blocks in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    stages = list(rows[0]["per_1000_nodes"])
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, load average {_load()}"
    )
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

    flows = list(dict.fromkeys(k for r in rows for k in r["flows"]["per_1000_nodes"]))
    w = max(24, *(len(s) for s in flows))
    for label, key in (("wall", "per_1000_nodes"), ("process CPU", "cpu_per_1000_nodes")):
        print(
            f"\nprepare_qat_fx / convert_fx, {label} seconds per 1,000 IR nodes "
            "(torch.ao: x86 qconfig mapping, deprecation warnings suppressed)"
        )
        print(f"{'blocks':>7} {'nodes':>7} " + " ".join(f"{s:>{w}}" for s in flows))
        for r in rows:
            d = r["flows"][key]
            print(
                f"{r['blocks']:>7} {r['nodes']:>7} "
                + " ".join(f"{d[s]:>{w}.4f}" if s in d else f"{'capped':>{w}}" for s in flows)
            )
    if any(r["blocks"] > args.ao_max_blocks for r in rows):
        print(f"torch.ao capped at {args.ao_max_blocks} blocks (--ao-max-blocks)")
    print(f"\ngrowth of s/node from {first['blocks']} to the largest measured size (wall, CPU):")
    for s in flows:
        have = [r for r in rows if s in r["flows"]["per_1000_nodes"]]
        g = have[-1]["flows"]["per_1000_nodes"][s] / have[0]["flows"]["per_1000_nodes"][s]
        gc_ = have[-1]["flows"]["cpu_per_1000_nodes"][s] / have[0]["flows"]["cpu_per_1000_nodes"][s]
        print(f"  {s:<{w}} {g:6.2f}x {gc_:6.2f}x  ({have[0]['blocks']} -> {have[-1]['blocks']} blocks)")
    print("\nqir / torch.ao (below 1.0: qir faster):")
    for r in rows:
        for label, key in (("wall", "seconds"), ("CPU ", "cpu_seconds")):
            sec = r["flows"][key]
            if "torch.ao prepare_qat_fx" not in sec:
                continue
            rp = sec["qir prepare_qat_fx"] / sec["torch.ao prepare_qat_fx"]
            rc = sec["qir convert_fx"] / sec["torch.ao convert_fx"]
            rq = sec["qir convert_fx (quantize pass)"] / sec["torch.ao convert_fx"]
            ratios = {"prepare_qat_fx": rp, "convert_fx": rc, "convert_fx (quantize pass)": rq}
            r["flows"]["qir_over_ao" if key == "seconds" else "cpu_qir_over_ao"] = ratios
            print(
                f"  {r['blocks']:>5} blocks, {label}: prepare_qat_fx {rp:5.2f}x   convert_fx {rc:5.2f}x   "
                f"convert_fx (quantize pass) {rq:5.2f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                    "ao_max_blocks": args.ao_max_blocks,
                    "repeat": args.repeat,
                    "rows": rows,
                },
                f,
                indent=2,
            )
    if args.png:
        plot(rows, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
