"""``qir similarity MODEL --input-shape ...``: per-layer agreement of two stages of a model (table, JSON, plot)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from qir.cli import calibdata, flow
from qir.cli.errors import UserError

STAGES = ("float", "prepared", "converted")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "similarity", help="per-layer similarity of two stages of a model (similarity.txt / .json / .png)"
    )
    flow.add_model_args(p)
    p.add_argument(
        "--pair",
        default="float,converted",
        metavar="A,B",
        help=f"the two stages to compare, from {', '.join(STAGES)} (default float,converted); "
        "prepared is the calibrated (or the given QAT) model",
    )
    p.add_argument("--threshold", type=float, metavar="COS", help="mark layers whose cosine is below COS")
    p.add_argument("--out", default=".", metavar="DIR", help="folder for similarity.txt / .json / .png (default .)")
    p.add_argument("--no-plot", action="store_true", help="no similarity.png (matplotlib not needed)")
    p.set_defaults(run=run)


def _pair(text: str) -> tuple[str, str]:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or any(p not in STAGES for p in parts):
        raise UserError(f"--pair {text!r}: give two stages separated by a comma, from {', '.join(STAGES)}")
    return parts[0], parts[1]


def _inputs(args: argparse.Namespace, prep: flow.Prepared) -> tuple[list[torch.Tensor], str]:
    if args.calib_data:
        shapes = [tuple(x.shape) for x in prep.inputs]
        batches = calibdata.calibration_batches(args.calib_data, shapes, 1)
        return list(batches[0]), f"the first batch of {args.calib_data}"
    return prep.inputs, "random example inputs (no --calib-data): the figures describe N(0, 1) inputs"


def run(args: argparse.Namespace) -> int:
    from qir.march import march_scope
    from qir.quantization.debug import featuremap_similarity

    a, b = _pair(args.pair)
    if args.threshold is not None and not -1.0 <= args.threshold <= 1.0:  # also refuses nan
        raise UserError(f"--threshold {args.threshold}: a cosine similarity lies in [-1, 1]")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out '{out}' is a file: give a folder for similarity.txt / .json / .png")
    prep = flow.prepare(args)
    stages = {"float": prep.float_model, "prepared": prep.prepared, "converted": prep.model}
    missing = [s for s in (a, b) if stages[s] is None]
    if missing:
        raise UserError(
            f"--pair {args.pair}: a {prep.kind} model has no {' or '.join(missing)} stage; "
            f"give the float model to compare {', '.join(STAGES)}"
        )
    inputs, source = _inputs(args, prep)
    try:
        with march_scope(prep.march):
            report = featuremap_similarity(
                stages[a], stages[b], tuple(inputs), threshold=args.threshold, out_dir=args.out, plot=not args.no_plot
            )
    except ImportError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"cannot write to --out '{args.out}': {e.strerror or e}") from None
    except (ValueError, TypeError, RuntimeError) as e:
        raise UserError(f"cannot compare {a} and {b}: {e}") from None
    print(f"qir similarity: {args.model} ({flow.kind_note(prep.kind)}), march {prep.march}, {a} vs {b}")
    for n in [*prep.notes, f"compared on {source}"]:
        print(f"  note: {n}")
    print(report.table(), end="")
    if args.threshold is not None:
        first = report.first_drop(args.threshold)
        print(f"first layer below {args.threshold}: {first.name if first else '(none)'}")
    names = ["similarity.txt", "similarity.json", *([] if args.no_plot else ["similarity.png"])]
    print(f"written: {', '.join(str(Path(args.out) / n) for n in names)}")
    return 0
