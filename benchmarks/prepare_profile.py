"""Where prepare_qat_fx spends its time: cProfile of one call, after a warm-up call.

    python benchmarks/prepare_profile.py [--blocks 200] [--top 25] [--sort tottime]
    PYTHONPATH=. /work/tvenv/bin/python benchmarks/prepare_profile.py --resnet50

Prepares the chain of conv-bn-relu blocks of ``pipeline_cost.py`` (``--blocks``), or
torchvision's resnet50 (``--resnet50``, a 1x3x64x64 input), between a QuantStub and a
DeQuantStub (march bayes, 1 torch thread), prints the process CPU time of the best of
``--repeat`` unprofiled calls and the ``--top`` functions of one profiled call. cProfile
multiplies the cost of Python calls several times and not that of torch's kernels (the
QAT convs' random initialization, batch-norm folding), so compare the profile's shares
with the unprofiled time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_cost import profiled_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=200)
    ap.add_argument("--resnet50", action="store_true", help="torchvision's resnet50 instead of the chain")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"])
    args = ap.parse_args(argv)
    from qir.march import march_scope
    from qir.quantization import get_default_qat_qconfig, prepare_qat_fx

    model, x, name = profiled_model(args.resnet50, args.blocks)
    qconfig = {"": get_default_qat_qconfig()}
    with march_scope("bayes"):
        prepare_qat_fx(model, qconfig, x)  # warm-up: imports, caches
        times = []
        for _ in range(args.repeat):
            t = time.process_time()
            prepare_qat_fx(model, qconfig, x)
            times.append(time.process_time() - t)
        load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
        print(f"{name}: prepare_qat_fx {min(times):.3f} s CPU (best of {args.repeat}), load average {load}")
        profile = cProfile.Profile()
        profile.enable()
        prepare_qat_fx(model, qconfig, x)
        profile.disable()
    pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
