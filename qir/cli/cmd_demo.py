"""``qir demo``: the whole flow on real data, one table at the end.

Trains :class:`~qir.examples.DeployableDigitsNet` on the 1,797 real 8x8 digits (fixed seed,
fixed 75/25 split) in float, calibrates, runs QAT, converts, checks legality, compiles an
artifact, loads it back and evaluates it, profiles and draws it. Everything it writes goes
to ``--out`` (default ``./qir-demo``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time
from pathlib import Path
from typing import Any

import torch

from qir.cli import flow
from qir.cli.demo_stages import Demo
from qir.cli.errors import IllegalModel, UserError


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="train, quantize, check, compile and run a digits CNN; one table")
    flow.add_march_arg(p)
    p.add_argument("--out", default="qir-demo", help="output folder (default ./qir-demo)")
    p.add_argument("--epochs", type=int, default=None, help="float training epochs (default 30; --fast: 2)")
    p.add_argument("--qat-epochs", type=int, default=None, help="QAT epochs (default 5; --fast: 1)")
    p.add_argument(
        "--fast",
        action="store_true",
        help="a quick check that the flow works: 2 float + 1 QAT epochs, compile at opt 0",
    )
    # One thread: the 8x8 layers are too small to split across threads; measured on 2 shared cores,
    # 2 threads made a training step 6x (load 4) to 100x (load 12) slower than 1.
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the layers are tiny)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the split and the batches")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    march = flow.parse_march(args.march)
    for name in ("epochs", "qat_epochs"):
        v = getattr(args, name)
        if v is not None and v < 0:
            raise UserError(f"--{name.replace('_', '-')} must be 0 or more, got {v}")
    if args.threads < 1:
        raise UserError(f"--threads must be at least 1, got {args.threads}")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the output folder '{out}': {e}") from None
    epochs = args.epochs if args.epochs is not None else (2 if args.fast else 30)
    qat_epochs = args.qat_epochs if args.qat_epochs is not None else (1 if args.fast else 5)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    demo = Demo(march, out, args.seed, progress=False if args.no_progress else None, opt=0 if args.fast else 2)
    try:
        # the library's own printouts (check_model advice, perf_model) go to files, not the terminal
        with contextlib.redirect_stdout(io.StringIO()) as captured:
            illegal = demo.run(epochs, qat_epochs)
    finally:
        torch.set_num_threads(prev_threads)
    del captured
    total = time.perf_counter() - t0
    text = demo.table(epochs, qat_epochs, total, args.threads)
    print(text)
    (out / "summary.txt").write_text(text + "\n")
    if illegal:
        raise IllegalModel(f"the model is not legal on {march}: see {out / 'legality.txt'}")
    return 0 if demo.bit_exact is not False else 3
