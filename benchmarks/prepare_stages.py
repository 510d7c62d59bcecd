"""Stage timers of ``prepare_qat_fx``: process CPU time and minor page faults per stage.

    PYTHONPATH=. /work/tvenv/bin/python benchmarks/prepare_stages.py --resnet50 [--repeat 5]
    python benchmarks/prepare_stages.py [--blocks 200]

Wraps the functions prepare spends its time in (by module and name; the outermost call of
each is timed, calls nested in it are not counted twice), runs one warm-up call and
``--repeat`` timed calls of ``prepare_qat_fx`` on the model of ``prepare_profile.py`` (1 torch
thread, march bayes), and prints for every stage the CPU milliseconds of the best call, its
minor page faults (``ru_minflt``: the first write to each new 4 KiB page) and its number of
calls. Stages nest (the pass pipeline holds the QAT layers' construction, which holds the
random initialization), so the column does not add up; ``whole call`` and ``system time``
are the totals. Unlike cProfile, the timers add a few microseconds per wrapped call, so the
figures are comparable with the unprofiled time.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_cost import profiled_model

#: (module, attribute, class or None, label): the stages, outermost first
STAGES: list[tuple[str, str, str | None, str]] = [
    ("qir.quantization.prepare", "build_fused_ir", None, "trace + fuse (build_fused_ir)"),
    ("qir.quantization.fuse", "borrowing_copy", None, "  copy of the user's module tree"),
    ("qir.quantization.fuse", "build_ir", None, "  fx trace -> IR"),
    ("qir.quantization.fuse", "run_stage_pipeline", None, "  passes before insert-observers (+ verify)"),
    ("passes.absorb_bn", "folded_in_dtype", None, "    batch-norm folding arithmetic"),
    ("qir.quantization.prepare", "emit_fused", None, "emits (fused float model, QAT model)"),
    ("qir.quantization.prepare", "_float_record", None, "record's copy of the fused float model"),
    ("qir.quantization.prepare", "run_stage_pipeline", None, "insert-observers pass (+ verify)"),
    ("qir.nn.qat.ir_observe", "_float_module", None, "  float module rebuilt per layer"),
    ("torch.nn.init", "kaiming_uniform_", None, "  QAT weights' random initialization"),
    ("qir.nn.qat.conv", "_built_without_init_draw", None, "  QAT conv / linear from a prototype (copies, skip)"),
    ("qir.nn.qat.conv", "skip_uniform_draws", None, "    random initialization skipped"),
    ("qir.quantization.pipelines", "verify", None, "verify (both pipelines)"),
]


def _wrap(table: dict[str, list[float]], owner: Any, attr: str, label: str) -> None:
    fn = getattr(owner, attr)
    active = [False]

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if active[0]:
            return fn(*args, **kwargs)
        active[0] = True
        t, f = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        try:
            return fn(*args, **kwargs)
        finally:
            active[0] = False
            row = table.setdefault(label, [0.0, 0, 0])
            row[0] += time.process_time() - t
            row[1] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
            row[2] += 1

    setattr(owner, attr, timed)


def _count_init(table: dict[str, list[float]], cls: type, label: str) -> None:
    init: Callable[..., None] = cls.__init__  # type: ignore[misc]

    def timed(self: Any, *args: Any, **kwargs: Any) -> None:
        t = time.process_time()
        init(self, *args, **kwargs)
        row = table.setdefault(label, [0.0, 0, 0])
        row[0] += time.process_time() - t
        row[2] += 1

    cls.__init__ = timed  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=200)
    ap.add_argument("--resnet50", action="store_true", help="torchvision's resnet50 instead of the chain")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    from qir.march import march_scope
    from qir.quantization import get_default_qat_qconfig, prepare_qat_fx
    from qir.quantization.fake_quantize import FakeQuantize

    table: dict[str, list[float]] = {}
    for module, attr, _, label in STAGES:
        owner = importlib.import_module(module)
        if hasattr(owner, attr):  # a stage the code measured does not have is left out
            _wrap(table, owner, attr, label)
    _count_init(table, FakeQuantize, "  FakeQuantize construction")

    model, x, name = profiled_model(args.resnet50, args.blocks)
    qconfig = {"": get_default_qat_qconfig()}
    best: dict[str, list[float]] = {}
    with march_scope("bayes"):
        prepare_qat_fx(model, qconfig, x)  # warm-up: imports, caches
        for _ in range(args.repeat):
            table.clear()
            before = resource.getrusage(resource.RUSAGE_SELF)
            t = time.process_time()
            prepare_qat_fx(model, qconfig, x)
            after = resource.getrusage(resource.RUSAGE_SELF)
            table["whole call"] = [time.process_time() - t, after.ru_minflt - before.ru_minflt, 1]
            table["  of it system time"] = [after.ru_stime - before.ru_stime, 0, 1]
            if "whole call" not in best or table["whole call"][0] < best["whole call"][0]:
                best = {k: list(v) for k, v in table.items()}
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"{name}: prepare_qat_fx stages, the best of {args.repeat} calls (1 torch thread), load average {load}")
    print(f"{'CPU ms':>9} {'faults':>8} {'calls':>6}  stage")
    order = ["whole call", "  of it system time", *(label for *_, label in STAGES), "  FakeQuantize construction"]
    for label in order:
        if label in best:
            ms, faults, calls = best[label]
            print(f"{ms * 1000:9.1f} {int(faults):8d} {int(calls):6d}  {label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
