"""The torchvision classification zoo through the whole fx flow, per model and march: where it stops, how exact it is.

For every model of ``torchvision.models.list_models(module=torchvision.models)`` (random init: no
weights are downloaded) and each march:

1. float model: batch-norm statistics from float forwards on crops of scikit-learn's two sample
   photographs (``load_sample_images``), so activation ranges, and hence scales, are realistic;
2. ``prepare_qat_fx`` with the calibration qconfig, calibration on 3 batches of crops;
3. ``prepare_qat_fx`` with QAT qconfigs (the last linear high-precision), 2 SGD steps (lr 1e-5,
   gradient norm clipped to 1, random labels);
4. eval; one QAT-state forward (the integer grid, on by default) compared with ``convert_fx`` of
   the state that forward left ("grid == conv"); then validation state (the integer twin) compared
   with ``convert_fx`` ("val == conv"); docs/semantics.md promises both bit for bit;
5. ``check_model`` and ``compile_model`` (the march's table decides), the artifact run and compared
   with the converted model ("art == conv", bit for bit);
6. float vs converted top-1 agreement on the held-out crops.

Each row says the first stage that refused and its message. Inputs are 2 x 3 x 64 x 64 (the
models that need more get their minimum; the vision transformers are built for 64 x 64 inputs).
Needs torchvision (``/work/tvenv/bin/python``); run from the repository root::

    PYTHONPATH=. /work/tvenv/bin/python benchmarks/zoo_flow.py [--models resnet18 swin_t] \\
        [--marches bayes bernoulli2] [--max-params 100e6] [--timeout 900]

Every model runs in its own process (``--timeout`` seconds each); ``--in-process`` runs them here.
``--hybrid`` prepares with ``hybrid=True`` (docs/hybrid.md: what has no quantized form runs on the CPU
between generated stubs; swin's ``torch.fx.wrap``'ed attention). ``--models`` also takes the
detection / segmentation heads of :data:`HEADS` (``fcn_head``, ``deeplabv3_head``, ``retinanet_head``),
run on fixed-size random feature maps; their loss is the mean square of the outputs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    integer_grid_report,
    prepare_qat_fx,
    set_fake_quantize,
)

SIZE = 64
BATCH = 2
# the smallest input some models accept (their feature maps reach zero size, or a fixed grid)
MIN_SIZE = {"inception_v3": 75, "maxvit_t": 224}
# built for the input size: a vision transformer's position embedding is sized by image_size
VIT_KW = {"vit_b_16": 64, "vit_b_32": 64, "vit_l_16": 64, "vit_l_32": 64, "vit_h_14": 70}
# models whose training forward returns auxiliary outputs: the flow here trains one output
NO_AUX = {"googlenet", "inception_v3"}


class RetinaHead(nn.Module):
    """torchvision's RetinaNetHead on two FPN-like levels (the input and its 2x max-pooled copy): its
    ``{"cls_logits", "bbox_regression"}`` outputs as one ``(N, anchors, classes + 4)`` tensor."""

    def __init__(self, channels: int = 64, anchors: int = 9, classes: int = 8) -> None:
        from torchvision.models.detection.retinanet import RetinaNetHead

        super().__init__()
        self.pool = nn.MaxPool2d(2)
        self.head = RetinaNetHead(channels, anchors, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head([x, self.pool(x)])
        return torch.cat([out["cls_logits"], out["bbox_regression"]], dim=2)


def _fcn_head() -> nn.Module:
    from torchvision.models.segmentation.fcn import FCNHead

    return FCNHead(64, 21)


def _deeplabv3_head() -> nn.Module:
    from torchvision.models.segmentation.deeplabv3 import DeepLabHead

    return DeepLabHead(64, 21)  # ASPP (rates 12, 24, 36, an image-pooling branch) + conv / BN / ReLU + 1x1


#: heads on feature maps, not classifiers: name -> (builder, input shape of one batch)
HEADS: dict[str, tuple[Any, tuple[int, ...]]] = {
    "fcn_head": (_fcn_head, (BATCH, 64, 16, 16)),
    "deeplabv3_head": (_deeplabv3_head, (BATCH, 64, 16, 16)),
    "retinanet_head": (RetinaHead, (BATCH, 64, 16, 16)),
}


class Quantized(nn.Module):
    """``dequant(model(quant(x)))``: the stubs a float torchvision model lacks."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.model = model
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.model(self.quant(x)))


def size_of(name: str) -> int:
    if name in VIT_KW:
        return VIT_KW[name]
    return MIN_SIZE.get(name, SIZE)


def build(name: str) -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    if name in HEADS:
        return HEADS[name][0]()
    kw: dict[str, Any] = {"weights": None}
    if name in VIT_KW:
        kw["image_size"] = VIT_KW[name]
    if name in NO_AUX:
        kw.update(aux_logits=False, init_weights=True)
    return torchvision.models.get_model(name, **kw)


