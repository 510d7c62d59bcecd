"""Latency of compiled torchvision models (Bayes) beside the float model in eager torch and torch.ao's
x86 int8 model, in one run: resnet18, mobilenet_v2 and resnet50 (``--models``), 224x224, batch 1
and 8 (``--batches``), a fixed number of threads.

Also times onnxruntime (CPU provider, the same thread count) on two exports:

- ``ort_float``: the float model through ``torch.onnx.export`` (the dynamo exporter);
- ``ort_int8_qdq``: qir's own QAT model through ``qir.utils.onnx_helper.export_to_onnx``
  with ``qdq_layout="onnxruntime"`` (int8 weights and int32 biases with qir's codes, Q/DQ
  placed so onnxruntime fuses QLinearConv / QLinearAdd), so the int8 model onnxruntime runs is
  the one qir calibrated. If onnxruntime refuses that file, the
  error is printed and recorded (``ort_int8_source``) and the column is left out.
- ``ort_int8_static``: onnxruntime's own ``quantize_static`` (QDQ format, int8 activations
  and per-channel int8 weights, calibrated on the same random batches) applied to the float
  export: how fast onnxruntime's int8 path goes on a graph its quantizer laid out.

onnxruntime rewrites QDQ graphs into its int8 kernels where its patterns match; the JSON's
``onnxruntime.optimized_ops`` counts the op types of each session's optimized graph
(``QLinearConv`` = an int8 conv kernel, ``Conv``/``FusedConv`` = a float one).

Each ONNX model is exported once per batch size (static shapes); ``--no-onnx`` leaves them out.

    PYTHONPATH=. /work/tvenv/bin/python benchmarks/compiled_latency.py [--json results.json] [--png out.png]

``--profile`` also times each instruction of the compiled model alone (wall clock and thread CPU
time, median of ``--repeats`` calls) and prints the kernels by kind and the slowest instructions,
then the same for each node of torch.ao's converted model (``profile_ao`` in the JSON). At one
thread (``--threads 1``) the thread CPU times are each layer's work, comparable layer by layer.

Prints a table with ratios (to float eager, and qir compiled / torch.ao int8 in latency and in
process CPU time per call; below 1.0 means faster), whether the native kernels are in use, and
the load average; writes JSON where ``--json PATH`` says (``--out`` is the same option; nothing
without it) and bar charts with ``--png`` (needs matplotlib). Weights
are random (no download); calibration uses a few random batches. Each model's compiled output
is asserted equal to its converted model's.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import platform
import statistics
import tempfile
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


def _time_interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2, settle_s: float = 0.0
) -> dict[str, dict[str, float]]:
    """Median / min latency of each callable, run round-robin so they share the machine's load, and
    the median CPU time of the process during a call (``cpu_median_ms``): with one thread, the
    work itself, which waiting for a core on a loaded machine does not inflate.

    ``settle_s``: a pause before each timed call. torch's OpenMP threads (libgomp) spin for a few
    milliseconds after a parallel region before they sleep; without the pause, the call after a
    torch model (float eager, torch.ao) shares the cores with those spinning threads, and the
    process CPU time it is charged includes theirs."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    cs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            if settle_s > 0:
                time.sleep(settle_s)
            c0 = time.process_time()
            t0 = time.perf_counter()
            fn()
            ts[k].append((time.perf_counter() - t0) * 1e3)
            cs[k].append((time.process_time() - c0) * 1e3)
    return {
        k: {
            "median_ms": round(statistics.median(v), 2),
            "min_ms": round(min(v), 2),
            "cpu_median_ms": round(statistics.median(cs[k]), 2),
        }
        for k, v in ts.items()
    }


