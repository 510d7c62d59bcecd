"""Catch passes that write into constant tensors they share with the input graph.

A pipeline runs on a copy of the graph that shares its constant tensors (copying every
weight per pipeline would cost more than the passes). A pass must bind a new tensor
instead of editing one in place; one that does edits the caller's graph, and its model, too.
With ``verify_each`` the pass manager fingerprints the input's constants and checks them
after every pass, so the edit is reported by the pass that made it.

The fingerprint is torch's version counter, which every in-place torch op on the tensor,
its views and index assignment bumps: O(1) per constant. Writes through ``.data`` or
through numpy bypass it.
"""

from __future__ import annotations

import torch

from qir.ir.graph import Graph


class ConstantGuard:
    """Fingerprints of ``graph``'s constant tensors, taken at construction."""

    def __init__(self, graph: Graph) -> None:
        self._prints: list[tuple[str, torch.Tensor, int]] = [
            (key, t, t._version) for key, t in graph.constants.items() if isinstance(t, torch.Tensor)
        ]

    def edited(self) -> list[str]:
        """Keys of the constants whose tensor was modified in place since construction."""
        return [key for key, t, version in self._prints if t._version != version]
