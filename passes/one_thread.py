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

Whose count it is: with torch's OpenMP backend (the CPU wheels) ``torch.set_num_threads`` sets the
calling thread's count (a thread's first read takes the last count set by any thread); with the
other backends it is the process's. So each block keeps no shared state: it reads the count on
entry and gives that back on exit, on its own thread. It gives nothing back when the count is no
longer the 1 it set: someone called ``torch.set_num_threads`` in between (the user, or a block of
another thread under a process-wide count), and the latest call stands.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["one_intra_op_thread"]


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Inside the block (usable as a decorator) torch runs intra-op kernels on one thread; after it,
    also when it raises, the count found on entry is back, unless it was changed while the block ran
    (that change stands). Nested blocks leave the restoring to the outermost one."""
    before = torch.get_num_threads()
    if before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before > 1 and torch.get_num_threads() == 1:
            torch.set_num_threads(before)
