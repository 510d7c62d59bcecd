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
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import passes
    from qir.cli.errors import UserError

    for spec in args.load:
        try:
            passes.load_pass_module(spec)
        except passes.PipelineError as e:
            raise UserError(str(e)) from None
    print(passes.describe_passes())
    return 0
