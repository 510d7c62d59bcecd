"""``qir`` command line: argument parsing and the exit-code contract.

Exit codes: 0 success, 1 user error (one-line message on stderr, no traceback), 2 illegal
model (the legality table is printed), 3 an artifact that differs from its converted
model (a qir bug), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from qir.cli.errors import EXIT_ILLEGAL, EXIT_USER_ERROR, IllegalModel, UserError


class Parser(argparse.ArgumentParser):
    """argparse exits with status 2 on a bad option; here 2 means an illegal model, so raise instead."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    from qir.cli import (
        cmd_check,
        cmd_compile,
        cmd_demo,
        cmd_ops,
        cmd_opt,
        cmd_passes,
        cmd_perf,
        cmd_run,
        cmd_show,
        cmd_similarity,
    )

    parser = Parser(prog="qir", description="qir: quantization compiler for Horizon BPU marches (bayes, bernoulli2)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = (
        cmd_demo,
        cmd_check,
        cmd_compile,
        cmd_run,
        cmd_perf,
        cmd_show,
        cmd_similarity,
        cmd_ops,
        cmd_passes,
        cmd_opt,
    )
    for mod in commands:
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    command = "qir"
    try:
        args = parser.parse_args(argv)
        command = f"qir {args.command}"
        return int(args.run(args))
    except UserError as e:
        # one line: the first of the message (later ones, e.g. a caret under a pipeline, need the context)
        print(f"{command}: error: {(str(e).strip().splitlines() or [''])[0]}", file=sys.stderr)
        return EXIT_USER_ERROR
    except IllegalModel as e:
        print(f"{command}: {e}", file=sys.stderr)
        return EXIT_ILLEGAL
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
