"""``qir perf MODEL --input-shape ...``: the static per-layer profile (estimated times) of the lowered model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from qir.cli import flow
from qir.cli.errors import UserError


def register(sub: Any) -> None:
    p = sub.add_parser("perf", help="estimated per-layer profile of the compiled model (perf.txt / perf.json)")
    flow.add_model_args(p)
    p.add_argument("--out", default=".", metavar="DIR", help="folder for perf.json and perf.txt (default .)")
    p.add_argument("--layer-details", action="store_true", help="one row per layer in the printout")
    p.add_argument(
        "--input-source",
        choices=("ddr", "pyramid", "resizer"),
        default="ddr",
        help="how the input arrives (changes the input traffic counted)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from qir.quantization import CompileError, perf_model

    prep = flow.prepare(args)
    try:
        prof = perf_model(
            prep.model,
            prep.inputs,
            out_dir=args.out,
            march=prep.march,
            name=prep.name,
            layer_details=args.layer_details,
            input_source=args.input_source,
        )
    except CompileError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(str(e)) from None
    print(f"qir perf: {args.model} ({flow.kind_note(prep.kind)}), march {prep.march}")
    for n in prep.notes:
        print(f"  note: {n}")
    print(prof.text(layer_details=args.layer_details), end="")
    print(f"written: {Path(args.out) / 'perf.txt'}, {Path(args.out) / 'perf.json'}")
    return 0
