"""The constants a grid conv derives from its scales alone, computed once per set of scale values.

A requantizing conv on the integer grid (:func:`qir.quantization.integer_grid._fused_conv`) needs, besides
the bias codes, constants that depend only on three scales: the input's ``s_in`` (one value), the weight's
``s_w`` (one per output channel) and the output's ``s_out``: the accumulator scale ``s_acc = s_w · s_in``
(float64, and rounded to float32), the tensors the autograd node broadcasts (``s_acc``, the gradient factor
``s_w``, the bias gradient's divisor), ``1 / s_in`` and the multiplier, shift and ratio ``M / 2**shift`` of
``s_acc / s_out``. While the observers train, the scales move every step and these are recomputed every
step; with the observers off (``disable_observer``, validation-style fine-tuning) or fixed scales they stay,
and recomputing them (about 30 numpy calls per conv) is wasted.

The memo is keyed on the scale values themselves (read through numpy views, no tensor operation), not on a
version counter: whatever changes a scale (an observer update, ``load_state_dict``, ``torch.load``, ``.to()``,
an in-place write to ``scale``, even through ``.data`` or numpy, a swapped fake quant) changes the key, and
equal values give equal constants, so a stale entry cannot be used. It lives beside the module (a weak
mapping), never in it: state dicts, deep copies and pickles of the model do not carry it.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from backends.common import numerics

__all__ = ["AccScales", "OutScales", "acc_scales", "host", "out_scales"]


def host(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a numpy view (a ``detach`` only where it requires grad: a parameter)."""
    return (t.detach() if t.requires_grad else t).numpy()


class AccScales(NamedTuple):
    """The constants of the accumulator scale ``s_acc = s_w · s_in`` (``c_out`` channels; tensors shaped to
    broadcast along the output axis of a rank-``len(shape)`` accumulator)."""

    s_w32: np.ndarray  # float32, per channel
    s_acc: np.ndarray  # float64: numerics.accumulator_scale, the float64 product of the float32 scales
    s_acc32_64: np.ndarray  # s_acc rounded to float32, as float64 (the output observer's factor)
    acc_scale: torch.Tensor  # s_acc in float32, broadcasting
    acc_grad: torch.Tensor  # s_w in float32, broadcasting: the accumulator's gradient factor
    bias_div: torch.Tensor  # s_w in float64, per channel: the bias gradient's divisor (s_acc / s_in)
    inv: float  # float32(1) / float32(s_in)
    shape: tuple[int, ...]


class OutScales(NamedTuple):
    """The requantization of ``s_acc / s_out`` on a march: its ratio ``M / 2**shift`` per channel (float64),
    also as a broadcasting tensor."""

    ratio: np.ndarray
    ratio_t: torch.Tensor


_Key = tuple[Any, ...]
#: module -> (key, AccScales, {(s_out, march): OutScales} for that key)
_MEMO: weakref.WeakKeyDictionary[nn.Module, tuple[_Key, AccScales, dict[tuple[float, str], OutScales]]] = (
    weakref.WeakKeyDictionary()
)


def acc_scales(m: nn.Module, s_w: torch.Tensor, s_in: float, c_out: int, shape: tuple[int, ...]) -> AccScales:
    """:class:`AccScales` of conv ``m`` with weight scale ``s_w`` (one value or one per channel) and input
    scale ``s_in`` (a float32 value), memoized on the values."""
    w = host(s_w).reshape(-1)
    key = (s_in, w.tobytes(), w.size, c_out, shape)
    known = _MEMO.get(m)
    if known is not None and known[0] == key:
        return known[1]
    s_w32 = np.array(np.broadcast_to(w, (c_out,)), dtype=np.float32)
    s_w64 = s_w32.astype(np.float64)
    s_acc = s_w64 * s_in
    s_acc32 = s_acc.astype(np.float32)
    acc = AccScales(
        s_w32,
        s_acc,
        s_acc32.astype(np.float64),
        torch.from_numpy(s_acc32.reshape(shape)),
        torch.from_numpy(s_w32.reshape(shape)),
        torch.from_numpy(s_w64),
        float(np.float32(1.0) / np.float32(s_in)),
        shape,
    )
    _MEMO[m] = (key, acc, {})
    return acc


def out_scales(m: nn.Module, acc: AccScales, s_out: float, march: str) -> OutScales:
    """:class:`OutScales` of ``acc`` (the module's current :func:`acc_scales`) requantized to ``s_out`` on
    ``march`` (``numerics.multiplier_shift``'s rule, in numpy), memoized on the values."""
    known = _MEMO.get(m)
    table = known[2] if known is not None and known[1] is acc else {}
    got = table.get((s_out, march))
    if got is not None:
        return got
    lim = numerics.requant_limits(march)
    mult, sh = numerics.multiplier_shift_np(acc.s_acc / s_out, lim.max_multiplier, lim.max_shift)
    ratio = np.ldexp(mult.astype(np.float64), -sh)
    got = OutScales(ratio, torch.from_numpy(ratio.reshape(acc.shape)))
    if len(table) >= 4:  # the output scale moves every training step: keep a few, not every one seen
        table.clear()
    table[(s_out, march)] = got
    return got