def profile_steps(compiled: Any, x: torch.Tensor, threads: int, repeats: int) -> list[dict[str, Any]]:
    """Per-instruction time of one compiled model call: each instruction's kernel timed alone (wall
    clock and this thread's CPU time), median over ``repeats`` calls, under the same thread settings
    as a call (the runtime's steps walked as ``CompiledModel._call`` walks them, the native pool held
    for the walk)."""
    from backends.common.kernels import native

    wall: list[list[float]] = [[] for _ in compiled._steps]
    cpu: list[list[float]] = [[] for _ in compiled._steps]

    def walk() -> None:
        env = dict(zip(compiled.program.inputs, (x,), strict=True))
        for i, (inst, run, state, free) in enumerate(compiled._steps):
            c0, t0 = time.thread_time(), time.perf_counter()
            outs = run(inst, [env[v] for v in inst.inputs], state)
            wall[i].append((time.perf_counter() - t0) * 1e3)
            cpu[i].append((time.thread_time() - c0) * 1e3)
            env.update(zip(inst.outputs, outs, strict=True))
            for v in free:
                env.pop(v, None)

    prev = torch.get_num_threads()
    torch.set_num_threads(compiled.torch_threads or threads)
    try:
        # the pool held for each walk, as a call holds it: its threads spin between the instructions
        with torch.no_grad(), native.using_threads(threads):
            for _ in range(repeats + 1):  # the first call warms the kernels' buffers up
                with native.holding_pool():
                    walk()
    finally:
        torch.set_num_threads(prev)
    rows = []
    for i, (inst, _, _, _) in enumerate(compiled._steps):
        a = inst.attrs
        kind = inst.op + (f" {a['engine']}" if a.get("engine") else "")
        if "kernel_size" in a:
            ks, stride = a["kernel_size"], a["stride"]
            ks = ks if isinstance(ks, list) else [ks, ks]
            kind += " {}x{}/s{}".format(*ks[:2], stride[0] if isinstance(stride, list) else stride)
        rows.append(
            {
                "index": i,
                "source": inst.source,
                "kind": kind,
                "ms": round(statistics.median(wall[i][1:]), 4),
                "cpu_ms": round(statistics.median(cpu[i][1:]), 4),
            }
        )
    return rows


