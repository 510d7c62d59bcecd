"""verify on a converted model: a first verify scans every bound constant's values (requantization
multipliers and shifts, each channel's weights for the int64 accumulator bound, tables); a verify
after a pass that left the constants alone finds them by identity and version and does not scan
them again (qir/ir/verifier.py ``_check_values``). Prints both beside each other, measured in the
same run, on a chain of conv-bn-relu blocks converted for Bayes and traced to the integer IR.

    PYTHONPATH=. python benchmarks/verify_cost.py [--blocks 40] [--channels 64] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import passes
from qir.frontend import trace
from qir.ir import Graph, verify
from qir.ir import verifier as verifier_module
from qir.march import march_scope
from qir.quantization import DeQuantStub, QuantStub, convert_fx, get_default_qat_qconfig, prepare_qat_fx

try:
    from benchmarks.pipeline_cost import best_of
except ImportError:  # run as a script: benchmarks/ is on sys.path, not the repository root
    from pipeline_cost import best_of  # type: ignore[no-redef]


class _Chain(nn.Module):
    def __init__(self, blocks: int, ch: int) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.stem = nn.Conv2d(3, ch, 3, padding=1)
        layers: list[nn.Module] = []
        for _ in range(blocks):
            layers += [nn.Conv2d(ch, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.body(self.stem(self.quant(x))))


def converted_graph(blocks: int, ch: int) -> Graph:
    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    with march_scope("bayes"):
        qat = prepare_qat_fx(_Chain(blocks, ch), {"": get_default_qat_qconfig()}, example_inputs=(x,))
        qat(x)
        model = convert_fx(qat.eval())
    return trace(model, (x,))


class _Forgets(dict):  # type: ignore[type-arg]
    """A value-check cache that keeps nothing: every verify scans every constant."""

    def __setitem__(self, key: object, value: object) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    graph = converted_graph(args.blocks, args.channels)
    state = sum(t.numel() for t in graph.constants.values())

    def cold() -> None:
        verifier_module._PASSED.clear()  # every constant scanned, as before the cache
        verify(graph)

    cold_s = best_of(args.repeat, cold)[0]
    verify(graph)
    warm_s = best_of(args.repeat, lambda: verify(graph))[0]
    # a pipeline of three passes that change nothing, verifying before and after each
    # (verify_each): with the cache, and with a cache that keeps nothing (every verify scans)
    verifier_module._PASSED.clear()
    pipe_s = best_of(args.repeat, lambda: passes.run_pipeline(graph, "dce,dce,dce"))[0]
    kept = verifier_module._PASSED
    verifier_module._PASSED = _Forgets()
    try:
        pipe_cold_s = best_of(args.repeat, lambda: passes.run_pipeline(graph, "dce,dce,dce"))[0]
    finally:
        verifier_module._PASSED = kept
    load = os.getloadavg()[0]
    print(
        f"verify_cost: {len(graph)} IR nodes, {len(graph.constants)} constants ({state:,} values), "
        f"best of {args.repeat}, load average {load:.2f}"
    )
    print(f"  verify, every constant scanned                           {cold_s * 1e3:9.2f} ms")
    print(f"  verify, constants unchanged (cached)                     {warm_s * 1e3:9.2f} ms")
    print(f"  ratio                                                    {cold_s / warm_s:9.2f}x")
    print(f"  pipeline dce,dce,dce, verify_each, every verify scanning {pipe_cold_s * 1e3:9.2f} ms")
    print(f"  pipeline dce,dce,dce, verify_each, cached                {pipe_s * 1e3:9.2f} ms")
    print(f"  ratio                                                    {pipe_cold_s / pipe_s:9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
