"""Conversion's weight arithmetic on one intra-op thread.

Converting a conv / linear makes a handful of passes over its weight (the observation's min and
max, the division by the scale, the rounding, the clamp, the cast to codes, the L1 norms): each a
memory-bound elementwise kernel over at most a few MB. Fanned out to torch's intra-op threads they
cost about twice the CPU time for little wall time on an idle machine, and on a busy one a thread
the scheduler holds back stalls the others: resnet50's weight codes took 88-136 ms of CPU time
(240-320 ms wall) with two threads at load average 13 on two cores, 23-24 ms (47-64 ms wall) with
one (benchmarks/README.md). The quantize pass's rule loop and module swapping
(qir.quantization.convert) each set it once per model, not once per layer. The compiled model's
runtime and ``compile_model`` set their thread counts for the same reason.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["one_intra_op_thread"]

_LOCK = threading.Lock()
_depth = 0  # blocks open, in any thread
_saved = 1  # the thread count before the first of them


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Inside the block (usable as a decorator) torch runs intra-op kernels on one thread; the count
    before the outermost block is restored after it. The count is the process's: blocks open in
    several threads at once restore it when the last one closes."""
    global _depth, _saved
    with _LOCK:
        if _depth == 0:
            _saved = torch.get_num_threads()
            if _saved > 1:
                torch.set_num_threads(1)
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0 and _saved > 1:
                torch.set_num_threads(_saved)
