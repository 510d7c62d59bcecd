"""onnxruntime on qir's QDQ export vs onnxruntime on the float model, in one run, and how close
onnxruntime's int8 result is to qir's converted integer model.

For each model (default resnet18; ``--models resnet18,mobilenet_v2``) at 224x224, batch 1 and 8:

- ``ort_float``: the float model through ``torch.onnx.export`` (dynamo exporter);
- ``ort_int8``: qir's QAT model (Bayes, calibrated on a few random batches, validation state)
  through ``export_to_onnx(..., qdq_layout="onnxruntime")``, the layout onnxruntime fuses into
  ``QLinearConv`` / ``QLinearAdd``;
- ``ort_int8_fake_quant_layout``: the same model through the default layout (one Q/DQ pair per
  fake quant), which onnxruntime runs with float convs (``--no-fake-quant-layout`` skips it).

Sessions use the CPU provider with all graph optimizations, ``--threads`` intra-op threads and
no spinning; the runs are interleaved round-robin so they share the machine's load; medians of
``--repeats`` runs. Ratios to ``ort_float`` from the same run are what count (below 1.0 = faster).
The op histogram of each optimized graph (``QLinearConv`` = an int8 conv kernel, ``Conv`` /
``FusedConv`` = a float one) is printed too.

Fidelity, on ``--fidelity-batches`` batches of 8 random inputs (not the calibration ones):
onnxruntime's output of each int8 export against ``convert_fx``'s integer model, in LSBs of the
output quantization (the scale of the graph's last DequantizeLinear): equal %, within 1 LSB %,
max difference, and argmax agreement.

    PYTHONPATH=. /work/tvenv/bin/python benchmarks/onnx_ort_speed.py [--json out.json]

Weights are random (torchvision's initialization; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
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


def qat_model(body: nn.Module, batches: int) -> tuple[nn.Module, nn.Module]:
    """qir's calibrated QAT model in validation state, and its converted integer model."""
    from qir.march import march_scope
    from qir.quantization import convert_fx, get_default_qat_qconfig, prepare_qat_fx, set_fake_quantize

    with march_scope("bayes"):
        prepared = prepare_qat_fx(Wrapped(copy.deepcopy(body)), {"": get_default_qat_qconfig()})
        prepared.train()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _ in range(batches):
                prepared(torch.randn(4, 3, 224, 224, generator=g))
        set_fake_quantize(prepared, "validation")
        prepared.eval()
        return prepared, convert_fx(prepared)


def session(path: str, threads: int, optimized_path: str | None = None) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    # no busy-waiting workers between runs: round-robin timing would hand their spin to the next session
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if optimized_path:
        opts.optimized_model_filepath = optimized_path
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def op_histogram(path: str) -> dict[str, int]:
    import onnx

    return dict(sorted(collections.Counter(n.op_type for n in onnx.load(path).graph.node).items()))


def output_step(path: str) -> float:
    """The scale of the DequantizeLinear that produces the graph's output: one output LSB."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path)
    out = model.graph.output[0].name
    node = next(n for n in model.graph.node if out in n.output)
    if node.op_type != "DequantizeLinear":
        raise RuntimeError(f"the graph output comes from {node.op_type}, not a DequantizeLinear: no output LSB")
    scale = next(t for t in model.graph.initializer if t.name == node.input[1])
    return float(numpy_helper.to_array(scale))


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median latency (ms) of each callable, run round-robin."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[k].append((time.perf_counter() - t0) * 1e3)
    return {k: round(statistics.median(v), 2) for k, v in ts.items()}


def fidelity(converted: nn.Module, sess: Any, step: float, batches: int) -> dict[str, float]:
    """onnxruntime int8 vs qir's integer model on random batches of 8, in output LSBs."""
    g = torch.Generator().manual_seed(1)
    diffs, agree, codes = [], [], set()
    for _ in range(batches):
        x = torch.randn(8, 3, 224, 224, generator=g)
        with torch.no_grad():
            want = converted(x).numpy()
        got = sess.run(None, {"x": x.numpy()})[0]
        diffs.append(np.abs(got.astype(np.float64) - want) / step)
        agree.append(got.argmax(1) == want.argmax(1))
        codes.update(np.rint(want / step).astype(np.int64).ravel().tolist())
    d, a = np.concatenate([x.ravel() for x in diffs]), np.concatenate(agree)
    lsb = np.rint(d)
    return {
        "distinct_output_codes": len(codes),  # 1 would make every figure below trivially perfect
        "equal_pct": round(float((lsb == 0).mean() * 100), 2),
        "within_1_lsb_pct": round(float((lsb <= 1).mean() * 100), 2),
        "max_lsb": int(lsb.max()),
        "mean_lsb": round(float(d.mean()), 3),
        "argmax_agreement_pct": round(float(a.mean() * 100), 2),
        "outputs": int(d.size),
        "images": int(a.size),
    }


