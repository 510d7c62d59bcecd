"""The artifact's ``lut16`` kernel: a call with its per-interval integers prepared at load
(``Table16Knots``: the search over the inner knots and three gathers) against deriving everything
from the knots on every call (``lut_int16_apply``: widths, shifts and five gathers, what the
kernel did before it had a prepare), in one run; both outputs compared first (equal).

Tables: tanh at input range 8 with a qint16 output, in format 2 (knots by the error bound) and
format 1 (513 uniform knots); random qint16 codes, ``--codes`` of them; 1 torch thread, CPU time,
the minimum over ``--rounds`` of ``--steps`` calls. Also prints the prepare's one-off cost.

    PYTHONPATH=. python benchmarks/lut16_kernel.py [--codes 131072] [--rounds 7] [--steps 10]
"""

from __future__ import annotations

import argparse
import os

import torch

try:  # run as a module or as a script
    from benchmarks.table16_grid_cache import cpu_per_call
except ImportError:
    from table16_grid_cache import cpu_per_call  # type: ignore[no-redef]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codes", type=int, default=131072)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from backends.common.kernels import get_kernel
    from backends.common.lut_segmented import lut_int16, lut_int16_apply
    from backends.common.program import Instruction

    kernel = get_kernel("lut16")
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-32768, 32768, (args.codes,), generator=g, dtype=torch.int16)
    load = os.getloadavg()
    print(
        f"lut16 kernel, {args.codes} qint16 codes, tanh (input range 8, qint16 output), 1 thread, "
        f"min of {args.rounds} x {args.steps}; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print(f"{'format':<8} {'knots':>6} {'per call ms':>12} {'prepared ms':>12} {'ratio':>6} {'prepare ms':>11}")
    for version in (2, 1):
        table = lut_int16(torch.tanh, 8 / 32767.5, 1 / 32767.5, "qint16", measure=False, version=version).entries
        inst = Instruction("lut16", ("x",), ("y",), {"out_dtype": "qint16", "version": version}, {"table": "t"})
        consts = {"t": table}
        state = kernel.prepare(inst, consts)
        assert torch.equal(kernel.run(inst, [codes], state)[0], lut_int16_apply(table, codes, "qint16", version))
        before = after = prep = float("inf")
        for _ in range(args.rounds):
            before = min(before, cpu_per_call(lambda: lut_int16_apply(table, codes, "qint16", version), args.steps))  # noqa: B023
            after = min(after, cpu_per_call(lambda: kernel.run(inst, [codes], state), args.steps))  # noqa: B023
            prep = min(prep, cpu_per_call(lambda: kernel.prepare(inst, consts), args.steps))  # noqa: B023
        knots = table.shape[-1]
        print(
            f"{version:<8} {knots:>6} {before * 1e3:>12.2f} {after * 1e3:>12.2f} {before / after:>5.2f}x "
            f"{prep * 1e3:>11.3f}"
        )


if __name__ == "__main__":
    main()
