"""``qir show MODEL --input-shape ... -o model.svg``: an SVG of the lowered model, illegal layers marked."""

from __future__ import annotations

import argparse
from typing import Any

from qir.cli import flow
from qir.cli.errors import UserError


def register(sub: Any) -> None:
    p = sub.add_parser("show", help="draw the lowered model as an SVG (illegal layers in red)")
    flow.add_model_args(p)
    p.add_argument("-o", "--output", metavar="FILE", help="SVG path (default ./<factory>.svg)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from qir.quantization import CompileError, visualize_model

    prep = flow.prepare(args)
    out = args.output or f"{prep.name}.svg"
    try:
        path = visualize_model(prep.model, prep.inputs, save_path=out, march=prep.march)
    except (CompileError, OSError) as e:
        raise UserError(str(e)) from None
    print(f"qir show: {args.model} ({flow.kind_note(prep.kind)}), march {prep.march}")
    for n in prep.notes:
        print(f"  note: {n}")
    print(f"  wrote {path} ({path.stat().st_size / 1024:.1f} KiB); open it in a browser")
    return 0
