"""``qir check MODEL --input-shape ...``: will the model run on the march's BPU? (exit 2 if not)."""

from __future__ import annotations

import argparse
from typing import Any

from qir.cli import flow, legality
from qir.cli.errors import IllegalModel


def register(sub: Any) -> None:
    p = sub.add_parser("check", help="check a model's legality on a march (exit 2 when illegal)")
    flow.add_model_args(p)
    p.add_argument("--report", metavar="FILE", help="also write the report to FILE")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    prep = flow.prepare(args, precheck=True)
    report = legality.check(prep.model, prep.inputs, prep.march)
    print(f"qir check: {args.model} ({flow.kind_note(prep.kind)}), march {prep.march}")
    for n in prep.notes:
        print(f"  note: {n}")
    print(report)
    legality.write_report(report, args.report)
    if not report.ok:
        raise IllegalModel(f"the model is not legal on {prep.march} ({len(report.violations)} error(s), listed above)")
    return 0
