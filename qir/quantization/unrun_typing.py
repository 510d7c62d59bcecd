"""The QAT model's IR for a model that never ran and got no example inputs (a checkpoint flow:
a fresh ``prepare_qat_fx`` model, ``load_state_dict``, ``convert_fx``).

The ``quantize`` pass needs scales and dtypes, which the model holds, and ranks and channel
counts, which its layers tell; it does not need the batch or the image size. So the IR is typed
with those unknown (``?``, :data:`~qir.ir.types.UNKNOWN_DIM`):

1. each model input's rank and known sizes come from the first layers that read it through
   quant stubs only: a ``Conv2d`` input is ``?xCx?x?`` (C = ``in_channels``), a ``Conv1d`` one
   ``?xCx?``, a ``Linear`` one ``?xF`` (F = ``in_features``);
2. the graph is typed twice, its unknown sizes taken as two different sizes (:data:`RUN_SIZES`;
   fake quants pass their inputs through and observe nothing, so nothing of the model changes),
   and the two typings are merged value by value, as :mod:`qir.ir.unknown_dims` merges an op's
   inference: a size equal in both is known (a conv's channels, a global pool's 1x1), one that
   differs becomes ``?``;
3. the two graphs must agree on everything else: the ops and their attributes (a size computed
   from ``x.shape`` baked into a reshape differs), the number of values (``chunk`` / ``split``
   pieces), ranks, dtypes and scales. Where they do not, the model is not typed and the message
   names the node; ``convert_fx`` then converts by module swapping (same result) and says why;
4. the merged graph is verified, which refuses what the sizes cannot settle (``chunk(n)`` along
   an unknown size gives fewer pieces of a small one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from qir.ir.graph import Graph
from qir.ir.op import IRError
from qir.ir.types import UNKNOWN_DIM, TensorType, Type
from qir.ir.unknown_dims import merge_types

__all__ = ["RUN_SIZES", "input_types", "type_without_inputs"]

#: (batch, every other unknown size) of the two typing runs: sizes a strided backbone with an
#: FPN divides evenly (64 and 128 are multiples of 2^6), and a batch above 1 so batch-norm-like
#: layers run; the pairs differ in every entry so a size that depends on them differs too
RUN_SIZES = ((2, 64), (3, 128))


def _layer_shape(m: nn.Module) -> tuple[int, ...] | None:
    """The input shape a conv / linear layer reads (unknown sizes as UNKNOWN_DIM), or None."""
    weight = getattr(m, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    channels, features = getattr(m, "in_channels", None), getattr(m, "in_features", None)
    if isinstance(channels, int) and 3 <= weight.dim() <= 5:
        return (UNKNOWN_DIM, channels, *(UNKNOWN_DIM,) * (weight.dim() - 2))
    if isinstance(features, int) and weight.dim() == 2:
        return (UNKNOWN_DIM, features)
    return None


def _is_quant_stub(m: nn.Module) -> bool:
    """A QAT QuantStub (its IR op is the input's fake quant), or a float one of torch or qir."""
    from qir.frontend.lookup import tables
    from qir.ir.ops.qat import QATQuantStub
    from qir.quantization.stubs import FLOAT_QUANT_STUBS

    op = tables().for_module(m)
    return (op is not None and issubclass(op, QATQuantStub)) or isinstance(m, FLOAT_QUANT_STUBS)


def input_types(gm: torch.fx.GraphModule) -> tuple[list[TensorType] | None, str]:
    """The type of each model input from the layers that read it (see the module doc), or
    ``(None, why not)`` naming the input whose rank no layer tells."""
    types: list[TensorType] = []
    for ph in (n for n in gm.graph.nodes if n.op == "placeholder"):
        if ph.args:  # an input with a default: the run takes the default
            continue
        shapes: set[tuple[int, ...]] = set()
        readers: list[str] = []
        todo, seen = list(ph.users), set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            m = gm.get_submodule(str(n.target)) if n.op == "call_module" else None
            shape = _layer_shape(m) if m is not None else None
            if shape is not None:
                shapes.add(shape)
            elif m is not None and _is_quant_stub(m):
                todo.extend(n.users)
            else:
                readers.append(f"%{n.name}")
        if len(shapes) != 1:
            what = (
                f"layers read it as {' and '.join(str(TensorType(s)) for s in sorted(shapes))}"
                if shapes
                else f"it reaches no conv / linear layer through quant stubs only (read by {', '.join(readers)})"
            )
            return None, f"the rank of input '{ph.target}' is not known without example inputs: {what}"
        types.append(TensorType(shapes.pop()))
    return types, ""


def _example(t: TensorType, batch: int, size: int, gen: torch.Generator) -> torch.Tensor:
    shape = [batch if i == 0 else size for i in range(t.rank)]
    return torch.randn([d if d != UNKNOWN_DIM else shape[i] for i, d in enumerate(t.shape)], generator=gen)


def type_without_inputs(
    gm: torch.fx.GraphModule, trace: Callable[[torch.fx.GraphModule, tuple[Any, ...]], Graph]
) -> tuple[Graph | None, str]:
    """The QAT model's IR with unknown sizes, or ``(None, why not)``. ``trace(gm, inputs)`` types
    the graph from one run (convert's typing run: fake quants pass their inputs through)."""
    types, why = input_types(gm)
    if types is None:
        return None, why
    gen = torch.Generator().manual_seed(0)
    graphs = []
    for batch, size in RUN_SIZES:
        inputs = tuple(_example(t, batch, size, gen) for t in types)
        try:
            graphs.append(trace(gm, inputs))
        except Exception as e:
            shapes = ", ".join(str(TensorType(tuple(x.shape))) for x in inputs)
            return None, (
                f"without example inputs the model was typed at the input sizes {shapes}, which it does not "
                f"run at ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            )
    try:
        _merge_into(graphs[0], graphs[1], types)
    except IRError as e:
        return None, f"without example inputs the model cannot be typed: {e}"
    from qir.ir.verifier import VerifyError, verify

    try:
        verify(graphs[0])
    except VerifyError as e:
        return None, f"without example inputs the model cannot be typed: {e}"
    return graphs[0], ""


def _merge_into(a: Graph, b: Graph, inputs: list[TensorType]) -> None:
    """Make ``a`` the merge of the two typings (same graph at two input sizes); raise :class:`IRError`
    naming the first value whose op or structure depends on the sizes."""
    if len(a.inputs) != len(b.inputs) or len(a) != len(b):
        raise IRError(f"the graph has {len(a)} nodes at one input size and {len(b)} at the other")
    declared = iter(inputs)
    for x, y in zip(a.inputs, b.inputs, strict=True):
        t = _merged(x.name, x.type, y.type)
        if isinstance(t, TensorType) and not x.has_default:
            t = _narrowed(t, next(declared))
        x.type = t
    for n, m in zip(a.nodes, b.nodes, strict=True):
        if n.name != m.name or not _same_op(n.op, m.op) or [v.name for v in n.operands] != [v.name for v in m.operands]:
            raise IRError(
                f"%{n.name} is {n.op.name}{_attrs(n.op)} at one input size and %{m.name} = "
                f"{m.op.name}{_attrs(m.op)} at the other (a size read from the input is built into the op)"
            )
    for n, m in zip(a.nodes, b.nodes, strict=True):
        n.type = _merged(n.name, n.type, m.type)


def _same_op(a: Any, b: Any) -> bool:
    return type(a) is type(b) and _same_value(a.attributes(), b.attributes())


def _same_value(x: Any, y: Any) -> bool:
    """Equal attribute values; tensors (which ``==`` compares element by element) by dtype, shape and data."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (
            isinstance(x, torch.Tensor)
            and isinstance(y, torch.Tensor)
            and x.dtype == y.dtype
            and x.shape == y.shape
            and bool(torch.equal(x, y))
        )
    if isinstance(x, (tuple, list)):
        return type(x) is type(y) and len(x) == len(y) and all(_same_value(p, q) for p, q in zip(x, y, strict=True))
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same_value(x[k], y[k]) for k in x)
    try:
        return bool(x == y)
    except (RuntimeError, TypeError, ValueError):
        return x is y


def _attrs(op: Any) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in op.attributes().items())
    return f"({text[:100]})"


def _merged(name: str, t: Type, u: Type) -> Type:
    try:
        return merge_types(t, u)
    except IRError as e:
        raise IRError(f"%{name}: {e}") from None


def _narrowed(t: TensorType, known: TensorType) -> TensorType:
    """``t`` with the sizes the reading layer knows (a conv input's channels)."""
    return t.with_shape(tuple(k if k != UNKNOWN_DIM else d for d, k in zip(t.shape, known.shape, strict=True)))