def profile_ao_nodes(ao: nn.Module, x: torch.Tensor, repeats: int) -> list[dict[str, Any]]:
    """Per-node time of torch.ao's converted model (a GraphModule), in the profile's format: each
    node run by a ``torch.fx.Interpreter`` and timed alone (wall clock and this thread's CPU time),
    median over ``repeats`` calls after one warm-up call."""
    if not isinstance(ao, torch.fx.GraphModule):
        return []
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}

    class Timed(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            c0, t0 = time.thread_time(), time.perf_counter()
            out = super().run_node(n)
            wall.setdefault(n.name, []).append((time.perf_counter() - t0) * 1e3)
            cpu.setdefault(n.name, []).append((time.thread_time() - c0) * 1e3)
            if n.op == "get_attr":
                kinds[n.name] = "get_attr"
            elif n.name not in kinds:
                target = self.module.get_submodule(str(n.target)) if n.op == "call_module" else n.target
                kinds[n.name] = (
                    type(target).__name__ if n.op == "call_module" else getattr(target, "__name__", str(target))
                )
            return out

    timed = Timed(ao)
    with torch.no_grad():
        for _ in range(repeats + 1):
            timed.run(x)
    return [
        {
            "index": i,
            "source": k,
            "kind": kinds[k],
            "ms": round(statistics.median(v[1:]), 4),
            "cpu_ms": round(statistics.median(cpu[k][1:]), 4),
        }
        for i, (k, v) in enumerate(wall.items())
        if kinds[k] not in ("placeholder", "output")
    ]


def print_profile(name: str, batch: int, rows: list[dict[str, Any]], top: int = 12) -> None:
    total = sum(r["ms"] for r in rows)
    kinds: dict[str, list[float]] = {}
    for r in rows:
        k = kinds.setdefault(r["kind"], [0.0, 0.0, 0])
        k[0] += r["ms"]
        k[1] += r["cpu_ms"]
        k[2] += 1
    print(f"  profile {name} batch {batch}: {total:.2f} ms in {len(rows)} instructions (wall; thread CPU)")
    for kind, (ms, c, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        print(f"    {ms:8.3f} ms {100 * ms / total:5.1f}%  cpu {c:8.3f} ms  x{n:<3d} {kind}")
    for r in sorted(rows, key=lambda r: -r["ms"])[:top]:
        print(f"    #{r['index']:<3d} {r['ms']:7.3f} ms  cpu {r['cpu_ms']:7.3f}  {r['kind']:<24} {r['source']}")


def build_compiled(body: nn.Module, batches: int, opt: int) -> tuple[Any, nn.Module, nn.Module, float]:
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
        return compiled, converted, prepared, time.perf_counter() - t0


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


def ort_quantize_static(float_path: str, path: str, x: torch.Tensor, batches: int) -> None:
    """onnxruntime's own static int8 QDQ quantization of the float export (random calibration batches)."""
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    name = ort.InferenceSession(float_path, providers=["CPUExecutionProvider"]).get_inputs()[0].name
    g = torch.Generator().manual_seed(0)
    data = [{name: torch.randn(*x.shape, generator=g).numpy()} for _ in range(batches)]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(data)

        def get_next(self) -> dict[str, Any] | None:
            return next(self.it, None)

    quantize_static(
        float_path,
        path,
        Reader(),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        per_channel=True,
    )


def _session(path: str, threads: int, optimized_path: str | None = None) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    # no busy-waiting worker threads after a run: with round-robin timing they would steal the
    # cores from the torch runs measured next
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if optimized_path:
        opts.optimized_model_filepath = optimized_path
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def optimized_ops(path: str) -> dict[str, int]:
    """Op-type histogram of the graph onnxruntime runs after its optimizations."""
    import onnx

    counts: dict[str, int] = {}
    for n in onnx.load(path).graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return dict(sorted(counts.items()))


def build_ort(
    model: nn.Module | None,
    x: torch.Tensor,
    path: str,
    threads: int,
    kind: str,
    float_path: str = "",
    calib: int = 3,
    ops: dict[str, Any] | None = None,
) -> tuple[Callable[[], Any] | str, str]:
    """An onnxruntime session at ``x``'s shape (a string says why not), and its source.

    ``kind``: "float" (torch.onnx.export of ``model``), "qdq" (qir's export_to_onnx of the QAT
    ``model``) or "static" (onnxruntime quantize_static of the float export at ``float_path``).
    """
    try:
        import onnxruntime  # noqa: F401
    except ImportError as e:
        return f"onnxruntime unavailable: {e}", ""
    source = {
        "float": "torch.onnx.export (dynamo)",
        "qdq": "qir export_to_onnx (QAT model)",
        "static": "onnxruntime quantize_static (float export)",
    }[kind]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kind in ("qdq", "float") and model is None:
                raise ValueError(f"onnxruntime {kind}: needs the model to export")
            if kind == "qdq":
                from qir.utils.onnx_helper import export_to_onnx

                # the layout onnxruntime fuses into QLinearConv / QLinearAdd (docs/onnx.md)
                assert model is not None
                export_to_onnx(model, (x,), path, input_names=["x"], qdq_layout="onnxruntime")
            elif kind == "float":
                assert model is not None
                torch.onnx.export(model, (x,), path, input_names=["x"], dynamo=True, verbose=False)
            else:
                ort_quantize_static(float_path, path, x, calib)
        opt_path = path.replace(".onnx", ".opt.onnx")
        sess = _session(path, threads, opt_path)
        if ops is not None:
            ops[f"{kind}_b{x.shape[0]}"] = optimized_ops(opt_path)
        name = sess.get_inputs()[0].name
        feed = {name: x.numpy()}
        return (lambda: sess.run(None, feed)), source
    except Exception as e:  # report, do not fail the benchmark
        print(f"onnxruntime {kind} failed: {type(e).__name__}: {str(e)[:300]}")
        return f"onnxruntime {kind} failed: {type(e).__name__}: {e}", source


COLUMNS = [
    ("float_eager", "float eager"),
    ("ao_x86_int8", "torch.ao x86 int8"),
    ("ort_float", "ORT float"),
    ("ort_int8_qdq", "ORT int8 (qir QDQ)"),
    ("ort_int8_static", "ORT int8 (static)"),
    ("qir_compiled", "qir compiled"),
]


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results["models"]
    panels = [(name, r) for name, m in models.items() for r in m["rows"]]
    ncols = max(len(m["rows"]) for m in models.values())
    fig, axes = plt.subplots(len(models), ncols, figsize=(6 * ncols, 4.2 * len(models)), squeeze=False)
    for i, (name, r) in enumerate(panels):
        ax = axes[i // ncols][i % ncols]
        cols = [(k, label) for k, label in COLUMNS if k in r]
        f = r["float_eager"]["median_ms"]
        vals = [r[k]["median_ms"] for k, _ in cols]
        bars = ax.bar([label for _, label in cols], vals, color=[f"C{j}" for j in range(len(vals))])
        for b, v in zip(bars, vals, strict=True):
            ax.annotate(
                f"{v:.1f} ms\n{v / f:.2f}x", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7
            )
        qa = r.get("ratio_compiled_over_ao")
        ax.set_title(f"{name}, batch {r['batch']}" + (f" (qir / torch.ao int8 = {qa:.2f})" if qa else ""), fontsize=9)
        ax.set_ylabel("latency, median (ms)")
        ax.set_ylim(0, max(vals) * 1.3)
        ax.tick_params(axis="x", labelrotation=20, labelsize=7)
    fig.suptitle(
        f"latency, {results['threads']} threads, median of {results['repeats']} (ratio = / float eager); "
        f"torch {results['torch']}; shared machine, load average {results['load_average']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def run_model(name: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    import torchvision

    torch.manual_seed(0)
    body = getattr(torchvision.models, name)().eval()
    compiled, converted, prepared, compile_s = build_compiled(body, args.calib, args.opt)
    ao = build_ao_x86(body, args.calib)
    torch.set_num_threads(args.threads)
    compiled.num_threads = args.threads
    out: dict[str, Any] = {
        "model": f"torchvision {name} (random weights), 224x224",
        "compile_seconds": round(compile_s, 2),
        "rows": [],
        "engines": {},
        "ao_x86": ao if isinstance(ao, str) else "ok",
        # the native pool runs on --threads; torch's own pool on this many during a qir call
        "qir_torch_threads": compiled.torch_threads,
        "onnxruntime": {"optimized_ops": {}},
    }
    for inst in compiled.program.instructions:
        eng = inst.attrs.get("engine")
        if eng:
            out["engines"][eng] = out["engines"].get(eng, 0) + 1
    print(
        f"{name}: compiled in {compile_s:.1f} s; engines per layer: {out['engines']}; "
        f"torch threads during a qir call: {compiled.torch_threads}"
    )
    ops = out["onnxruntime"]["optimized_ops"]
    for batch in args.batches:
        x = torch.randn(batch, 3, 224, 224)
        ort_fns: dict[str, Callable[[], Any] | str] = {}
        if args.onnx:
            float_path = os.path.join(tmp, f"{name}_float_b{batch}.onnx")
            ort_fns["ort_float"] = build_ort(body, x, float_path, args.threads, "float", ops=ops)[0]
            ort_fns["ort_int8_qdq"], out["ort_int8_source"] = build_ort(
                prepared, x, os.path.join(tmp, f"{name}_qdq_b{batch}.onnx"), args.threads, "qdq", ops=ops
            )
            if not isinstance(ort_fns["ort_float"], str):
                ort_fns["ort_int8_static"] = build_ort(
                    None,
                    x,
                    os.path.join(tmp, f"{name}_static_b{batch}.onnx"),
                    args.threads,
                    "static",
                    float_path,
                    args.calib,
                    ops=ops,
                )[0]
        torch.set_num_threads(args.threads)
        with torch.no_grad():
            row: dict[str, Any] = {"batch": batch}
            fns: dict[str, Callable[[], Any]] = {
                "float_eager": functools.partial(body, x),
                "qir_compiled": functools.partial(compiled, x),
            }
            if not isinstance(ao, str):
                fns["ao_x86_int8"] = functools.partial(ao, x)
            for k, fn in ort_fns.items():
                out["onnxruntime"][f"{k}_b{batch}"] = fn if isinstance(fn, str) else "ok"
                if isinstance(fn, str):
                    print(fn)
                else:
                    fns[k] = fn
            row.update(_time_interleaved(fns, args.repeats, settle_s=args.settle_ms / 1e3))
            slow: dict[str, Callable[[], Any]] = {"qir_converted_torch": functools.partial(converted, x)}
            row.update(_time_interleaved(slow, max(2, args.repeats // 4), 1))
            assert torch.equal(compiled(x), converted(x)), f"{name}: compiled output differs from the converted model"
            row["bit_exact"] = True
            if args.profile:
                row["profile"] = profile_steps(compiled, x, args.threads, args.repeats)
                print_profile(name, batch, row["profile"])
                if not isinstance(ao, str):
                    row["profile_ao"] = profile_ao_nodes(ao, x, args.repeats)
                    print_profile(f"{name} torch.ao x86", batch, row["profile_ao"])
        f = row["float_eager"]["median_ms"]
        row["ratio_compiled_over_float"] = round(row["qir_compiled"]["median_ms"] / f, 3)
        if "ao_x86_int8" in row:
            row["ratio_ao_over_float"] = round(row["ao_x86_int8"]["median_ms"] / f, 3)
            row["ratio_compiled_over_ao"] = round(row["qir_compiled"]["median_ms"] / row["ao_x86_int8"]["median_ms"], 3)
            row["ratio_compiled_over_ao_cpu"] = round(
                row["qir_compiled"]["cpu_median_ms"] / row["ao_x86_int8"]["cpu_median_ms"], 3
            )
        for k in ("ort_float", "ort_int8_qdq", "ort_int8_static"):
            if k in row:
                row[f"ratio_{k}_over_float"] = round(row[k]["median_ms"] / f, 3)
        out["rows"].append(row)
        qa = row.get("ratio_compiled_over_ao", float("nan"))
        qc = row.get("ratio_compiled_over_ao_cpu", float("nan"))
        print(
            f"  batch {batch}: qir {row['qir_compiled']['median_ms']:.1f} ms, qir / torch.ao int8 {qa:.2f} "
            f"(CPU time {qc:.2f})"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models", default="resnet18,mobilenet_v2,resnet50", help="torchvision model names, comma-separated"
    )
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calib", type=int, default=3)
    ap.add_argument("--opt", type=int, default=2)
    ap.add_argument(
        "--settle-ms",
        type=float,
        default=50.0,
        help="pause before each timed call so that no runtime's threads still spin from the previous one (0: none)",
    )
    ap.add_argument("--no-onnx", dest="onnx", action="store_false", help="leave out the onnxruntime columns")
    ap.add_argument(
        "--profile", action="store_true", help="also time each instruction of the compiled model (printed, in the JSON)"
    )
    ap.add_argument(
        "--json",
        "--out",
        dest="json",
        default=None,
        metavar="PATH",
        help="write the results as JSON here (none by default)",
    )
    ap.add_argument("--png", default=None, help="write a bar chart here (needs matplotlib)")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    from backends.common.kernels import native

    results: dict[str, Any] = {
        "threads": args.threads,
        "repeats": args.repeats,
        "settle_ms": args.settle_ms,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "native_kernels": native.status(),
        "load_average": round(os.getloadavg()[0], 1),
        "models": {},
    }
    print(results["native_kernels"])
    tmp = tempfile.mkdtemp(prefix="qir-bench-")
    for name in args.models.split(","):
        results["models"][name] = run_model(name, args, tmp)
    results["load_average_end"] = round(os.getloadavg()[0], 1)
    lib = native.library()
    if lib is not None:
        # a pool thread woken on the caller's core moves off it (docs/backends.md "Threads"): how often it had to
        results["pool"] = {"threads": int(lib.qir_pool_threads()), "moved_off_caller_core": int(lib.qir_pool_moved())}
    labels = [label for _, label in COLUMNS]
    head = " ".join(f"{lb:>18}" for lb in labels)
    print(f"\n{'model':>13} {'batch':>5} " + head + f" {'qir/ao':>7} {'cpu':>5}")
    for name, m in results["models"].items():
        for r in m["rows"]:
            f = r["float_eager"]["median_ms"]
            cells = [
                f"{r[k]['median_ms']:>8.1f}ms {r[k]['median_ms'] / f:>6.2f}x" if k in r else f"{'n/a':>18}"
                for k, _ in COLUMNS
            ]
            qa = r.get("ratio_compiled_over_ao", float("nan"))
            qc = r.get("ratio_compiled_over_ao_cpu", float("nan"))
            print(f"{name:>13} {r['batch']:>5} " + " ".join(cells) + f" {qa:>7.2f} {qc:>5.2f}")
    print(
        "(median ms; ratio / float eager; qir/ao = qir compiled / torch.ao x86 int8 latency; "
        "cpu = the same ratio of process CPU time per call)"
    )
    for name, m in results["models"].items():
        ops = m["onnxruntime"]["optimized_ops"]
        if ops:
            print(f"\nonnxruntime's optimized graphs of {name}, batch {args.batches[0]} (QLinearConv = int8 conv):")
        for key, counts in ops.items():
            if key.endswith(f"_b{args.batches[0]}"):
                convs = {k: v for k, v in counts.items() if "Conv" in k or k in ("QLinearMatMul", "Gemm", "MatMul")}
                print(f"  {key.rsplit('_', 1)[0]:>7}: {convs}")
    print(f"load average {results['load_average']} at the start, {results['load_average_end']} at the end")
    if "pool" in results:
        pool = results["pool"]
        moved = pool["moved_off_caller_core"]
        print(f"native pool: {pool['threads']} thread(s), moved off the caller's core {moved} time(s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
        print(f"wrote {args.json}")
    if args.png:
        plot(results, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