def crops(n: int, size: int, seed: int) -> torch.Tensor:
    """``n`` random ``size`` x ``size`` crops of the two sample photographs, ImageNet-normalized."""
    from sklearn.datasets import load_sample_images

    images = [torch.from_numpy(im.copy()).permute(2, 0, 1).float() / 255 for im in load_sample_images().images]
    g = torch.Generator().manual_seed(seed)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    out = []
    for _ in range(n):
        im = images[int(torch.randint(len(images), (1,), generator=g))]
        # a random scale, then a random crop, so the crops are not all one texture's size
        side = int(torch.randint(size, min(im.shape[1:]) + 1, (1,), generator=g))
        top = int(torch.randint(im.shape[1] - side + 1, (1,), generator=g))
        left = int(torch.randint(im.shape[2] - side + 1, (1,), generator=g))
        patch = im[:, top : top + side, left : left + side].unsqueeze(0)
        patch = nn.functional.interpolate(patch, size=(size, size), mode="bilinear", antialias=True)
        out.append((patch[0] - mean) / std)
    return torch.stack(out)


def warm_bn(model: nn.Module, data: torch.Tensor) -> None:
    """Batch-norm running statistics as the cumulative average over float forwards on real crops."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average: every batch counts the same
    model.train()
    with torch.no_grad():
        for batch in data.split(8):
            model(batch)
    for m, mom in zip(bns, saved, strict=True):
        m.momentum = mom
    model.eval()


def head_of(model: nn.Module) -> str | None:
    """The last linear in module order: the classifier, given the high-precision output qconfig.

    None for the models whose classifier is a conv followed by ReLU and pooling (squeezenet): a
    qint32 output can only go to a DeQuantStub, and prepare_qat_fx refuses it elsewhere."""
    last = None
    for path, m in model.named_modules():
        if isinstance(m, nn.Linear):
            last = path
    return last


def _msg(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}"


def _cmp(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if torch.equal(a, b):
        return "exact"
    d = (a.float() - b.float()).abs()
    return f"max {float(d.max()):.3g} ({float((d > 0).float().mean()) * 100:.1f}% differ)"


def inputs(name: str, n: int, seed: int) -> torch.Tensor:
    """``n`` inputs: photo crops for a classifier, random feature maps for a head."""
    if name in HEADS:
        g = torch.Generator().manual_seed(seed)
        return torch.randn((n, *HEADS[name][1][1:]), generator=g)
    return crops(n, size_of(name), seed)


def loss_of(out: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Cross entropy against random labels for logits; the mean square for a head's maps."""
    if out.dim() == 2:
        return nn.functional.cross_entropy(out, torch.randint(0, out.shape[1], (out.shape[0],), generator=g))
    return out.square().mean()


def run_one(name: str, march: str, lr: float = 1e-5, hybrid: bool = False) -> dict[str, Any]:
    r: dict[str, Any] = {"model": name, "march": march, "stage": "done", "error": ""}
    if hybrid:
        r["march"] = f"{march} (hybrid)"
    t0 = time.perf_counter()
    stage = "build"
    caught: list[str] = []
    try:
        float_model = build(name)
        r["params_m"] = sum(p.numel() for p in float_model.parameters()) / 1e6
        warm_bn(float_model, inputs(name, 32, seed=0))
        data = inputs(name, BATCH * 8, seed=1).split(BATCH)
        calib_data, train_data, eval_data = data[:3], data[3:5], data[5:]
        wrapped = Quantized(float_model).eval()
        with torch.no_grad():
            float_out = torch.cat([wrapped(x) for x in eval_data])
        head = head_of(float_model)
        with march_scope(march), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            stage = "prepare(calib)"
            calib = prepare_qat_fx(wrapped, {"": get_default_calib_qconfig()}, hybrid=hybrid)
            calib.eval()
            stage = "calibrate"
            with torch.no_grad():
                for x in calib_data:
                    calib(x)
            stage = "prepare(qat)"
            qconfig: dict[str, Any] = {"": get_default_qat_qconfig()}
            if head is not None:
                qconfig["module_name"] = {f"model.{head}": get_default_qat_out_qconfig()}
            qat = prepare_qat_fx(calib, qconfig, hybrid=hybrid)
            stage = "qat train"
            qat.train()
            opt = torch.optim.SGD(qat.parameters(), lr=lr)
            g = torch.Generator().manual_seed(2)
            for x in train_data:
                loss = loss_of(qat(x), g)
                opt.zero_grad()
                loss.backward()
                # random-init nets (inception_v3's std-0.1 init) have exploding gradients: clipped, the two
                # steps stay small, so float vs converted still compares nearly the same weights
                nn.utils.clip_grad_norm_(qat.parameters(), 1.0)
                opt.step()
            report = integer_grid_report(qat)
            r["grid"] = f"{sum(v == 'grid' for v in report.values())}/{len(report)}"
            stage = "qat eval (grid)"
            qat.eval()
            with torch.no_grad():
                grid_out = qat(eval_data[0])  # observes, then computes on the grid of the updated scales
            stage = "convert (grid state)"
            with torch.no_grad():
                r["grid_vs_conv"] = _cmp(grid_out, convert_fx(qat)(eval_data[0]))
            stage = "qat validation"
            set_fake_quantize(qat, "validation")
            with torch.no_grad():
                val_out = torch.cat([qat(x) for x in eval_data])
            stage = "convert"
            converted = convert_fx(qat)
            r["convert_path"] = converted.meta.get("qir.convert_path", "?") if hasattr(converted, "meta") else "?"
            with torch.no_grad():
                conv_out = torch.cat([converted(x) for x in eval_data])
            r["val_vs_conv"] = _cmp(val_out, conv_out)
            if conv_out.dim() in (2, 4):  # logits per image, or per pixel (a segmentation head)
                r["top1_float_conv"] = float((float_out.argmax(1) == conv_out.argmax(1)).float().mean())
            r["rel_l2_float_conv"] = float((conv_out - float_out).norm() / float_out.norm())
            stage = "check_model"
            legality = check_model(converted, eval_data[0], march=march)
            r["legal"] = bool(legality.ok)
            if not legality.ok:
                bad = sorted({f"{f.spelling} ({f.kind}: {f.rule or f.check})" for f in legality.violations})
                r["illegal_ops"] = ", ".join(bad)[:300]
            stage = "compile"
            compiled = compile_model(converted, [eval_data[0]], march=march, opt=1)
            stage = "run artifact"
            with torch.no_grad():
                art_out = torch.cat([compiled(x) for x in eval_data])
            r["art_vs_conv"] = _cmp(art_out, conv_out)
        # the QAT-state eval forward above is deliberate (the grid check): its warning is not a finding
        caught = [
            f"{x.category.__name__}: {' '.join(str(x.message).split())[:200]}"
            for x in w
            if "runs under eval() in QAT fake-quant state" not in str(x.message)
        ]
    except Exception as e:  # the row records whatever a stage raised
        r["stage"] = stage
        r["error"] = _msg(e)
        r["trace"] = traceback.format_exc(limit=-4)
    r["warnings"] = sorted(set(caught))
    r["seconds"] = time.perf_counter() - t0
    return r


