"""``qir passes``: list the registered passes with their options."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("passes", help="list registered passes and their options")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import passes

    print(passes.describe_passes())
    return 0
