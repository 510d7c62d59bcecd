"""``qir passes``: list the registered passes with their options."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("passes", help="list registered passes and their options")
    p.add_argument(
        "--load",
        action="append",
        default=[],
        metavar="FILE_OR_MODULE",
        help="import a module of @register_pass passes first (a .py path or a module name; repeatable)",
    )
    p.add_argument(
        "--pipelines",
        action="store_true",
        help="print the default pipeline of each stage (prepare, convert, compile) instead of the passes",
    )
    p.add_argument("--march", default=None, help="the march of the compile stage's legalize (default: bayes)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import passes
    from qir.cli.errors import UserError

    for spec in args.load:
        try:
            passes.load_pass_module(spec)
        except passes.PipelineError as e:
            raise UserError(str(e)) from None
    if args.pipelines:
        from qir.march import March
        from qir.quantization.pipelines import STAGES, default_pipeline

        try:
            march = March.parse(args.march or "bayes")
        except ValueError as e:
            raise UserError(str(e)) from None
        width = max(len(s) for s in STAGES)
        for stage in STAGES:
            text = str(default_pipeline(stage, march)) or "(empty)"
            print(f"{stage:<{width}}  {text}")
        return 0
    print(passes.describe_passes())
    return 0
