"""Real QAT on scikit-learn's digits: float, calibration-only, QAT and converted (integer) accuracy.

A small residual CNN on the 8x8 digits (1,797 images, fixed 75/25 split) goes through the
seed 003 flow for each march: float training, ``prepare_qat_fx`` with the calibration
qconfig and a calibration pass, ``prepare_qat_fx`` again with QAT qconfigs (last layer
high-precision), QAT fine-tuning, ``convert_fx``, then ``compile_model`` to an .hbm
artifact loaded back with ``qir.load_compiled``. Prints one table row per march:

    march       float  calib   QAT  converted  artifact  bit-exact  QAT~conv argmax
    bayes       ...

("bit-exact": the loaded artifact's outputs equal the converted model's on the whole test
set) and checks the converted accuracy is within 1 point of float, that the QAT and
converted models agree on >= 99.5% of test predictions and that the artifact is bit-exact
(exit status 1 otherwise).

    python benchmarks/digits_accuracy.py [--epochs 30] [--qat-epochs 5] [--json out.json] [--png out.png]

The plot needs matplotlib (``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import DeQuantStub

from qir.march import march_scope
from qir.quantization import (
    CompileError,
    QuantStub,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    load_compiled,
    prepare_qat_fx,
    set_fake_quantize,
)


class DigitsCNN(nn.Module):
    """conv-bn-relu, a residual conv-bn + add + relu, max pool, conv-bn-relu, global mean, linear."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.quant = QuantStub(scale=1 / 128)  # inputs in [-1, 1], as camera data at 1/128
        self.conv0 = nn.Conv2d(1, width, 3, padding=1)
        self.bn0 = nn.BatchNorm2d(width)
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        x = F.relu(self.bn0(self.conv0(x)))
        x = F.relu(self.bn1(self.conv1(x)) + x)
        x = self.pool(x)
        x = F.relu(self.bn2(self.conv2(x)))
        x = torch.flatten(self.gap(x), 1)
        return self.dequant(self.fc(x))


def digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """8x8 digits in [-1, 1]; a fixed shuffled 75/25 split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = len(y) // 4
    return x[perm[n_test:]], y[perm[n_test:]], x[perm[:n_test]], y[perm[:n_test]]


def _batches(x: torch.Tensor, y: torch.Tensor, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    return [(x[perm[i : i + size]], y[perm[i : i + size]]) for i in range(0, len(y), size)]


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, seed: int) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for epoch in range(epochs):
        for xb, yb in _batches(x, y, 64, seed + epoch):
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(x).argmax(1)


def accuracy(pred: torch.Tensor, y: torch.Tensor) -> float:
    return 100.0 * float((pred == y).float().mean())


@dataclass
class Row:
    march: str
    float_acc: float
    calib_acc: float
    qat_acc: float
    converted_acc: float
    artifact_acc: float  # compile_model -> .hbm -> qir.load_compiled
    artifact_bit_exact: bool  # the loaded artifact's outputs equal the converted model's on the test set
    legality: str  # check_model's verdict ("legal", or the violations; the artifact is then built with check=False)
    agreement: float  # % of test images where QAT and converted argmax agree
    seconds: float


def run_march(
    march: str, float_model: nn.Module, data: tuple[torch.Tensor, ...], qat_epochs: int, seed: int = 0
) -> Row:
    x_tr, y_tr, x_te, y_te = data
    t0 = time.perf_counter()
    with march_scope(march):
        calib = prepare_qat_fx(float_model, {"": get_default_calib_qconfig()})
        calib.eval()
        with torch.no_grad():
            for xb, _ in _batches(x_tr, y_tr, 128, seed):
                calib(xb)
        set_fake_quantize(calib, "validation")  # evaluate the calibrated scales (observers frozen)
        calib_acc = accuracy(predict(calib, x_te), y_te)
        set_fake_quantize(calib, "calibration")
        qat_model = prepare_qat_fx(
            calib, {"": get_default_qat_qconfig(), "module_name": {"fc": get_default_qat_out_qconfig()}}
        )
        train(qat_model, x_tr, y_tr, qat_epochs, lr=1e-4, seed=seed + 1000)
        # validation mode: observers frozen, so evaluating does not move the scales that convert reads
        set_fake_quantize(qat_model, "validation")
        qat_pred = predict(qat_model, x_te)
        converted = convert_fx(qat_model)
        conv_pred = predict(converted, x_te)
        with tempfile.TemporaryDirectory() as tmp:
            hbm = os.path.join(tmp, f"digits_{march}.hbm")
            try:
                compile_model(converted, [x_te[:1]], hbm=hbm)
                legality = "legal"
            except CompileError as e:  # report the march's legality verdict; still measure the artifact
                legality = "; ".join(line.strip() for line in str(e).splitlines()[1:])
                compile_model(converted, [x_te[:1]], hbm=hbm, check=False)
            artifact = load_compiled(hbm)
            with torch.no_grad():
                art_out = artifact(x_te)
                bit_exact = torch.equal(art_out, converted(x_te))
    return Row(
        march=march,
        float_acc=accuracy(predict(float_model, x_te), y_te),
        calib_acc=calib_acc,
        qat_acc=accuracy(qat_pred, y_te),
        converted_acc=accuracy(conv_pred, y_te),
        artifact_acc=accuracy(art_out.argmax(1), y_te),
        artifact_bit_exact=bit_exact,
        legality=legality,
        agreement=accuracy(conv_pred, qat_pred),
        seconds=time.perf_counter() - t0,
    )


def run(
    epochs: int = 30, qat_epochs: int = 5, marches: tuple[str, ...] = ("bayes", "bernoulli2"), seed: int = 0
) -> list[Row]:
    torch.manual_seed(seed)
    data = digits(seed)
    float_model = DigitsCNN()
    train(float_model, data[0], data[1], epochs, lr=3e-3, seed=seed)
    float_model.eval()
    return [run_march(m, float_model, data, qat_epochs, seed) for m in marches]


def table(rows: list[Row]) -> str:
    lines = [
        f"{'march':<11} {'float':>6} {'calib':>6} {'QAT':>6} {'converted':>9} {'artifact':>8} "
        f"{'bit-exact':>9} {'QAT~conv argmax':>16}"
    ]
    for r in rows:
        lines.append(
            f"{r.march:<11} {r.float_acc:6.2f} {r.calib_acc:6.2f} {r.qat_acc:6.2f} "
            f"{r.converted_acc:9.2f} {r.artifact_acc:8.2f} {'yes' if r.artifact_bit_exact else 'NO':>9} "
            f"{r.agreement:15.2f}%"
        )
    for r in rows:
        if r.legality != "legal":
            lines.append(f"{r.march}: check_model: {r.legality} (artifact compiled with check=False)")
    return "\n".join(lines)


def check(rows: list[Row], max_drop: float = 1.0, min_agreement: float = 99.5) -> list[str]:
    """Failed requirements (empty when all hold)."""
    bad = []
    for r in rows:
        if r.float_acc - r.converted_acc > max_drop:
            bad.append(
                f"{r.march}: converted {r.converted_acc:.2f}% is more than {max_drop} below float {r.float_acc:.2f}%"
            )
        if r.agreement < min_agreement:
            bad.append(f"{r.march}: QAT and converted agree on {r.agreement:.2f}% < {min_agreement}%")
        if not r.artifact_bit_exact:
            bad.append(f"{r.march}: the loaded artifact's outputs differ from the converted model's")
    return bad


def plot(rows: list[Row], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [
        ("float_acc", "float"),
        ("calib_acc", "calibration"),
        ("qat_acc", "QAT"),
        ("converted_acc", "integer (converted)"),
        ("artifact_acc", "artifact (.hbm)"),
    ]
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.16
    for i, (key, label) in enumerate(kinds):
        xs = [j + (i - 2) * width for j in range(len(rows))]
        vals = [getattr(r, key) for r in rows]
        bars = ax.bar(xs, vals, width, label=label)
        for b, r, v in zip(bars, rows, vals, strict=True):
            extra = ("\nbit-exact" if r.artifact_bit_exact else "\nNOT exact") if key == "artifact_acc" else ""
            ax.annotate(f"{v:.2f}{extra}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    lo = min(min(getattr(r, k) for k, _ in kinds) for r in rows)
    ax.set_ylim(max(0.0, lo - 5), 101.5)
    ax.set_xticks(range(len(rows)), [r.march for r in rows])
    ax.set_xlabel("march")
    ax.set_ylabel("test accuracy (%), y axis not from 0")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper center", ncol=5, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--qat-epochs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None, help="write a grouped bar chart here (needs matplotlib)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.epochs, args.qat_epochs, seed=args.seed)
    print(table(rows))
    if args.json:
        out: dict[str, Any] = {
            "rows": [asdict(r) for r in rows],
            "epochs": args.epochs,
            "qat_epochs": args.qat_epochs,
            "seed": args.seed,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if args.png:
        plot(
            rows,
            args.png,
            f"scikit-learn digits (449 test images), residual CNN: accuracy per stage and march\n"
            f"{args.epochs} float epochs, {args.qat_epochs} QAT epochs, seed {args.seed}",
        )
        print(f"wrote {args.png}")
    bad = check(rows)
    for b in bad:
        print("FAIL:", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
