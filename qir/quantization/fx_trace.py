"""fx tracing for the flows: ``trace_fx`` (qir's tracer) and ``build_ir`` (fx graph -> typed IR).

``build_ir`` also records, per node, the qualified name of the module whose forward holds
it (fx's ``nn_module_stack``): generated modules are named in that scope. Each IR node also
carries its owner in ``node.meta[OWNER_KEY]`` (rewrites that run after the passes, such as
prepare's functional swap, read it there). Without example inputs the graph is typed by
rank only (:class:`_RankOnly`).
"""

from __future__ import annotations

import copy
import operator
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx
from torch import nn

from qir.frontend.convert import _Converter, propagate
from qir.frontend.sequences import bind_example_inputs, carry_lengths, input_sequences
from qir.frontend.tracer import (
    QirTracer,
    TraceError,
    functionalize_inplace,
    measure_pieces,
    patch_float_functional,
    patch_len,
    placeholders_first,
    static_piece_count,
    trace_error,
)
from qir.ir.graph import Graph
from qir.quantization.fx_shapes import shape_values
from qir.quantization.names import owner_of_stack

__all__ = ["OWNER_KEY", "build_ir", "trace_fx"]

#: IR ``node.meta`` key of the qualified name of the module whose forward holds the node.
OWNER_KEY = "qir.owner"


def trace_fx(root: nn.Module, leaves: frozenset[str] = frozenset(), example_inputs: Any = None) -> torch.fx.Graph:
    """fx-trace ``root`` with qir's tracer (stubs, FloatFunctional calls, qir modules and the
    module paths in ``leaves`` as leaves). An input whose example is a list or tuple is traced as
    one of that length (the graph is specialised to it, as to every other Python value); a
    ``chunk(n)`` unpacked into pieces gets as many as torch returns on the examples (fewer than n
    when the size is small for n), measured by a run and a retrace."""
    sequences = input_sequences(bind_example_inputs(root, example_inputs))
    counts: dict[str, int] = {}
    while True:
        tracer = QirTracer(leaves, sequences)
        tracer.piece_counts.update(counts)
        graph = _trace_once(tracer, root, example_inputs)
        if example_inputs is None or not tracer.assumed_pieces:
            return graph
        args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
        measured = measure_pieces(root, graph, args, tracer.assumed_pieces)
        assumed = {n.name: static_piece_count(n) for n in graph.nodes if n.name in tracer.assumed_pieces}
        wrong = {k: v for k, v in measured.items() if assumed.get(k) != v}
        if not wrong:
            return graph
        counts.update(wrong)  # each round fixes at least one chunk: this ends


def _trace_once(tracer: QirTracer, root: nn.Module, example_inputs: Any) -> torch.fx.Graph:
    try:
        with patch_float_functional(tracer), patch_len(root):
            graph = tracer.trace(root)
        placeholders_first(graph)
        carry_lengths(root, graph)
        functionalize_inplace(graph, root)
        return graph
    except TraceError:
        raise
    except Exception as e:
        err = trace_error(tracer, root, e)
        if example_inputs is None and _LIST_INPUT_SYMPTOMS.search(str(e)):
            err = TraceError(
                f"{err}\nIf a model input is a list or tuple of tensors (FPN levels checked with "
                "`assert len(feats) == n` or iterated), pass example_inputs=(feats, ...) to prepare_qat_fx / "
                "fuse_fx: its length is then known while tracing."
            )
        elif _NUMBER_OF_SIZE_SYMPTOMS.search(str(e)):
            err = TraceError(
                f"{err}\nint() or float() of a traced value has no number to return while tracing. For sizes "
                "(x.shape[i], x.size(i)), which trace as exact integers, keep the arithmetic integer: write "
                "`w.shape[0] // (H * W // ws // ws)` instead of `int(w.shape[0] / (H * W / ws / ws))`."
            )
        raise err from e


#: how `int(size / n)` / `float(size)` fails on a traced size
_NUMBER_OF_SIZE_SYMPTOMS = re.compile(r"(int|float)\(\) argument must be .*Proxy'")

