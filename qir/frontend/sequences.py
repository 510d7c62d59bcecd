"""Model inputs that are lists or tuples (an FPN head's ``forward(self, feats)``).

With example inputs, the tracer hands the forward a real list of ``getitem`` proxies of the one
placeholder, so ``len(feats)``, ``for f in feats`` and ``feats[-1]`` trace. Code that reads the
length (``len``, iteration, negative indices, slices) specialises the graph to it: the placeholder
is marked (:data:`SEQUENCE_LENGTH_META`), the IR keeps the lengths (``graph.objects``,
:data:`SEQUENCE_LENGTHS_KEY`), and every module emitted from it checks them before it runs
(:class:`LengthGuard`), so a list of another length is refused instead of read by the wrong indices.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx
from torch import nn

__all__ = [
    "SEQUENCE_LENGTHS_KEY",
    "SEQUENCE_LENGTH_META",
    "LengthGuard",
    "bind_example_inputs",
    "input_sequences",
    "install_length_guard",
    "unpack",
]

#: fx placeholder ``meta`` key: the length the traced code read from this list / tuple input
SEQUENCE_LENGTH_META = "qir.sequence_length"
#: IR ``graph.objects`` and GraphModule ``meta`` key: input name -> the length the graph is specialised to
SEQUENCE_LENGTHS_KEY = "qir.sequence_lengths"


def bind_example_inputs(root: nn.Module, example_inputs: Any) -> dict[str, Any]:
    """Forward parameter name -> example input (empty without examples or when they do not bind)."""
    if example_inputs is None:
        return {}
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    try:
        return dict(inspect.signature(root.forward).bind_partial(*args).arguments)
    except TypeError:  # propagate reports a wrong input count with the model's input names
        return {}


def input_sequences(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Per forward parameter whose example input is a list / tuple (nested, of tensors and such),
    its shape for :func:`unpack`: ``(container type, [element shapes])``, None for a leaf. Other
    inputs are left out."""

    def shape(v: Any) -> Any:
        if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):  # not a namedtuple
            return (type(v), [shape(e) for e in v])
        return None

    return {k: s for k, v in inputs.items() if (s := shape(v)) is not None}


class _Reads:
    """Marks the placeholder when the forward reads the sequence's length: the reads shared by
    :class:`_TracedList` and :class:`_TracedTuple` (this class comes first in their bases, so
    ``super()`` is the list or the tuple)."""

    _node: torch.fx.Node | None

    def _read_length(self) -> None:
        if self._node is not None:
            self._node.meta[SEQUENCE_LENGTH_META] = len(self)  # type: ignore[arg-type]

    def __len__(self) -> int:
        n: int = super().__len__()  # type: ignore[misc]
        if self._node is not None:
            self._node.meta[SEQUENCE_LENGTH_META] = n
        return n

    def __iter__(self) -> Any:
        self._read_length()
        return super().__iter__()  # type: ignore[misc]

    def __getitem__(self, i: Any) -> Any:
        if not (isinstance(i, int) and i >= 0):  # feats[-1], feats[1:]: which element depends on the length
            self._read_length()
        return super().__getitem__(i)  # type: ignore[misc]


class _TracedList(_Reads, list):  # type: ignore[type-arg]
    """A list input's getitem proxies. A subclass, so fx's pytree sees one leaf: a plain list
    would make fx flatten the input into one placeholder per element."""

    def __init__(self, items: list[Any], node: torch.fx.Node | None) -> None:
        super().__init__(items)
        self._node = node

    def __reversed__(self) -> Any:  # a tuple has none: reversed() reads __len__ and __getitem__
        self._read_length()
        return list.__reversed__(self)


class _TracedTuple(_Reads, tuple):  # type: ignore[type-arg]
    """A tuple input's getitem proxies (see :class:`_TracedList`)."""

    def __new__(cls, items: list[Any], node: torch.fx.Node | None) -> _TracedTuple:
        t = super().__new__(cls, items)
        t._node = node
        return t


def unpack(proxy: Any, shape: Any) -> Any:
    """The list / tuple of getitem proxies of ``proxy`` that ``shape`` describes; only the
    placeholder's own length is guarded (nested sequences keep the lengths of the examples)."""
    return _unpack(proxy, shape, proxy.node)


def _unpack(proxy: Any, shape: Any, node: torch.fx.Node | None) -> Any:
    if shape is None:
        return proxy
    kind, items = shape
    pieces = [_unpack(proxy[i], e, None) for i, e in enumerate(items)]
    return _TracedTuple(pieces, node) if issubclass(kind, tuple) else _TracedList(pieces, node)


def carry_lengths(root: nn.Module, graph: torch.fx.Graph) -> None:
    """A re-traced GraphModule's forward only indexes its list input: keep the lengths its graph
    was specialised to on the new placeholders."""
    lengths = getattr(root, "meta", {}).get(SEQUENCE_LENGTHS_KEY) if isinstance(root, torch.fx.GraphModule) else None
    if not lengths:
        return
    for n in graph.nodes:
        if n.op == "placeholder" and str(n.target) in lengths:
            n.meta.setdefault(SEQUENCE_LENGTH_META, lengths[str(n.target)])


class LengthGuard:
    """A forward pre-hook refusing a list / tuple input of another length than the graph's."""

    def __init__(self, positions: Mapping[str, int], lengths: Mapping[str, int], model: str) -> None:
        self.positions = dict(positions)
        self.lengths = dict(lengths)
        self.model = model

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for name, n in self.lengths.items():
            pos = self.positions.get(name)
            if name in kwargs:
                value = kwargs[name]
            elif pos is not None and pos < len(args):
                value = args[pos]
            else:
                continue
            if isinstance(value, (list, tuple)) and len(value) != n:
                raise ValueError(
                    f"{self.model}: input '{name}' has {len(value)} elements, but the model was traced for {n} "
                    "(its forward reads the length: `len`, a loop, a negative index or a slice) and the graph is "
                    f"specialised to it; pass {n}, or prepare the model again with example inputs of the new length"
                )


def install_length_guard(gm: torch.fx.GraphModule, lengths: Mapping[str, int]) -> None:
    """Record ``lengths`` in ``gm.meta`` and check them before every call of ``gm`` and of its deep
    copies (convert_fx and the validation twin start from one; fx's deepcopy keeps ``meta`` but
    drops forward hooks, so a deepcopy hook installs the check again)."""
    if not lengths:
        return
    gm.meta[SEQUENCE_LENGTHS_KEY] = dict(lengths)
    _guard(gm)
    gm._register_deepcopy_hook(_guard)


def _guard(gm: torch.fx.GraphModule) -> None:
    lengths = gm.meta.get(SEQUENCE_LENGTHS_KEY)
    if not lengths or any(isinstance(h, LengthGuard) for h in gm._forward_pre_hooks.values()):
        return
    names = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    positions = {name: i for i, name in enumerate(names)}
    gm.register_forward_pre_hook(LengthGuard(positions, lengths, type(gm).__name__), with_kwargs=True)
