"""Where convert_fx spends its time: stage timers and a cProfile of one call.

    python benchmarks/convert_profile.py [--blocks 200] [--repeat 5] [--top 25] [--sort tottime]
    PYTHONPATH=. /work/tvenv/bin/python benchmarks/convert_profile.py --resnet50

Prepares the chain of conv-bn-relu blocks of ``pipeline_cost.py`` (``--blocks``), or
torchvision's resnet50 (``--resnet50``, a 1x3x64x64 input), between a QuantStub and a
DeQuantStub (march bayes, 1 torch thread), runs one calibration batch, then converts it by
the ``quantize`` pass. Prints the process CPU time of the best of ``--repeat`` unprofiled
``convert_fx`` calls, split into its stages (each stage's best over the calls): the typing
trace (``_qat_ir``), the pipeline (the ``quantize`` pass with the verification after it),
emit, the unread modules kept, and the rest; then the ``--top`` functions of one profiled call.
cProfile multiplies the cost of Python calls several times and not that of torch's kernels,
so compare the profile's shares with the unprofiled times.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_cost import profiled_model

#: (module, attribute) of each timed stage, as convert_fx calls it
STAGES = {
    "typing trace (_qat_ir)": ("qir.quantization.convert", "_qat_ir"),
    "quantize pass": ("passes.quantize", "Quantize.apply"),
    "verify after the pass": ("passes.instruments", "VerifyInstrument.run_after_pass"),
    "emit": ("qir.frontend", "emit"),
    "unread modules kept": ("qir.quantization.convert", "_keep_unread_modules"),
}


@contextmanager
def stage_timers(spent: dict[str, float]) -> Iterator[None]:
    """Wrap each stage's function so its process CPU time adds up in ``spent`` (restored on exit)."""
    import importlib

    undo: list[tuple[Any, str, Any]] = []
    for label, (mod_name, attr) in STAGES.items():
        owner: Any = importlib.import_module(mod_name)
        *outer, name = attr.split(".")
        for part in outer:
            owner = getattr(owner, part)
        original = owner.__dict__[name]

        def timed(*a: Any, _f: Callable[..., Any] = original, _label: str = label, **k: Any) -> Any:
            t = time.process_time()
            try:
                return _f(*a, **k)
            finally:
                spent[_label] += time.process_time() - t

        setattr(owner, name, timed)
        undo.append((owner, name, original))
    try:
        yield
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=200)
    ap.add_argument("--resnet50", action="store_true", help="torchvision's resnet50 instead of the chain")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"])
    args = ap.parse_args(argv)
    from qir.march import march_scope
    from qir.quantization import convert_fx, get_default_qat_qconfig, prepare_qat_fx

    model, x, name = profiled_model(args.resnet50, args.blocks)
    with march_scope("bayes"):
        prepared = prepare_qat_fx(model, {"": get_default_qat_qconfig()}, x)
        with torch.no_grad():
            prepared(x)  # one calibration batch: the observers hold data
        prepared.eval()
        convert_fx(prepared)  # warm-up: imports, caches
        totals: list[float] = []
        stages: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.repeat):
            spent: dict[str, float] = defaultdict(float)
            with stage_timers(spent):
                t = time.process_time()
                out = convert_fx(prepared)
                total = time.process_time() - t
            totals.append(total)
            for label in STAGES:
                stages[label].append(spent[label])
            stages["rest"].append(total - sum(spent.values()))
        load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
        print(f"{name}: convert_fx {min(totals):.3f} s CPU (best of {args.repeat}), load average {load}")
        print(f"convert path: {out.meta.get('qir.convert_path')}")
        for label, values in stages.items():
            print(f"  {label:<28} {min(values):.4f} s")
        profile = cProfile.Profile()
        profile.enable()
        convert_fx(prepared)
        profile.disable()
    pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
