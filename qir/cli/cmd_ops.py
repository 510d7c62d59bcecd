"""``qir ops --march bayes [--filter conv] [--unsupported]``: the march's operator table."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from qir.cli import flow
from qir.cli.errors import UserError
from qir.cli.tables import table


def register(sub: Any) -> None:
    p = sub.add_parser("ops", help="print a march's operator table (support, dtypes, constraints)")
    flow.add_march_arg(p)
    p.add_argument("--filter", metavar="TEXT", help="only operators whose spelling contains TEXT (any case)")
    p.add_argument("--unsupported", action="store_true", help="only operators the march does not run")
    p.add_argument("--width", type=int, default=60, help="wrap constraints at this width (default 60)")
    p.set_defaults(run=run)


def _dtypes(d: Any) -> str:
    if d is None:
        return "?"
    return "same as input" if isinstance(d, str) else ", ".join(d)


def run(args: argparse.Namespace) -> int:
    from backends.common.optable import Support, load_table

    march = flow.parse_march(args.march)
    if args.width < 20:
        raise UserError(f"--width {args.width} is too narrow (at least 20)")
    tab = load_table(march)
    entries = [e for e in tab if not args.filter or args.filter.lower() in e.spelling.lower()]
    if args.unsupported:
        entries = [e for e in entries if e.support is not Support.SUPPORTED]
    what = f"{len(entries)} of {len(tab)} operators"
    if args.filter:
        what += f" matching {args.filter!r}"
    if args.unsupported:
        what += " not supported"
    print(f"qir ops: march {march} ({tab.source.rsplit('/', 2)[-2]}/ops.json): {what}")
    if not entries:
        return 0
    rows = [["operator", "support", "input dtypes", "output dtypes", "constraints"]]
    for e in entries:
        text = e.constraints or (f"as {e.refer}" if e.refer else "")
        lines = textwrap.wrap(" ".join(text.split()), args.width) or [""]
        rows.append([e.spelling, e.support.value, _dtypes(e.input_dtypes), _dtypes(e.output_dtypes), lines[0]])
        rows += [["", "", "", "", more] for more in lines[1:]]
    print(table(rows))
    return 0
