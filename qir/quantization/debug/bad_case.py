"""``find_bad_case``: the inputs of a data set on which two models (float vs quantized) disagree most."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from qir.quantization.debug.metrics import Metric, metric
from qir.quantization.debug.taps import as_inputs, frozen

__all__ = ["BadCase", "find_bad_case"]


@dataclass(frozen=True)
class BadCase:
    """A sample by its index in the data set (batches concatenated in order) and its metric value."""

    index: int
    value: float


def _batches(data: Any) -> Iterable[tuple[Any, ...]]:
    if isinstance(data, torch.Tensor):
        return [(data,)]
    if isinstance(data, tuple):
        return [data]
    if isinstance(data, Iterable):
        return (as_inputs(b) for b in data)
    raise TypeError(f"data must be a tensor, a tuple of inputs, or an iterable of batches; got {type(data).__name__}")


def _rows(out: Any, who: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"find_bad_case compares one output tensor per sample; {who} returned {type(out).__name__}")
    if out.dim() == 0:
        raise ValueError(f"{who} returned a scalar: find_bad_case needs a batch dimension first")
    return out.detach().float().reshape(out.shape[0], -1)


def find_bad_case(
    model1: Any,
    model2: Any,
    data: Any,
    metric_name: str | Metric = "cosine",
    top_k: int = 10,
) -> list[BadCase]:
    """The ``top_k`` samples of ``data`` whose outputs differ most between ``model1`` (reference) and ``model2``.

    ``data``: a tensor (one batch), a tuple of inputs, or an iterable of batches (e.g. a
    DataLoader yielding input tensors or tuples of inputs). Each sample's output row is
    compared with ``metric_name`` (``cosine``: lowest first; ``relative_l2`` / ``max_abs``:
    highest first; ``sqnr``: lowest first). Models run in eval mode with observers frozen
    and are left as they were.
    """
    m = metric(metric_name)
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    values: list[float] = []
    with frozen(model1), frozen(model2), torch.no_grad():
        for args in _batches(data):
            a, b = _rows(model1(*args), "model1"), _rows(model2(*args), "model2")
            if a.shape != b.shape:
                raise ValueError(f"the models' outputs differ in shape: {list(a.shape)} vs {list(b.shape)}")
            values += [m.fn(x, y) for x, y in zip(a, b, strict=True)]
    order = sorted(range(len(values)), key=lambda i: values[i], reverse=not m.higher_is_better)
    return [BadCase(i, values[i]) for i in order[:top_k]]
