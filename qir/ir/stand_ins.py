"""Stand-in constants: zeros bound where IR text has no tensor, for inspection only.

``parse_graph(text, allow_unbound=True)`` (``qir opt``, golden files) binds zeros of each
unbound constant's declared type so the text can be verified, transformed and printed
without its weights. Those zeros are not data: :func:`~qir.ir.verify` checks their shapes
and dtypes but not their values (a zero scale, an all-zero segmented table), so a graph that
holds one verifies and may still fail, or compute nonsense, when it runs. Everything that
executes a graph (``run_graph``, ``emit``, lowering / compile) therefore refuses one with a
:class:`StandInError` naming the constants and the fix.

A stand-in is marked by tensor identity, so the mark follows the tensor through
``Graph.copy`` and pass pipelines, and ends when a real tensor is bound in its place
(``graph.constants[key] = tensor``, even one of zeros). Constants a pipeline derives while
its input holds stand-ins are marked too (:func:`mark_derived`): a weight quantized from
zeros is no more real than the zeros.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from qir.ir.op import IRError

#: the stand-ins by id (a tensor's ``==`` is elementwise); an entry leaves when its tensor
#: dies, so a live id names one tensor
_STAND_INS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


class StandInError(IRError):
    """A graph holding stand-in constants was asked to execute (run, emit or compile)."""

    def __init__(self, message: str, keys: list[str]) -> None:
        super().__init__(message)
        self.keys = keys


def mark_stand_in(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as a stand-in for a constant whose data is not known; return it."""
    _STAND_INS[id(t)] = t
    return t


def is_stand_in(t: object) -> bool:
    """Whether ``t`` is a tensor marked by :func:`mark_stand_in`."""
    return isinstance(t, torch.Tensor) and _STAND_INS.get(id(t)) is t


def stand_in_keys(constants: Mapping[str, object]) -> list[str]:
    """The keys of ``constants`` (a graph's ``constants``) bound to stand-ins, in order."""
    if not _STAND_INS:  # the common case: no text parsed with allow_unbound is alive
        return []
    return [key for key, t in constants.items() if is_stand_in(t)]


def real_tensors(before: Mapping[str, object]) -> dict[int, torch.Tensor] | None:
    """The real (not stand-in) tensors of ``before`` (a pipeline's input constants) by id, or None
    when it holds no stand-in: what :func:`mark_derived` tells derived constants by, taken once per
    pipeline (holding the tensors keeps their ids theirs while passes rebind the constants)."""
    if not stand_in_keys(before):
        return None
    return {id(t): t for t in before.values() if isinstance(t, torch.Tensor) and not is_stand_in(t)}


def mark_derived(real: Mapping[int, torch.Tensor] | None, after: dict[str, torch.Tensor]) -> list[str]:
    """Mark as stand-ins the constants of ``after`` (a pipeline's result so far) that are not among
    ``real`` (:func:`real_tensors` of its input, which holds stand-ins; None: it holds none, nothing
    is marked); return their keys."""
    if real is None:
        return []
    marked = []
    for key, t in after.items():
        if isinstance(t, torch.Tensor) and id(t) not in real:
            mark_stand_in(t)
            marked.append(key)
    return marked


def refuse_stand_ins(graph_name: str, constants: Mapping[str, object], action: str) -> None:
    """Raise :class:`StandInError` if ``constants`` holds stand-ins: ``action`` ("run",
    "emit", "lower") says what was refused."""
    keys = stand_in_keys(constants)
    if not keys:
        return
    shown = ", ".join(repr(k) for k in keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    raise StandInError(
        f"graph @{graph_name} cannot {action}: constant(s) {shown} are zero stand-ins bound by "
        "parse_graph(allow_unbound=True), not data (verify checked their shapes and dtypes, not their "
        "values); bind the real tensors: parse_graph(text, constants={"
        f"{keys[0]!r}: <tensor>, ...}}) or graph.constants[{keys[0]!r}] = <tensor>",
        keys,
    )
