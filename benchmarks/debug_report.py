"""The accuracy-debugging tools on real runs: the digits model and a deep net (torchvision).

For each model: calibrate (the calibration qconfig), convert, then

- ``featuremap_similarity(float, converted)``: table, JSON and the plot of similarity along depth;
- ``layer_sensitivity(calibrated)``: the ranked table (the top rows for the deep net);
- ``auto_int16``: how many layers promoted to qint16, output cosine before and after, for a
  target that closes 30% of the gap between today's cosine and 1 (``--gain``).

The digits model is trained first (``--epochs``, as ``qir demo``), on the real 8x8 digits,
and converted test accuracy is reported before and after the int16 promotion. The deep net
(``--deep mobilenet_v2``, random weights with batch-norm statistics from a few train-mode
batches, 96x96 inputs, as benchmarks/fidelity.py) needs torchvision; ``--deep none`` skips it.

    PYTHONPATH=. /work/tvenv/bin/python benchmarks/debug_report.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qir.march import march_scope
from qir.quantization import convert_fx, get_default_calib_qconfig, prepare_qat_fx, set_fake_quantize
from qir.quantization.debug import auto_int16, featuremap_similarity, layer_sensitivity


def _calibrated(model: nn.Module, batches: list[torch.Tensor], qconfig_dict: dict[str, Any]) -> nn.Module:
    with contextlib.redirect_stdout(io.StringIO()):
        prepared = prepare_qat_fx(model, qconfig_dict)
    set_fake_quantize(prepared, "calibration")
    prepared.eval()
    with torch.no_grad():
        for b in batches:
            prepared(b)
    set_fake_quantize(prepared, "validation")
    return prepared


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return 100.0 * float((model(x).argmax(1) == y).float().mean())


def report(
    name: str,
    float_model: nn.Module,
    calib: list[torch.Tensor],
    evals: torch.Tensor,
    out: Path,
    gain: float,
    top: int,
    labels: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Similarity, sensitivity and auto-int16 figures of one model; files into ``out``."""
    res: dict[str, Any] = {"model": name}
    t0 = time.perf_counter()
    calibrated = _calibrated(float_model, calib, {"": get_default_calib_qconfig()})
    converted = convert_fx(calibrated)
    sim = featuremap_similarity(float_model, converted, evals)
    sim.save(out, name=f"debug_{name}_similarity")
    res["layers_compared"] = len(sim.rows)
    res["output_cosine"] = sim.row("(output)").cosine
    worst = min(sim.rows, key=lambda r: r.cosine)
    res["lowest_cosine_layer"] = [worst.name, worst.cosine]
    sens = layer_sensitivity(calibrated, evals)
    res["sensitivity_top"] = [[r.layer, r.only_quantized, r.only_float] for r in sens.layers[:top]]
    target = sim.row("(output)").cosine + gain * (1.0 - sim.row("(output)").cosine)
    auto = auto_int16(float_model, calib, evals, target=target, march="bayes")
    res["auto_int16"] = {
        "target": target,
        "met": auto.met,
        "before": auto.before,
        "after": auto.after,
        "promoted": auto.promoted,
        "candidates": len(auto.candidates),
        "not_candidates": len(auto.illegal),
        "steps": len(auto.steps),
        "all_candidates_int16": auto.bound,
    }
    if labels is not None:
        res["converted_accuracy_before"] = _accuracy(converted, evals, labels)
        promoted = convert_fx(_calibrated(float_model, calib, auto.qconfig_dict()))
        res["converted_accuracy_after"] = _accuracy(promoted, evals, labels)
    res["seconds"] = time.perf_counter() - t0
    text = [
        f"== {name}",
        sim.table(),
        _top_table(sens.table(), top),
        auto.summary(),
    ]
    (out / f"debug_{name}.txt").write_text("\n".join(text))
    return res


def _top_table(table: str, top: int) -> str:
    lines = table.splitlines()
    return "\n".join(lines[: 2 + top]) + ("\n  ..." if len(lines) > 2 + top else "") + "\n"


def digits(out: Path, epochs: int, gain: float) -> dict[str, Any]:
    from qir.cli.demo_train import train
    from qir.examples import DeployableDigitsNet
    from qir.examples.digits_data import digits_split

    x_tr, y_tr, x_te, y_te = digits_split()
    torch.manual_seed(0)
    model = DeployableDigitsNet()
    train(model, x_tr, y_tr, epochs, lr=3e-3, seed=0, desc="float training", progress=False)
    model.eval()
    res = report("digits", model, [x_tr], x_te, out, gain, top=6, labels=y_te)
    res["float_accuracy"] = _accuracy(model, x_te, y_te)
    return res


def deep(name: str, out: Path, gain: float, size: int) -> dict[str, Any]:
    import torchvision

    from benchmarks.torchvision_qat_error import Quantized, _warm_bn

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    _warm_bn(model, size)
    wrapped = Quantized(model).eval()
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(8, 3, size, size, generator=g) for _ in range(3)]
    evals = torch.randn(8, 3, size, size, generator=g)
    return report(name, wrapped, calib, evals, out, gain, top=10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results", help="folder for the tables, JSON and plots")
    ap.add_argument("--epochs", type=int, default=30, help="digits float training epochs (default 30)")
    ap.add_argument("--gain", type=float, default=0.3, help="auto-int16 target: this share of the gap to 1 (0.3)")
    ap.add_argument("--deep", default="mobilenet_v2", help="torchvision model name, or none")
    ap.add_argument("--size", type=int, default=96, help="deep net input size (default 96)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    results = []
    with march_scope("bayes"):
        results.append(digits(out, args.epochs, args.gain))
        if args.deep != "none":
            results.append(deep(args.deep, out, args.gain, args.size))
    (out / "debug_report.json").write_text(json.dumps(results, indent=1) + "\n")
    for r in results:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