#: how fx fails on `len(x)`, `assert ... x ...`, `for f in x` with x a traced input
_LIST_INPUT_SYMPTOMS = re.compile(r"control flow|cannot be iterated|'len' is not supported|Proxy object")


def _meta_like(rank: int) -> torch.Tensor:
    return torch.empty((1,) * rank, device="meta")


def _first_tensor(args: Any) -> torch.Tensor | None:
    found: list[torch.Tensor] = []
    torch.fx.node.map_aggregate(args, lambda a: found.append(a) if isinstance(a, torch.Tensor) else None)
    return found[0] if found else None


class _RankOnly(torch.fx.Interpreter):
    """Types a graph without example inputs: every tensor is a meta tensor of size-1 dims.

    Only ranks are meaningful: a conv/linear module's output has its weight's rank (2 for
    linear), other modules keep their input's, torch functions run on the meta tensors
    (falling back to their first input's value when they cannot). A model input's rank is
    guessed (4, or the rank of what it is added to; see :func:`_rank_only_values`). Enough
    for the fusion legality checks (same-rank add operands, batch norm on axis 1).
    """

    def __init__(self, gm: torch.fx.GraphModule, input_ranks: Mapping[str, int]) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}
        self.input_ranks = input_ranks

    def run_node(self, n: torch.fx.Node) -> Any:
        out = self._value(n)
        self.values[n.name] = out
        return out

    def _value(self, n: torch.fx.Node) -> Any:
        if n.op == "placeholder":
            return n.args[0] if n.args else _meta_like(self.input_ranks.get(n.name, 4))
        if n.op == "output":
            return None
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if n.op == "get_attr":
            obj = self.fetch_attr(str(n.target))
            return obj.to("meta") if isinstance(obj, torch.Tensor) else obj
        if n.op == "call_module":
            m = self.module.get_submodule(str(n.target))
            first = _first_tensor((args, kwargs))
            if isinstance(m, nn.Linear) and first is not None and first.dim() == 3:
                # a Linear maps the last dim: tokens (B, N, C) stay rank 3 (a transformer's q / kv / proj);
                # other ranks keep the guess of 2 (a model input's rank is guessed as 4, and a classifier
                # on it is (B, C))
                return _meta_like(3)
            rank = _weighted_rank(m)
            if rank is not None:
                return _meta_like(rank)
            return first if first is not None else _meta_like(4)
        try:
            return getattr(self, n.op)(n.target, args, kwargs)
        except Exception:  # shapes are invented here: keep the first input's value
            rank = _reshape_rank(n, args)
            if rank is not None:  # x.reshape(b, -1, h // 2, w // 2): 1 // 2 = 0 on invented sizes
                return _meta_like(rank)
            first = _first_tensor((args, kwargs))
            if first is None and _all_numbers((args, kwargs)):
                # arithmetic on invented sizes (1 // 2 = 0, then 0 ** -0.5): still a number, not a tensor
                return _number_like(n.target, (args, kwargs))
            return first if first is not None else _meta_like(4)


def _reshape_rank(n: torch.fx.Node, args: Any) -> int | None:
    """The rank a ``reshape`` / ``view`` call asks for (its size arguments), or None for another call."""
    is_method = n.op == "call_method" and n.target in ("reshape", "view")
    is_function = n.op == "call_function" and n.target is torch.reshape
    if not (is_method or is_function) or len(args) < 2:
        return None
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
    return len(sizes) if all(isinstance(d, int) for d in sizes) else None


def _all_numbers(args: Any) -> bool:
    leaves: list[Any] = []
    torch.fx.node.map_aggregate(args, leaves.append)
    numbers = [a for a in leaves if a is not None]
    return bool(numbers) and all(isinstance(a, (int, float)) for a in numbers)


def _number_like(target: Any, args: Any) -> int | float:
    """A stand-in for the number ``target(*args)`` would give on real sizes: a float for true division,
    a power and anything with a float operand, else an int."""
    leaves: list[Any] = []
    torch.fx.node.map_aggregate(args, leaves.append)
    floating = target in (operator.truediv, operator.pow) or any(isinstance(a, float) for a in leaves)
    return 1.0 if floating else 1


_WEIGHTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _weighted_rank(m: nn.Module) -> int | None:
    """Output rank of a conv (its weight's rank) or linear (2; 3 on (B, N, C) tokens, see
    ``_RankOnly._value``) module, else None."""
    w = getattr(m, "weight", None)
    if isinstance(m, _WEIGHTED) and isinstance(w, torch.Tensor):
        return w.dim()
    if isinstance(m, nn.Linear):
        return 2
    return None


def _add_operands(n: torch.fx.Node) -> list[torch.fx.Node]:
    """The two tensor operands of an add node (``+``, torch.add, Tensor.add, ff.add), else []."""
    args = list(n.args)
    if (
        n.op == "call_method"
        and n.target == "add"
        and args
        and isinstance(args[0], torch.fx.Node)
        and args[0].op == "get_attr"
    ):
        args = args[1:]
    is_add = (n.op == "call_function" and n.target in (operator.add, torch.add)) or (
        n.op == "call_method" and n.target == "add"
    )
    ops = [a for a in args[:2] if isinstance(a, torch.fx.Node)]
    return ops if is_add and len(ops) == 2 else []


def _input_behind(gm: torch.fx.GraphModule, n: torch.fx.Node) -> torch.fx.Node | None:
    """The model input ``n`` is computed from through non-weighted single-input steps, if any."""
    while n.op != "placeholder":
        if n.op == "call_module" and _weighted_rank(gm.get_submodule(str(n.target))) is not None:
            return None
        srcs = [a for a in n.all_input_nodes if a.op != "get_attr"]
        if not srcs:
            return None
        n = srcs[0]
    return n


def _rank_only_values(root: nn.Module, fx_graph: torch.fx.Graph) -> dict[str, Any]:
    gm = torch.fx.GraphModule(root, copy.deepcopy(fx_graph))
    ranks: dict[str, int] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for _ in range(len(placeholders) + 1):  # each round fixes at least one input's rank
        interp = _RankOnly(gm, ranks)
        with torch.no_grad():
            interp.run(*[None for _ in placeholders])
        changed = False
        for n in gm.graph.nodes:
            ops = _add_operands(n)
            if not ops:
                continue
            a, b = (interp.values.get(o.name) for o in ops)
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() == b.dim():
                continue
            for this, other in ((ops[0], b), (ops[1], a)):
                src = _input_behind(gm, this)
                if src is not None and src.name not in ranks:
                    ranks[src.name] = other.dim()
                    changed = True
                    break
        if not changed:
            return interp.values
    return interp.values


def _values(
    root: nn.Module, fx_graph: torch.fx.Graph, example_inputs: Any, before_run: Callable[[], None] | None = None
) -> dict[str, Any]:
    """fx node name -> a value typing it: a real run on ``example_inputs`` (``before_run()`` first),
    else rank-only."""
    if example_inputs is None:
        return _rank_only_values(root, fx_graph)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    # only shapes and dtypes type the IR: formulas give them without running the layers
    shapes = shape_values(root, fx_graph, tuple(example_inputs))
    if shapes is not None:
        return shapes
    if before_run is not None:
        before_run()
    return propagate(root, fx_graph, tuple(example_inputs))


def build_ir(
    root: nn.Module,
    example_inputs: Any = None,
    keep_whole: frozenset[str] = frozenset(),
    before_run: Callable[[], None] | None = None,
) -> tuple[Graph, dict[str, str]]:
    """IR of ``root`` plus, per node name, the qualified name of the module owning it.

    Modules at the paths in ``keep_whole`` are traced as one opaque call each (hybrid CPU modules).
    ``before_run`` is called before the graph runs on real tensors to be typed, if it does."""
    fx_graph = trace_fx(root, keep_whole, example_inputs)
    owners = {
        n.name: owner_of_stack(n.meta.get("nn_module_stack"), is_module_call=n.op == "call_module")
        for n in fx_graph.nodes
    }
    values = _values(root, fx_graph, example_inputs, before_run)
    g = _Converter(root, values, keep_whole).run(fx_graph)
    for n in g.nodes:
        n.meta[OWNER_KEY] = owners.get(n.name, "")
    return g, owners