def run_model(name: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    import torchvision

    from qir.utils.onnx_helper import export_to_onnx

    torch.manual_seed(0)
    body = getattr(torchvision.models, name)()
    # batch-norm statistics from a few random batches: with the initial ones (mean 0, variance 1)
    # the activations of a randomly initialized mobilenet_v2 shrink to ~1e-9 by the logits, which
    # quantize to a single code and would make the fidelity figures meaningless
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _ in range(args.calib):
            body(torch.randn(4, 3, 224, 224, generator=g))
    body.eval()
    t0 = time.perf_counter()
    prepared, converted = qat_model(body, args.calib)
    print(f"{name}: QAT model + convert_fx in {time.perf_counter() - t0:.1f} s", flush=True)
    result: dict[str, Any] = {"batches": {}}
    layouts = {"ort_int8": "onnxruntime"}
    if not args.no_fake_quant_layout:
        layouts["ort_int8_fake_quant_layout"] = "fake_quant"
    for batch in args.batches:
        x = torch.randn(batch, 3, 224, 224)
        paths = {"ort_float": os.path.join(tmp, f"{name}_b{batch}_float.onnx")}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(body, (x,), paths["ort_float"], input_names=["x"], dynamo=True, verbose=False)
        for key, layout in layouts.items():
            paths[key] = os.path.join(tmp, f"{name}_b{batch}_{layout}.onnx")
            export_to_onnx(prepared, (x,), paths[key], input_names=["x"], qdq_layout=layout)
        sessions = {k: session(p, args.threads, p + ".optimized.onnx") for k, p in paths.items()}
        feed = {"x": x.numpy()}
        ms = time_interleaved({k: (lambda s=s, f=feed: s.run(None, f)) for k, s in sessions.items()}, args.repeats)
        row: dict[str, Any] = {
            "median_ms": ms,
            "ratio_to_ort_float": {k: round(v / ms["ort_float"], 3) for k, v in ms.items()},
            "optimized_ops": {k: op_histogram(p + ".optimized.onnx") for k, p in paths.items()},
        }
        if batch == 8 and args.fidelity_batches > 0:
            step = output_step(paths["ort_int8"])
            row["fidelity_vs_qir_integer"] = {
                k: fidelity(converted, sessions[k], step, args.fidelity_batches) for k in layouts
            }
        result["batches"][batch] = row
        print(f"{name} batch {batch}: " + json.dumps(row["median_ms"]), flush=True)
    return result


def print_table(results: dict[str, Any]) -> None:
    print("\nmedian ms (ratio to onnxruntime float, same run)")
    print(f"{'model':<14}{'batch':>6}  {'path':<28}{'ms':>9}{'ratio':>8}  QLinearConv / float convs")
    for name, res in results.items():
        for batch, row in res["batches"].items():
            for k, v in row["median_ms"].items():
                ops = row["optimized_ops"][k]
                convs = f"{ops.get('QLinearConv', 0)} / {ops.get('Conv', 0) + ops.get('FusedConv', 0)}"
                ratio = row["ratio_to_ort_float"][k]
                print(f"{name:<14}{batch:>6}  {k:<28}{v:>9.2f}{ratio:>8.3f}  {convs}")
            for k, fid in row.get("fidelity_vs_qir_integer", {}).items():
                print(f"{name:<14}{batch:>6}  {k} vs qir's integer model: {fid}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet18")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calib", type=int, default=3, help="random calibration batches of 4")
    ap.add_argument("--fidelity-batches", type=int, default=4, help="random batches of 8 for the fidelity figures")
    ap.add_argument("--no-fake-quant-layout", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    import onnxruntime

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results[name] = run_model(name, args, tmp)
    print_table(results)
    meta = {
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "threads": args.threads,
        "repeats": args.repeats,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg": [round(v, 2) for v in os.getloadavg()],
    }
    print("\n" + json.dumps(meta))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
