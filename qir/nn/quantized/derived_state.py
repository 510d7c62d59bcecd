"""The integers a quantized module derives from its scales, carried in its state dict.

A quantized module's forward reads plain integer attributes computed at conversion from the
scales and weights: a bilinear resize's ``multiplier`` / ``shift``, a fused add's
``add_multiplier`` / ``add_shift`` / ``extra_bits``, a conv's ``weight_l1_max``, an LSTM cell's
``rq`` table. ``load_state_dict`` replaces the buffers (scales, weights) but not those, so a
checkpoint of other scales loaded into a converted model ran the old requantizations. They cannot
all be recomputed from what the module keeps (a fused add depends on the weight scale, which a
converted conv no longer holds; modules built from the IR do not record the march), so each
module writes them as one int64 tensor ``<module>.derived_ints`` and reads them back on load.

Values are flattened in attribute order: ints and bools, tuples, NamedTuples, lists and dicts
of them (a dict in the sorted order of its keys' text), ``None``; other leaves (dtypes, strings) are not
derived from the scales and are left as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["DERIVED_KEY", "flatten_ints", "unflatten_ints"]

#: the state-dict key (after the module's prefix) of the derived integers
DERIVED_KEY = "derived_ints"


def flatten_ints(value: Any) -> list[int]:
    """The integers of ``value`` in a fixed order (see the module docstring)."""
    out: list[int] = []
    _flatten(value, out)
    return out


def _flatten(v: Any, out: list[int]) -> None:
    if isinstance(v, bool | int):
        out.append(int(v))
    elif isinstance(v, dict):
        for k in _key_order(v):
            _flatten(v[k], out)
    elif isinstance(v, tuple | list):
        for item in v:
            _flatten(item, out)


def _key_order(d: dict[Any, Any]) -> list[Any]:
    """A dict's keys in sorted order of their text: conversion by module swapping and by the IR
    fill the same table in different orders."""
    return sorted(d, key=str)


def unflatten_ints(like: Any, values: torch.Tensor, what: str) -> Any:
    """``like`` with its integers replaced by ``values`` (an int64 tensor from :func:`flatten_ints`
    of a value of the same structure); raises ValueError naming ``what`` when the counts differ."""
    want = len(flatten_ints(like))
    if values.dim() != 1 or values.numel() != want or values.dtype != torch.int64:
        raise ValueError(
            f"{what}: the checkpoint holds {values.numel()} derived integers ({values.dtype}), the module "
            f"{want} (int64): it is another model's"
        )
    it = iter(int(x) for x in values.tolist())
    return _rebuild(like, it)


def _rebuild(v: Any, it: Iterator[int]) -> Any:
    if isinstance(v, bool):
        return bool(next(it))
    if isinstance(v, int):
        return next(it)
    if isinstance(v, dict):
        values = {k: _rebuild(v[k], it) for k in _key_order(v)}
        return {k: values[k] for k in v}  # the module's own key order
    if isinstance(v, list):
        return [_rebuild(item, it) for item in v]
    if isinstance(v, tuple):
        items = [_rebuild(item, it) for item in v]
        return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
    return v
