"""QAT-validation vs converted fidelity on torchvision models, beside torch.ao's fake quant vs int8.

For each model (random weights, batch-norm statistics set by a few train-mode batches,
96x96 inputs, march Bayes): calibrate, one QAT step, ``set_fake_quantize(model,
"validation")``, ``convert_fx``; then on a held-out random batch compare the QAT model's
output with the converted model's, in validation state (the integer twin) and with
exactness off (the float fake-quant simulation): share of outputs exactly equal, relative L2 error,
argmax agreement and SQNR (dB). The same flow through torch.ao (``prepare_qat_fx`` with the
x86 qconfig mapping, observers disabled after the QAT step, ``convert_fx``) gives torch.ao's
fake-quant-vs-int8 figures in the same run. Needs torchvision (``/work/tvenv/bin/python``).

    PYTHONPATH=. /work/tvenv/bin/python benchmarks/fidelity.py \
        --txt benchmarks/results/fidelity.txt --json benchmarks/results/fidelity.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from typing import Any

import torch
from torch import nn

from benchmarks.torchvision_qat_error import Quantized, _warm_bn
from qir.march import march_scope
from qir.quantization import (
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.exact_validation import set_exact_validation

_HEADS = {"resnet18": "model.fc", "resnet50": "model.fc", "mobilenet_v2": "model.classifier.1"}


def _float_model(name: str, size: int) -> nn.Module:
    import torchvision

    if name not in _HEADS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(_HEADS)}")
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    _warm_bn(model, size)
    return model


def compare(ref: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    """Figures of ``out`` (deployed) against ``ref`` (simulated): equal %, rel L2, argmax, SQNR dB."""
    ref = ref.float()
    out = out.float()
    err = (out - ref).norm()
    sqnr = math.inf if float(err) == 0.0 else float(20 * torch.log10(ref.norm() / err))
    return {
        "equal_pct": 100.0 * float((ref == out).float().mean()),
        "rel_l2": float(err / ref.norm()),
        "argmax_agreement_pct": 100.0 * float((ref.argmax(1) == out.argmax(1)).float().mean()),
        "sqnr_db": sqnr,
    }


def run_qir(name: str, size: int, batch: int) -> list[tuple[str, dict[str, Any]]]:
    wrapped = Quantized(_float_model(name, size)).eval()
    g = torch.Generator().manual_seed(1)
    with march_scope("bayes"):
        calib = prepare_qat_fx(wrapped, {"": get_default_calib_qconfig()})
        calib.eval()
        with torch.no_grad():
            for _ in range(3):
                calib(torch.randn(batch, 3, size, size, generator=g))
        qat = prepare_qat_fx(
            calib, {"": get_default_qat_qconfig(), "module_name": {_HEADS[name]: get_default_qat_out_qconfig()}}
        )
        _one_qat_step(qat, batch, size, g)
        qat.eval()
        set_fake_quantize(qat, "validation")
        converted = convert_fx(qat)
        x = torch.randn(batch, 3, size, size, generator=g)
        with torch.no_grad():
            want = converted(x)
            exact = compare(qat(x), want)  # validation state: the integer twin (docs/semantics.md)
            set_exact_validation(qat, False)
            simulated = compare(qat(x), want)  # the float fake-quant simulation
    return [("qir QAT-validation vs conv", exact), ("qir float sim vs conv", simulated)]


def run_torch_ao(name: str, size: int, batch: int) -> list[tuple[str, dict[str, Any]]]:
    from torch.ao.quantization import disable_observer, get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx as ao_convert
    from torch.ao.quantization.quantize_fx import prepare_qat_fx as ao_prepare

    torch.backends.quantized.engine = "x86"
    model = _float_model(name, size).train()
    g = torch.Generator().manual_seed(1)
    example = (torch.randn(1, 3, size, size),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's fx flow warns that it is deprecated
        qat = ao_prepare(model, get_default_qat_qconfig_mapping("x86"), example)
        with torch.no_grad():  # calibration: observers run, weights stay
            for _ in range(3):
                qat(torch.randn(batch, 3, size, size, generator=g))
        _one_qat_step(qat, batch, size, g)
        qat.eval()
        qat.apply(disable_observer)
        converted = ao_convert(qat)
    x = torch.randn(batch, 3, size, size, generator=g)
    with torch.no_grad():
        return [("torch.ao fake quant vs int8", compare(qat(x), converted(x)))]


def _one_qat_step(model: nn.Module, batch: int, size: int, g: torch.Generator) -> None:
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch, 3, size, size, generator=g)
    loss = nn.functional.cross_entropy(model(x), torch.randint(0, 1000, (batch,), generator=g))
    opt.zero_grad()
    loss.backward()
    opt.step()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="QAT-validation vs converted fidelity, beside torch.ao")
    ap.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2", "resnet50"])
    ap.add_argument("--size", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--txt", default=None, help="also write the table to this file")
    ap.add_argument("--json", default=None, help="write the figures as JSON to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [
        f"{'model':<14} {'flow':<28} {'equal %':>8} {'rel L2':>9} {'argmax %':>9} {'SQNR dB':>8} {'s':>6}",
    ]
    print(lines[0], flush=True)
    rows: list[dict[str, Any]] = []
    for name in args.models:
        for fn in (run_qir, run_torch_ao):
            t0 = time.perf_counter()
            results = fn(name, args.size, args.batch)
            seconds = time.perf_counter() - t0
            for flow, figures in results:
                r = {"model": name, "flow": flow, **figures, "seconds": seconds}
                rows.append(r)
                line = (
                    f"{name:<14} {flow:<28} {r['equal_pct']:8.1f} {r['rel_l2']:9.4f} "
                    f"{r['argmax_agreement_pct']:9.1f} {r['sqnr_db']:8.1f} {r['seconds']:6.1f}"
                )
                lines.append(line)
                print(line, flush=True)
    if args.txt:
        with open(args.txt, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            # an exact match has infinite SQNR: JSON has no infinity, so it is written as null
            clean = [{k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in r.items()} for r in rows]
            json.dump({"size": args.size, "batch": args.batch, "march": "bayes", "rows": clean}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
