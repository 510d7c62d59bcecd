"""Worst error of qint16-input table lookups, in output LSBs, for every table function: the
segmented table of format version 1 (513 uniform knots) beside version 2 (knots placed by the
interpolation error bound, at most 513), over all 65,536 input codes; and the cost of building a
table of each format (the QAT grid builds one per forward from the current scales).

Input scale ``amax / 32767.5``; output scale the function's largest |value| over the input range
divided by 127.5 (qint8 output) or 32767.5 (qint16), as an observer would set it.

    python benchmarks/lut16_error.py [--amax 4 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch
from torch import nn

from backends.common.lut_segmented import lut_int16
from qir.nn import qat
from qir.nn.modules.unary import UNARY_MODULES
from qir.nn.qat import LUT_FLOAT_CLASSES
from qir.quantization import get_default_qat_qconfig

_QMAX = {"qint8": 127.5, "qint16": 32767.5}


def functions() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every function a table lookup computes: torch's table activations and qir.nn's unary modules."""
    qc = get_default_qat_qconfig()
    mods: list[nn.Module] = [cls() for cls in LUT_FLOAT_CLASSES] + [cls() for cls in UNARY_MODULES.values()]
    return {type(m).__name__: qat.UnaryLUT.from_float(m, qc).function() for m in mods}  # type: ignore[arg-type]


def measure(amaxes: list[float]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    codes = torch.arange(-32768, 32768, dtype=torch.float64)
    for name, fn in functions().items():
        for amax in amaxes:
            s_in = amax / 32767.5
            y = fn(codes * float(torch.tensor(s_in, dtype=torch.float32)))
            peak = float(y.abs().max())
            if not torch.isfinite(y).all() or peak == 0.0:
                rows.append({"function": name, "amax": amax, "skipped": "not finite (or zero) on the range"})
                continue
            for dt, qmax in _QMAX.items():
                s_out = peak / qmax
                v1 = lut_int16(fn, s_in, s_out, dt, version=1)
                v2 = lut_int16(fn, s_in, s_out, dt, version=2)
                rows.append(
                    {
                        "function": name,
                        "amax": amax,
                        "out": dt,
                        "v1_lsb": v1.max_error_lsb,
                        "v2_lsb": v2.max_error_lsb,
                        "v2_knots": int(v2.entries.shape[1]),
                    }
                )
    return rows


def build_cost(repeat: int = 30) -> dict[str, float]:
    """Seconds per table build (no error measurement, as the QAT grid builds them), each format."""
    out: dict[str, float] = {}
    for version in (1, 2):
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(repeat):
                lut_int16(torch.tanh, 8 / 32767.5, 1 / 32767.5, "qint16", measure=False, version=version)
            best = min(best, (time.perf_counter() - t) / repeat)
        out[f"v{version}_s"] = best
    out["v2_over_v1"] = out["v2_s"] / out["v1_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--amax", type=float, nargs="+", default=[4.0, 8.0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = measure(args.amax)
    print(f"{'function':<12} {'amax':>5} {'out':<6} {'v1 LSB':>8} {'v2 LSB':>8} {'v2 knots':>8}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['function']:<12} {r['amax']:>5g} skipped: {r['skipped']}")
            continue
        lsb = f"{r['v1_lsb']:>8.3f} {r['v2_lsb']:>8.3f}"
        print(f"{r['function']:<12} {r['amax']:>5g} {r['out']:<6} {lsb} {r['v2_knots']:>8}")
    for dt in _QMAX:
        done = [r for r in rows if r.get("out") == dt]
        print(
            f"worst over all functions, {dt} output: v1 {max(float(r['v1_lsb']) for r in done):.3f} LSB, "  # type: ignore[arg-type]
            f"v2 {max(float(r['v2_lsb']) for r in done):.3f} LSB"  # type: ignore[arg-type]
        )
    cost = build_cost()
    load = os.getloadavg()
    print(
        f"table build (tanh, qint16, no measurement): v1 {cost['v1_s'] * 1e3:.3f} ms, v2 {cost['v2_s'] * 1e3:.3f} ms, "
        f"v2/v1 {cost['v2_over_v1']:.1f}x (load average {load[0]:.2f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "build": cost, "load": load[0]}, f, indent=1)


if __name__ == "__main__":
    main()
