"""torchvision resnet18 / mobilenet_v2 (random weights) through the fx flow: calibrate, one QAT step, convert.

For each model and march: ``prepare_qat_fx`` with the calibration qconfig, a calibration
pass on random images, ``prepare_qat_fx`` with QAT qconfigs (classifier high-precision),
one SGD step in training mode, then ``convert_fx``; reports the relative L2 error
``||converted(x) - qat(x)|| / ||qat(x)||`` on a held-out random batch (both in eval mode),
and the top-1 agreement. Needs torchvision (``/work/tvenv/bin/python`` has it).

    python benchmarks/torchvision_qat_error.py [--models resnet18 mobilenet_v2] [--size 224]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from torch import nn

from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)


class Quantized(nn.Module):
    """``dequant(model(quant(x)))``: the stubs a float torchvision model lacks."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.model = model
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.model(self.quant(x)))


def _model(name: str) -> tuple[nn.Module, str]:
    import torchvision

    torch.manual_seed(0)
    if name == "resnet18":
        return torchvision.models.resnet18(weights=None), "model.fc"
    if name == "mobilenet_v2":
        return torchvision.models.mobilenet_v2(weights=None), "model.classifier.1"
    raise ValueError(f"unknown model {name!r}")


def _warm_bn(model: nn.Module, size: int) -> None:
    """Random-weight nets have unit BN statistics; a few train-mode batches give realistic ones."""
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, size, size))
    model.eval()


def run_one(name: str, march: str, size: int, batch: int) -> dict[str, Any]:
    float_model, head = _model(name)
    _warm_bn(float_model, size)
    wrapped = Quantized(float_model).eval()
    g = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    with march_scope(march):
        calib = prepare_qat_fx(wrapped, {"": get_default_calib_qconfig()})
        calib.eval()
        with torch.no_grad():
            for _ in range(3):
                calib(torch.randn(batch, 3, size, size, generator=g))
        qat_model = prepare_qat_fx(
            calib, {"": get_default_qat_qconfig(), "module_name": {head: get_default_qat_out_qconfig()}}
        )
        qat_model.train()
        opt = torch.optim.SGD(qat_model.parameters(), lr=1e-4)
        x = torch.randn(batch, 3, size, size, generator=g)
        loss = nn.functional.cross_entropy(qat_model(x), torch.randint(0, 1000, (batch,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        qat_model.eval()
        set_fake_quantize(qat_model, "validation")  # freeze scales: eval mode alone still observes
        converted = convert_fx(qat_model)
        x = torch.randn(batch, 3, size, size, generator=g)
        with torch.no_grad():
            f = qat_model(x)
            q = converted(x)
    rel = float((q - f).norm() / f.norm())
    agree = float((q.argmax(1) == f.argmax(1)).float().mean())
    return {"model": name, "march": march, "rel_l2": rel, "top1_agreement": agree, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="converted-vs-QAT error on torchvision models")
    ap.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    ap.add_argument("--marches", nargs="+", default=["bayes", "bernoulli2"])
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{'model':<14} {'march':<11} {'rel L2 (conv vs QAT)':>21} {'top-1 agree':>12} {'seconds':>8}")
    for name in args.models:
        for march in args.marches:
            r = run_one(name, march, args.size, args.batch)
            print(
                f"{r['model']:<14} {r['march']:<11} {r['rel_l2']:21.3e} {r['top1_agreement']:12.2f} {r['seconds']:8.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
