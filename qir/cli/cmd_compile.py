"""``qir compile MODEL --input-shape ... -o model.hbm``: check, lower, write and verify the artifact."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from qir.cli import flow, legality
from qir.cli.errors import UserError
from qir.cli.tables import seconds_table

INPUT_SOURCES = ("ddr", "pyramid", "resizer")


def register(sub: Any) -> None:
    p = sub.add_parser("compile", help="compile a model to an artifact file (exit 2 when illegal)")
    flow.add_model_args(p)
    p.add_argument("-o", "--output", metavar="FILE", help="artifact path (default ./<factory>.hbm)")
    p.add_argument(
        "--opt",
        type=int,
        choices=(0, 1, 2),
        default=2,
        help="2: time each exact kernel engine and keep the fastest (default); 0/1: march preference",
    )
    p.add_argument("--input-source", choices=INPUT_SOURCES, default="ddr", help="recorded in the artifact")
    p.add_argument("--report", metavar="FILE", help="also write the legality report to FILE")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from backends.common.artifact import ArtifactError
    from qir.quantization import CompileError, compile_model, load_compiled

    prep = flow.prepare(args, precheck=True)
    out = Path(args.output or f"{prep.name}.hbm")
    t0 = time.perf_counter()
    report = legality.check(prep.model, prep.inputs, prep.march)
    prep.stages.append(("check_model", time.perf_counter() - t0))
    legality.write_report(report, args.report)
    legality.gate(report)
    t0 = time.perf_counter()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        compile_model(
            prep.model,
            prep.inputs,
            hbm=out,
            march=prep.march,
            opt=args.opt,
            input_source=args.input_source,
            check=False,
            name=prep.name,
        )
    except CompileError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"cannot write the artifact '{out}': {e}") from None
    prep.stages.append((f"compile_model (opt {args.opt})", time.perf_counter() - t0))
    t0 = time.perf_counter()
    try:
        compiled = load_compiled(out)
    except ArtifactError as e:
        raise UserError(str(e)) from None
    with torch.no_grad():
        same = _equal(compiled(*prep.inputs), prep.model(*prep.inputs))
    prep.stages.append(("load + run artifact", time.perf_counter() - t0))
    print(f"qir compile: {args.model} ({flow.kind_note(prep.kind)}), march {prep.march}")
    for n in prep.notes:
        print(f"  note: {n}")
    print(f"  legality: PASSED ({report.checked} nodes checked, {len(report.advisories)} advisory note(s))")
    print(f"  artifact: {out} ({out.stat().st_size / 1024:.1f} KiB, {len(compiled.program.instructions)} kernel calls)")
    print(f"  artifact vs converted model on the example input: {'bit-exact' if same else 'DIFFERENT'}")
    print(seconds_table(prep.stages))
    return 0 if same else 3


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)
