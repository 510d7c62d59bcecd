"""facenet-pytorch's pretrained MTCNN stages (PNet, RNet, ONet) through the whole flow on real photos.

Each net (its pretrained weights ship in the facenet-pytorch wheel) is wrapped between a
``QuantStub`` and one ``DeQuantStub`` per output, calibrated on crops of the two photos in
``sklearn.datasets.load_sample_images()`` (china.jpg, flower.jpg; MTCNN's normalisation
``(pixel - 127.5) / 128``), prepared for QAT from the calibrated scales, put in validation
mode, converted with ``convert_fx``, checked with ``check_model``, compiled with
``compile_model`` and run from the artifact file. RNet and ONet flatten with
``x.view(x.shape[0], -1)``. Reported per net and march, on held-out crops:

* ``qat_vs_int``: ``||converted - qat|| / ||qat||`` over all outputs (QAT in validation mode);
* ``float_vs_int``: the same against the float model;
* ``face_agree``: the face / no-face decision (argmax of the softmax output) of the converted
  model equals the float model's, in %;
* ``bitexact``: the artifact's outputs ``torch.equal`` the converted model's.

Needs facenet-pytorch and scikit-learn (``/work/tvenv/bin/python`` has both):

    PYTHONPATH=. /work/tvenv/bin/python benchmarks/mtcnn_pretrained.py [--march bayes]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import qir
from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)

#: net -> (input side in pixels, number of outputs); PNet is fully convolutional: one pyramid level
NETS: dict[str, tuple[int, int]] = {"pnet": (48, 2), "rnet": (24, 2), "onet": (48, 3)}


class Stubbed(nn.Module):
    """``QuantStub`` in front, one ``DeQuantStub`` per output (boxes, [landmarks,] face probability)."""

    def __init__(self, net: nn.Module, outputs: int) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.net = net
        self.dequants = nn.ModuleList(DeQuantStub() for _ in range(outputs))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = self.net(self.quant(x))
        return tuple(dq(o) for dq, o in zip(self.dequants, outs, strict=True))


def pretrained(name: str) -> nn.Module:
    from facenet_pytorch.models.mtcnn import ONet, PNet, RNet

    net = {"pnet": PNet, "rnet": RNet, "onet": ONet}[name](pretrained=True)
    return net.eval()


def photo_crops(side: int, n: int, seed: int) -> torch.Tensor:
    """``n`` random square crops (24..200 px) of the two sklearn sample photos, resized to ``side``
    and normalised as MTCNN does: ``(pixel - 127.5) / 128``."""
    from sklearn.datasets import load_sample_images

    images = [torch.from_numpy(np.array(im)).permute(2, 0, 1).float() for im in load_sample_images().images]
    g = torch.Generator().manual_seed(seed)
    crops = []
    for i in range(n):
        im = images[i % len(images)]
        size = int(torch.randint(24, 201, (1,), generator=g))
        top = int(torch.randint(0, im.shape[1] - size + 1, (1,), generator=g))
        left = int(torch.randint(0, im.shape[2] - size + 1, (1,), generator=g))
        crop = im[None, :, top : top + size, left : left + size]
        crops.append(F.interpolate(crop, size=(side, side), mode="area"))
    return (torch.cat(crops) - 127.5) / 128.0


def _rel(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    num = sum(float((x - y).double().square().sum()) for x, y in zip(a, b, strict=True))
    den = sum(float(y.double().square().sum()) for y in b)
    return (num / den) ** 0.5


def run_one(name: str, march: str, calib: int = 64, test: int = 32, workdir: Path | None = None) -> dict[str, Any]:
    side, outputs = NETS[name]
    model = Stubbed(pretrained(name), outputs).eval()
    calib_x, test_x = photo_crops(side, calib, seed=0), photo_crops(side, test, seed=1)
    with torch.no_grad():
        want = model(test_x)
    with march_scope(march):
        calibration = prepare_qat_fx(model, {"": get_default_calib_qconfig()})
        calibration.eval()
        with torch.no_grad():
            for chunk in calib_x.split(16):
                calibration(chunk)
        qat = prepare_qat_fx(calibration, {"": get_default_qat_qconfig()})
        qat.eval()
        set_fake_quantize(qat, "validation")
        converted = convert_fx(qat)
        with torch.no_grad():
            q, c = qat(test_x), converted(test_x)
        report = check_model(converted, (test_x[:1],), march=march)
        result: dict[str, Any] = {
            "net": name,
            "march": march,
            "input": f"{side}x{side}",
            "qat_vs_int": _rel(c, q),
            "float_vs_int": _rel(c, want),
            "face_agree": float((c[-1].argmax(1) == want[-1].argmax(1)).double().mean()) * 100,
            "legal": report.ok,
            "bitexact": None,
        }
        if not report.ok:
            result["illegal"] = sorted({v.op for v in report.violations})
            return result
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(workdir or tmp) / f"{name}.hbm"
            compile_model(converted, [test_x[:1]], hbm=path, march=march)
            got = qir.load_compiled(path)(test_x)
        got = got if isinstance(got, tuple) else (got,)
        result["bitexact"] = all(torch.equal(a, b) for a, b in zip(got, c, strict=True))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--march", nargs="+", default=["bayes", "bernoulli2"])
    ap.add_argument("--nets", nargs="+", default=list(NETS))
    args = ap.parse_args()
    print(f"{'net':5} {'march':10} {'input':6} {'qat_vs_int':>10} {'float_vs_int':>12} {'face_agree':>10}  compiled")
    for march in args.march:
        for name in args.nets:
            r = run_one(name, march)
            done = (
                f"bit-exact: {r['bitexact']}"
                if r["legal"]
                else "illegal on this march: " + ", ".join(r.get("illegal", []))
            )
            print(
                f"{r['net']:5} {r['march']:10} {r['input']:6} {r['qat_vs_int']:10.5f} {r['float_vs_int']:12.4f} "
                f"{r['face_agree']:9.1f}%  {done}"
            )


if __name__ == "__main__":
    main()
