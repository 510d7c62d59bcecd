"""``qir`` command line: argument parsing and the exit-code contract.

Exit codes: 0 success, 1 user error (message on stderr, no traceback), 2 illegal model.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from qir.cli.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    from qir.cli import cmd_demo, cmd_opt, cmd_passes

    parser = argparse.ArgumentParser(prog="qir", description="qir: quantization compiler for Horizon BPU marches")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in (cmd_demo, cmd_passes, cmd_opt):
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except UserError as e:
        print(f"qir {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"qir {args.command}: interrupted", file=sys.stderr)
        return 130
