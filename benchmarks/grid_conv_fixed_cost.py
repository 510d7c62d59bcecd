"""The fixed cost of one QAT conv on the integer grid: tiny layers, where the per-step work that does
not scale with the activation size (observers, scales, multipliers and shifts, codes of the weight
and bias, autograd nodes) is all there is.

A chain of ``--layers`` depthwise 3x3 conv + BN + ReLU6 blocks (16 channels, batch 2, 4x4) between a
QuantStub and a DeQuantStub, ``prepare_qat_fx`` (march bayes, default QAT qconfig). Forward plus
backward, timed in this process's CPU time with 1 torch thread: the float model, the QAT model on
the integer grid and with float fake quantization (``set_integer_grid(model, False)``), round-robin;
the figure is the minimum over ``--rounds`` of ``--steps`` steps, per layer. Prints microseconds
per layer and the ratios to float.

    PYTHONPATH=. python benchmarks/grid_conv_fixed_cost.py [--layers 20] [--rounds 7] [--steps 20] [--ops] [--residual]

``--residual``: each block adds its input instead of ReLU6 (``x + BN(conv(x))``, mobilenet_v2's
residual join), so every conv is fused with an add (the fused conv + add's fixed cost).

``--ops`` also counts the tensor operations one forward + backward dispatches per layer (a
``TorchDispatchMode``, after the timing), per operation, for the grid and the float fake quant: the
fixed cost as a count the machine's load does not blur.
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn


class _Chain(nn.Module):
    def __init__(self, layers: int, residual: bool = False) -> None:
        super().__init__()
        from qir.quantization import DeQuantStub, QuantStub

        self.quant = QuantStub()
        tail: list[nn.Module] = [] if residual else [nn.ReLU6()]
        block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.BatchNorm2d(16), *tail)
        self.body = nn.ModuleList([copy.deepcopy(block) for _ in range(layers)])
        self.residual = residual
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        for block in self.body:
            x = x + block(x) if self.residual else block(x)
        return self.dequant(x)


def _qat(model: nn.Module, grid: bool) -> nn.Module:
    from qir.march import march_scope
    from qir.quantization import get_default_qat_qconfig, prepare_qat_fx, set_integer_grid

    with march_scope("bayes"):
        qat = prepare_qat_fx(copy.deepcopy(model), {"": get_default_qat_qconfig()}).train()
    return set_integer_grid(qat, grid)


def count_ops(step: Callable[[], None]) -> collections.Counter[str]:
    """The tensor operations one call of ``step`` dispatches, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    with _Count() as c:
        step()
    return c.ops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ops", action="store_true", help="also count the tensor operations per layer")
    ap.add_argument("--residual", action="store_true", help="x + BN(conv(x)) blocks: convs fused with an add")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _Chain(args.layers, args.residual).train()
    x = torch.randn(2, 16, 4, 4)
    models = {"float": model, "grid": _qat(model, True), "float fq": _qat(model, False)}

    def step_of(m: nn.Module) -> Callable[[], None]:
        def step() -> None:
            m(x).sum().backward()

        return step

    steps = {k: step_of(m) for k, m in models.items()}
    best = {k: float("inf") for k in steps}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn in steps.values():
            for _ in range(3):
                fn()
        for _ in range(args.rounds):
            for k, fn in steps.items():
                c0 = time.process_time()
                for _ in range(args.steps):
                    fn()
                best[k] = min(best[k], (time.process_time() - c0) / args.steps / args.layers * 1e6)
    cells = "  ".join(f"{k} {v:.0f} us ({v / best['float']:.2f}x)" for k, v in best.items())
    print(f"torch {torch.__version__}, 1 thread, per layer fwd + bwd, min of {args.rounds} x {args.steps}: {cells}")
    if args.ops:
        counts = {k: count_ops(steps[k]) for k in ("grid", "float fq")}
        total = {k: sum(c.values()) / args.layers for k, c in counts.items()}
        print(f"tensor operations per layer: grid {total['grid']:.1f}, float fq {total['float fq']:.1f}")
        print(f"{'operation':<24} {'grid':>6} {'float fq':>9}")
        for name, n in counts["grid"].most_common(20):
            print(f"{name:<24} {n / args.layers:>6.1f} {counts['float fq'][name] / args.layers:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