def _row(r: dict[str, Any]) -> str:
    top1 = f"{r['top1_float_conv'] * 100:.0f}%" if "top1_float_conv" in r else "-"
    rel = f"{r['rel_l2_float_conv']:.3f}" if "rel_l2_float_conv" in r else "-"
    stop = "-" if r["stage"] == "done" else f"{r['stage']}: {r['error']}"
    if r["stage"] == "done" and not r.get("legal", True):
        stop = f"(compiled after check listed: {r.get('illegal_ops', '')})"
    cells = [
        r["model"],
        r["march"],
        r.get("grid", "-"),
        r.get("grid_vs_conv", "-"),
        r.get("val_vs_conv", "-"),
        r.get("art_vs_conv", "-"),
        top1,
        rel,
        f"{r['seconds']:.0f}",
        stop.replace("|", "/"),
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| model | march | grid modules | grid == conv | val == conv | art == conv | top-1 float/conv "
    "| rel L2 float/conv | s | stopped at |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the torchvision zoo through prepare / QAT / convert / check / compile")
    ap.add_argument("--models", nargs="+", default=None, help="default: every classification model")
    ap.add_argument("--marches", nargs="+", default=["bayes", "bernoulli2"])
    ap.add_argument("--max-params", type=float, default=None, help="skip models with more parameters")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per model and march (own process)")
    ap.add_argument("--in-process", action="store_true", help="run here, not one process per model")
    ap.add_argument("--json", type=Path, default=None, help="also append each row as a JSON line here")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "MARCH"), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hybrid", action="store_true", help="prepare with hybrid=True (CPU placement, generated stubs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(run_one(*args.one, hybrid=args.hybrid)))
        return 0
    import torchvision

    names = args.models or torchvision.models.list_models(module=torchvision.models)
    print(HEADER, flush=True)
    for name in names:
        if args.max_params is not None:
            n = sum(p.numel() for p in build(name).parameters())
            if n > args.max_params:
                print(f"| {name} | - | skipped: {n / 1e6:.0f} M parameters > --max-params |", flush=True)
                continue
        for march in args.marches:
            if args.in_process:
                r = run_one(name, march, hybrid=args.hybrid)
            else:
                cmd = [sys.executable, __file__, "--one", name, march, "--threads", str(args.threads)]
                cmd += ["--hybrid"] if args.hybrid else []
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                    lines = p.stdout.strip().splitlines()
                    r = json.loads(lines[-1]) if p.returncode == 0 and lines else None
                    if r is None:
                        tail = " ".join(p.stderr.strip().splitlines()[-1:])
                        r = {"model": name, "march": march, "stage": "process", "error": tail[:400], "seconds": 0.0}
                except subprocess.TimeoutExpired:
                    r = {"model": name, "march": march, "stage": "timeout", "error": f">{args.timeout:.0f} s"}
                    r["seconds"] = args.timeout
            print(_row(r), flush=True)
            if args.json is not None:
                with args.json.open("a") as f:
                    f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
