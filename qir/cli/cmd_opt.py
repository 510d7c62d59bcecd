"""``qir opt``: run a pass pipeline on textual IR and print the result (like mlir-opt)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from qir.cli.errors import UserError


def register(sub: Any) -> None:
    p = sub.add_parser("opt", help="run a pipeline on a .qir text file and print the result")
    p.add_argument("file", help="IR text file ('-' for stdin)")
    p.add_argument("--pipeline", "-p", default="", help='pass pipeline, e.g. "absorb-bn,fuse,dce"')
    p.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass")
    p.add_argument("--time-passes", action="store_true", help="report seconds per pass on stderr")
    p.add_argument("--no-verify", action="store_true", help="skip verification between passes")
    p.add_argument("-o", "--output", help="write the result here instead of stdout")
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
    from qir.ir.op import IRError
    from qir.ir.parser import parse_graph
    from qir.ir.printer import print_graph

    for spec in args.load:
        try:
            passes.load_pass_module(spec)
        except passes.PipelineError as e:
            raise UserError(str(e)) from None
    if args.file == "-":
        text, source = sys.stdin.read(), "<stdin>"
    else:
        path = Path(args.file)
        if not path.is_file():
            raise UserError(f"no such IR file: {path}")
        try:
            text, source = path.read_text(encoding="utf-8"), str(path)
        except UnicodeDecodeError as e:
            raise UserError(f"{path} is not a UTF-8 IR text file (byte {e.start}: {e.reason})") from None
    try:
        # Text files carry no weights: constants are bound to zeros of their declared type.
        graph = parse_graph(text, allow_unbound=True, source=source)
    except (IRError, ValueError) as e:
        raise UserError(str(e)) from None
    instruments: list[Any] = []
    timing = passes.TimingInstrument() if args.time_passes else None
    if timing is not None:
        instruments.append(timing)
    if args.print_ir_after_all:
        instruments.append(passes.PrintIRInstrument(stream=sys.stderr))
    try:
        result = passes.run_pipeline(graph, args.pipeline, instruments=instruments, verify_each=not args.no_verify)
    except (passes.PipelineError, IRError) as e:
        raise UserError(str(e)) from None
    out = print_graph(result.graph)
    if args.no_verify:
        # unverified passes may leave a graph whose text is not IR: refuse to print it as if it were
        try:
            parse_graph(out, allow_unbound=True, source="<result>")
        except (IRError, ValueError) as e:
            first = str(e).splitlines()[0]
            raise UserError(
                f"--no-verify: the pipeline's result is not valid IR (it does not parse back: {first}); "
                "run without --no-verify to see which pass broke it"
            ) from None
    if args.output:
        try:
            Path(args.output).write_text(out)
        except OSError as e:
            raise UserError(f"cannot write -o '{args.output}': {e.strerror or e}") from None
    else:
        sys.stdout.write(out if out.endswith("\n") else out + "\n")
    if timing is not None:
        print(timing.report(), file=sys.stderr)
    return 0
