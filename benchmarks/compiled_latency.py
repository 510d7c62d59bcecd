"""Latency of a compiled resnet18 (Bayes) beside the float model in eager torch and torch.ao's
x86 int8 model, in one run, 224x224, batch 1 and 8, a fixed number of threads.

    /work/tvenv/bin/python benchmarks/compiled_latency.py --out compiled_latency.json

Prints a table with ratios (compiled / float eager; below 1.0 means faster) and writes
JSON. Weights are random (no download); calibration uses a few random batches.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Wrapped(nn.Module):
    """A float model between a QuantStub and a DeQuantStub (what the qir flows quantize)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        from torch.ao.quantization import DeQuantStub

        from qir.quantization import QuantStub

        self.quant = QuantStub()
        self.body = body
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.body(self.quant(x)))


def _time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2) -> dict[str, dict[str, float]]:
    """Median / min latency of each callable, run round-robin so they share the machine's load."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[k].append((time.perf_counter() - t0) * 1e3)
    return {k: {"median_ms": round(statistics.median(v), 2), "min_ms": round(min(v), 2)} for k, v in ts.items()}


def build_compiled(body: nn.Module, batches: int, opt: int) -> tuple[Any, nn.Module, float]:
    from qir.march import march_scope
    from qir.quantization import compile_model, convert_fx, get_default_qat_qconfig, prepare_qat_fx

    with march_scope("bayes"):
        prepared = prepare_qat_fx(Wrapped(copy.deepcopy(body)), {"": get_default_qat_qconfig()})
        prepared.train()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _ in range(batches):
                prepared(torch.randn(4, 3, 224, 224, generator=g))
        prepared.eval()
        converted = convert_fx(prepared)
        t0 = time.perf_counter()
        compiled = compile_model(converted, [torch.randn(1, 3, 224, 224, generator=g)], opt=opt)
        return compiled, converted, time.perf_counter() - t0


def build_ao_x86(body: nn.Module, batches: int) -> nn.Module | str:
    try:
        from torch.ao.quantization import get_default_qconfig_mapping
        from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
    except ImportError as e:
        return f"torch.ao.quantization fx flow unavailable: {e}"
    try:
        torch.backends.quantized.engine = "x86"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            example = (torch.randn(1, 3, 224, 224),)
            prepared = prepare_fx(copy.deepcopy(body).eval(), get_default_qconfig_mapping("x86"), example)
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for _ in range(batches):
                    prepared(torch.randn(4, 3, 224, 224, generator=g))
            return convert_fx(prepared)
    except Exception as e:  # the deprecated flow may be partly removed: report, do not fail the benchmark
        return f"torch.ao x86 int8 flow failed: {type(e).__name__}: {e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--calib", type=int, default=3)
    ap.add_argument("--opt", type=int, default=2)
    ap.add_argument("--out", default="compiled_latency.json")
    args = ap.parse_args()
    import torchvision

    torch.manual_seed(0)
    body = torchvision.models.resnet18().eval()
    compiled, converted, compile_s = build_compiled(body, args.calib, args.opt)
    ao = build_ao_x86(body, args.calib)
    torch.set_num_threads(args.threads)
    compiled.num_threads = args.threads
    results: dict[str, Any] = {
        "model": "torchvision resnet18 (random weights), 224x224", "threads": args.threads, "repeats": args.repeats,
        "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "compile_seconds": round(compile_s, 2), "rows": [],
        "engines": {}, "ao_x86": ao if isinstance(ao, str) else "ok",
    }
    for inst in compiled.program.instructions:
        eng = inst.attrs.get("engine")
        if eng:
            results["engines"][eng] = results["engines"].get(eng, 0) + 1
    print(f"compiled in {compile_s:.1f} s; engines per layer: {results['engines']}")
    for batch in (1, 8):
        x = torch.randn(batch, 3, 224, 224)
        with torch.no_grad():
            row: dict[str, Any] = {"batch": batch}
            fns: dict[str, Callable[[], Any]] = {
                "float_eager": lambda x=x: body(x), "qir_compiled": lambda x=x: compiled(x)}
            if not isinstance(ao, str):
                fns["ao_x86_int8"] = lambda x=x: ao(x)
            row.update(_time_interleaved(fns, args.repeats))
            slow = {"qir_converted_torch": lambda x=x: converted(x)}
            row.update(_time_interleaved(slow, max(2, args.repeats // 4), 1))
            assert torch.equal(compiled(x), converted(x)), "compiled output differs from the converted model"
            row["bit_exact"] = True
        f = row["float_eager"]["median_ms"]
        row["ratio_compiled_over_float"] = round(row["qir_compiled"]["median_ms"] / f, 3)
        if "ao_x86_int8" in row:
            row["ratio_ao_over_float"] = round(row["ao_x86_int8"]["median_ms"] / f, 3)
        results["rows"].append(row)
    print(f"{'batch':>5} {'float eager':>12} {'qir compiled':>13} {'ao x86 int8':>12} {'converted':>10} "
          f"{'compiled/float':>15} {'ao/float':>9}")
    for r in results["rows"]:
        ao_ms = r.get("ao_x86_int8", {}).get("median_ms", float("nan"))
        print(f"{r['batch']:>5} {r['float_eager']['median_ms']:>10.1f}ms {r['qir_compiled']['median_ms']:>11.1f}ms "
              f"{ao_ms:>10.1f}ms {r['qir_converted_torch']['median_ms']:>8.0f}ms "
              f"{r['ratio_compiled_over_float']:>15.3f} {r.get('ratio_ao_over_float', float('nan')):>9.3f}")
    if isinstance(ao, str):
        print(ao)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
