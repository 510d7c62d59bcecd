"""``fuse_fx``: trace, absorb batch norms, fuse conv[+add][+relu], emit a GraphModule.

The model is deep-copied first (its tensors only where they survive fusion:
:mod:`qir.quantization.borrowed`), traced with qir's tracer, turned into IR, rewritten by the
``fuse`` pass (absorb-bn included) and emitted again. The emitted module keeps the user's
module tree:

* a fused conv that absorbed an add lives under the add's name: the FloatFunctional's
  path when the add was ``ff.add``, else a generated name (``_generated_add_0``, scoped to
  the module whose forward holds the add, see :mod:`qir.quantization.names`);
* a conv fused only with batch norm / activation stays at the conv's path;
* every module the fusion consumed (``conv``, ``bn``, ``relu``) becomes ``Identity()``;
* functional ``+`` / ``torch.add`` that did not fuse become generated FloatFunctionals.

A load_state_dict pre-hook on the root (:class:`StateDictRemap`) maps a float checkpoint's
original keys (``conv.weight``, ``bn.running_mean``...) onto the fused layout, folding the
batch norm the same way the pass did, so ``fused.load_state_dict(float_sd)`` just works.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import attrs
import torch
import torch.fx
from torch import nn

from passes.fuse import FUSABLE
from passes.rewrite import FusedFrom, fused_from
from qir.frontend.convert import MODULE_ORDER_KEY
from qir.frontend.emit import emit
from qir.frontend.lookup import stub_classes
from qir.ir.graph import Graph, Node
from qir.ir.op import ModuleOp, Ref
from qir.ir.ops.core import Call, Constant
from qir.ir.ops.elementwise import Add, BinaryOp, Div, Mul, Sub
from qir.ir.ops.misc import Einsum, Matmul
from qir.ir.ops.nn import ConvNd, ConvTransposeNd, Linear
from qir.ir.ops.qat import QATModuleOp
from qir.ir.ops.shape import Transpose
from qir.ir.types import ScalarType, SequenceType, TensorType, Type
from qir.quantization.borrowed import Borrowed, borrowing_copy
from qir.quantization.fx_trace import build_ir, trace_fx
from qir.quantization.names import NameAllocator
from qir.quantization.pipelines import (
    PipelineArg,
    builtin_only,
    resolve_pipeline,
    run_stage_pipeline,
    without_observers,
)
from qir.quantization.remap import KeyRemap, StateDictRemap

__all__ = [
    "FUSER_RECORD_KEY",
    "FuseRecord",
    "KeyRemap",
    "StateDictRemap",
    "FusedIR",
    "build_fused",
    "build_fused_ir",
    "emit_fused",
    "fuse_fx",
    "set_submodule_creating",
    "trace_fx",
]

#: ``GraphModule.meta`` key of the :class:`FuseRecord` (GraphModule deep copies keep ``meta``).
FUSER_RECORD_KEY = "qir.fuse_record"


@dataclass
class FuseRecord:
    """What fusion did, for prepare (qconfig lookup by original names) and checkpoints."""

    #: module path in the fused model -> original module paths it stands for (conv first)
    sources: dict[str, list[str]] = field(default_factory=dict)
    #: module path in the fused model -> original module type (the conv's for fused modules)
    source_types: dict[str, type] = field(default_factory=dict)
    #: generated FloatFunctional path -> the torch callable it replaced (operator.add, torch.cat...)
    generated: dict[str, Any] = field(default_factory=dict)
    #: ``.qconfig`` attributes of the original modules (path -> qconfig)
    qconfig_attrs: dict[str, Any] = field(default_factory=dict)
    remap: StateDictRemap = field(default_factory=StateDictRemap)
    #: fx node name -> (path, class name) of the user's module whose forward holds it ('' for the
    #: root), from the first trace (a re-prepared GraphModule's nodes all belong to its root)
    owners: dict[str, tuple[str, str]] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# functionals -> generated FloatFunctional modules

_TWO_TENSOR = {
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "div": "div",
    "maximum": "maximum",
    "minimum": "minimum",
    "matmul": "matmul",
}
_SCALAR = {"add": "add_scalar", "mul": "mul_scalar"}
_SEQUENCE = {"cat": "cat", "stack": "stack"}
_UNARY = {"mean": "mean", "sum": "sum"}

#: every FloatFunctional method prepare may generate
ALL_FUNCTIONALS = frozenset({*_TWO_TENSOR.values(), *_SCALAR.values(), *_SEQUENCE.values(), *_UNARY.values()})
#: what fuse_fx itself replaces (``+``: seed 001)
ADD_FUNCTIONALS = frozenset({"add", "add_scalar"})


def float_functional_class() -> type[nn.Module]:
    """qir's float FloatFunctional (generated modules are always qir's)."""
    try:
        from qir.nn.quantized import FloatFunctional
    except ImportError:  # the quantized package may not re-export it; the class lives here
        from qir.nn.modules import FloatFunctional
    return FloatFunctional


def computes_tensor(n: Node) -> bool:
    """Whether ``n`` yields a tensor from a tensor: Python arithmetic on sizes (``b * heads``,
    ``h // 2`` from ``x.shape``) yields exact ints and must never be quantized like a tensor."""
    return isinstance(n.type, TensorType) and any(isinstance(v.type, TensorType) for v in n.operands)


def ff_method_for(n: Node) -> str | None:
    """The FloatFunctional method computing node ``n``, or None (also for int shape arithmetic)."""
    if not computes_tensor(n):
        return None
    op = n.op
    name = op.name
    if isinstance(op, BinaryOp):
        if getattr(op, "rounding_mode", None) is not None:
            return None
        if op.other is None:
            if all(isinstance(v.type, TensorType) for v in n.operands):
                return _TWO_TENSOR.get(name)
            # ``x * (1.0 / w)``, ``q * (d ** -0.5)``: a tensor and a number computed at run time
            return _SCALAR.get(name) if run_time_scalar_operand(n) is not None else None
        if isinstance(op.other, (int, float)) and not isinstance(op.other, bool) and not isinstance(op.other, Ref):
            return _SCALAR.get(name)
        return None
    if name in _SEQUENCE:
        return _SEQUENCE[name]
    if name == "matmul" and len(n.operands) == 2:  # q @ k.transpose(-2, -1) in attention
        return _TWO_TENSOR[name]
    if name in _UNARY:
        attrs_ = op.attrs() if hasattr(op, "attrs") else {}
        if attrs_.get("dtype") is not None:
            return None
        return _UNARY[name]
    return None


def run_time_scalar_operand(n: Node) -> int | None:
    """The index of the run-time number operand of a two-operand node whose other operand is
    a tensor (``x * (1.0 / w)`` with ``w`` from ``x.shape``), else None."""
    if len(n.operands) != 2:
        return None
    kinds = [isinstance(v.type, TensorType) for v in n.operands]
    if kinds.count(True) != 1:
        return None
    i = kinds.index(False)
    t = n.operands[i].type
    return i if isinstance(t, ScalarType) and t.kind in ("int", "float") else None


def _torch_target(n: Node) -> Any:
    """The callable a generated FloatFunctional replaces (for ``module_type`` qconfig keys)."""
    funcs = getattr(type(n.op), "functions", ())
    return funcs[0] if funcs else n.op.name


#: parameter-free ops that compute new values (own output scale): a functional call becomes a
#: generated module of the op's module type, so prepare can swap it for its QAT class
MODULE_FUNCTIONALS = frozenset({"avg_pool2d", "adaptive_avg_pool2d"})


def built_from_sizes(g: Graph) -> set[str]:
    """Names of the tensors computed from sizes alone (``torch.arange(w)``, ``torch.zeros((b, 1, h, w))``
    and what is computed only from those): float values like a model input, never quantized
    by a generated module (a QuantStub quantizes them where the user puts one)."""
    built: set[str] = set()
    for n in g.nodes:
        module_call = isinstance(n.op, Call) and n.op.kind == "module"
        if not carries_tensors(n.type) or isinstance(n.op, Constant) or module_call or n.scope is not None:
            continue
        # a piece of a split / chunk of a traced tensor comes from that tensor, not from sizes
        if all(v.name in built or not carries_tensors(v.type) for v in n.operands):
            built.add(n.name)
    return built


def carries_tensors(t: Type) -> bool:
    """A tensor, or a tuple / list holding one (``x.split(c, 1)``)."""
    if isinstance(t, SequenceType):
        return any(carries_tensors(e) for e in t.elements)
    return isinstance(t, TensorType)


def _division_as_product(g: Graph, n: Node) -> bool:
    """Rewrite ``x / c`` (a tensor by a number, fixed or computed at run time: ``x / 2.0``,
    ``f / f.shape[-1]``) as ``x * (1 / c)`` in place, so it becomes a FloatFunctional
    ``mul_scalar``: a quantized tensor divided by a number has no other integer form."""
    op = n.op
    if not isinstance(op, Div) or op.rounding_mode is not None or op.reverse or not computes_tensor(n):
        return False
    if op.other is None:
        if run_time_scalar_operand(n) != 1:
            return False
        x, c = n.operands
        recip = g.create_node(Div(other=1.0, reverse=True), (c,), ScalarType("float"), g.unique_name(f"{n.name}_inv"))
        g.insert_node(recip, before=n)
        n.op = Mul()
        n.set_operands((x, recip))
        return True
    if isinstance(op.other, (int, float)) and not isinstance(op.other, bool) and op.other != 0:
        n.op = Mul(other=1.0 / float(op.other))
        return True
    return False


def _difference_as_sum(g: Graph, n: Node) -> bool:
    """Rewrite a tensor minus a number, or a number minus a tensor (``x - 0.5``, ``1 - z`` in a GRU's
    ``(1 - z) * h``, ``x - s`` with ``s`` computed at run time) in place as an ``add`` of the number
    and, for ``c - x``, a ``mul`` of ``x`` by -1 before it: they become FloatFunctional
    ``add_scalar`` / ``mul_scalar``, the only integer forms of arithmetic with a number."""
    op = n.op
    if not isinstance(op, Sub) or not computes_tensor(n):
        return False
    if op.other is not None:
        if isinstance(op.other, bool) or not isinstance(op.other, (int, float)):
            return False  # a Ref template (``x - y.size(1)``) stays as written
        if not op.reverse:
            n.op = Add(other=-float(op.other))
            return True
        (x,) = n.operands
        neg = g.create_node(Mul(other=-1.0), (x,), x.type, g.unique_name(f"{n.name}_neg"))
        g.insert_node(neg, before=n)
        n.op = Add(other=float(op.other))
        n.set_operands((neg,))
        return True
    i = run_time_scalar_operand(n)
    if i is None:
        return False
    a, b = n.operands
    kind = ScalarType("float") if i == 1 else b.type  # negate the subtrahend: the number or the tensor
    neg = g.create_node(Mul(other=-1.0), (b,), kind, g.unique_name(f"{n.name}_neg"))
    g.insert_node(neg, before=n)
    n.op = Add()
    n.set_operands((a, neg))
    return True


def _einsum_as_matmul(g: Graph, n: Node) -> bool:
    """Rewrite a batched-matmul ``torch.einsum`` (``"bhqd,bhkd->bhqk"``, ``"bhqk,bhkd->bhqd"``: same
    leading batch letters, one contracted letter) in place as ``matmul`` with the operands' last two
    dims transposed where the equation says, so attention written with einsum gets a FloatFunctional
    ``matmul``; other equations stay einsum (no integer form: convert refuses them)."""
    if not isinstance(n.op, Einsum) or len(n.operands) != 2 or not computes_tensor(n):
        return False
    eq = n.op.equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        return False
    lhs, out = eq.split("->")
    if lhs.count(",") != 1:
        return False
    a, b = lhs.split(",")
    if not (len(a) == len(b) == len(out) >= 2) or len(set(out)) != len(out) or a[:-2] != b[:-2] or a[:-2] != out[:-2]:
        return False
    i, k = out[-2], out[-1]
    contracted = set(a[-2:]) - {i}
    if len(contracted) != 1:
        return False
    (j,) = contracted
    if j in out or set(a[-2:]) != {i, j} or set(b[-2:]) != {j, k} or i == k:
        return False
    operands = []
    for v, want in ((n.operands[0], i + j), (n.operands[1], j + k)):
        if v.type is None or not isinstance(v.type, TensorType):
            return False
        if (a if v is n.operands[0] else b)[-2:] != want:  # stored the other way round: transpose it
            shape = (*v.type.shape[:-2], v.type.shape[-1], v.type.shape[-2])
            t = g.create_node(Transpose(dim0=-2, dim1=-1), (v,), v.type.with_shape(shape), g.unique_name(f"{n.name}_t"))
            g.insert_node(t, before=n)
            v = t
        operands.append(v)
    n.op = Matmul()
    n.set_operands(tuple(operands))
    return True


def _replace_functionals(
    g: Graph,
    owners: Mapping[str, str],
    methods: frozenset[str],
    alloc: NameAllocator,
    record: FuseRecord,
    quantized: set[str] | None = None,
) -> None:
    """Generated modules for the functional calls ``methods`` covers. With ``quantized`` (the
    names of the values computed on quantized tensors), only calls on at least one of them:
    float code after a DeQuantStub (post-processing, ``torch.stack`` of dequantized outputs)
    or before a QuantStub (``(x - mean) / std``) stays float, as written."""
    ff_cls = float_functional_class()
    built = built_from_sizes(g)

    def on_quantized(n: Node) -> bool:
        return quantized is None or any(v.name in quantized for v in n.operands)

    if "mul_scalar" in methods and "add_scalar" in methods:  # prepare's set; fuse_fx keeps ``-`` as written
        for n in list(g.nodes):
            if n.scope is None and not isinstance(n.op, (Call, Constant)) and n.name not in built and on_quantized(n):
                if (_difference_as_sum(g, n) or _einsum_as_matmul(g, n)) and quantized is not None:
                    quantized.update(v.name for v in n.operands if isinstance(v.type, TensorType))
    for n in list(g.nodes):
        if n.scope is not None or isinstance(n.op, (Call, Constant)) or n.name in built or not on_quantized(n):
            continue
        if "mul_scalar" in methods:
            _division_as_product(g, n)
        if (
            methods is ALL_FUNCTIONALS
            and n.op.name in MODULE_FUNCTIONALS
            and isinstance(n.op, ModuleOp)
            and not n.op.param_roles()
        ):
            path = alloc.new(owners.get(n.name, ""), n.op.name)
            n.scope = path  # emit builds op.to_module() there
            record.generated[path] = _torch_target(n)
            record.sources[path] = [path]
            continue
        method = ff_method_for(n)
        if method is None or method not in methods or not hasattr(ff_cls, method):
            continue
        if method in _SCALAR.values() and run_time_scalar_operand(n) == 0:
            # ``s * x``: the FloatFunctional takes the tensor first (add and mul commute)
            n.set_operands((n.operands[1], n.operands[0]))
        path = alloc.new(owners.get(n.name, ""), method.removesuffix("_scalar"))
        n.scope = path
        n.meta["float_functional"] = method
        g.objects[f"module:{path}"] = ff_cls()
        record.generated[path] = _torch_target(n)
        record.sources[path] = [path]


# ---------------------------------------------------------------------------------------------
# fused modules: names, constants, remaps


def _rekey(node: Node, new_key: str, renames: dict[str, str]) -> None:
    """Point constant ``node`` at ``new_key``; ``renames`` collects old -> new for :func:`_apply_renames`."""
    op = node.op
    assert isinstance(op, Constant)
    if op.key != new_key:
        renames[op.key] = new_key
        node.op = attrs.evolve(op, key=new_key)


def _apply_renames(g: Graph, renames: Mapping[str, str]) -> None:
    """Re-key ``g.constants`` once for all renames, keeping its order (the state dict's order).

    One rebuild, not one per constant: per-constant rebuilds made fusion quadratic in model size."""
    if not renames:
        return
    targets = set(renames.values())
    clash = next((k for k in g.constants if k in targets and k not in renames), None)
    if clash is not None:
        raise RuntimeError(f"fusion would move a tensor onto the existing key {clash!r}")
    g.constants = {renames.get(k, k): t for k, t in g.constants.items()}


def _place_fused(
    g: Graph,
    owners: Mapping[str, str],
    alloc: NameAllocator,
    record: FuseRecord,
    module_types: Mapping[str, type],
    ff_users: Mapping[str, int],
) -> set[str]:
    """Name each fused conv's module, re-key its tensors under it, record remaps.

    Returns the original module paths the fusion consumed (they become Identity)."""
    consumed: set[str] = set()
    renames: dict[str, str] = {}
    remapped: set[tuple[str, str]] = set()
    rekeyed: set[str] = set()
    for n in g.nodes:
        if not isinstance(n.op, FUSABLE):
            continue
        fused = fused_from(n)
        if not fused or n.scope is None:
            continue
        conv_path = n.scope
        add: FusedFrom | None = next((f for f in fused if f.role == "add"), None)
        bn = next((f for f in fused if f.role == "bn"), None)
        path = conv_path
        if add is not None:
            if add.scope is not None and ff_users.get(add.scope, 0) == 1:
                path = add.scope  # the user's FloatFunctional slot takes the fused module
                g.objects.pop(f"module:{add.scope}", None)
            else:
                path = alloc.new(owners.get(add.node, ""), "add")
        is_fused_module = bool(n.op.add or n.op.act is not None)  # type: ignore[attr-defined]
        new_prefix = f"{path}.conv." if is_fused_module else f"{path}."
        for role_index, role in enumerate(n.op.param_roles()):  # type: ignore[attr-defined]
            c = n.operands[1 + role_index]
            # a weight shared by call sites that fused into different modules (one conv + BN
            # called twice, once before a ReLU and once before an add) keeps the first site's
            # key; the other module holds the same tensor (and the remap copies it there)
            if isinstance(c, Node) and isinstance(c.op, Constant) and c.name not in rekeyed:
                rekeyed.add(c.name)
                _rekey(c, new_prefix + role, renames)
        n.scope = path
        if (conv_path, new_prefix) not in remapped:  # a module called at several places: one remap
            remapped.add((conv_path, new_prefix))
            record.remap.remaps.append(
                KeyRemap(
                    conv_prefix=f"{conv_path}.",
                    new_prefix=new_prefix,
                    conv_op=n.op,
                    bn_prefix=f"{bn.scope}." if bn is not None and bn.scope else None,
                    bn_eps=_bn_eps(n, bn),
                )
            )
        sources = [conv_path] + [f.scope for f in fused if f.scope and f.scope != path]
        record.sources[path] = list(dict.fromkeys(sources))
        if conv_path in module_types:
            record.source_types[path] = module_types[conv_path]
        consumed.update(s for s in sources if s != path)
    _apply_renames(g, renames)
    return consumed


def _bn_eps(n: Node, bn: FusedFrom | None) -> float:
    eps = n.meta.get("qir.bn_eps", {})
    return float(eps.get(bn.node, 1e-5)) if bn is not None and isinstance(eps, dict) else 1e-5


def _note_bn_eps(g: Graph) -> None:
    """Remember every batch norm's eps by node name (the remap hook folds with it)."""
    eps = {n.name: n.op.eps for n in g.nodes if n.op.name == "batch_norm"}  # type: ignore[attr-defined]
    for n in g.nodes:
        if isinstance(n.op, (ConvNd, ConvTransposeNd, Linear)):
            n.meta["qir.bn_eps"] = eps


# ---------------------------------------------------------------------------------------------
# the module tree


def set_submodule_creating(root: nn.Module, path: str, module: nn.Module) -> None:
    """``root.<path> = module``, creating empty parent modules ``root`` does not have."""
    parent_path, _, leaf = path.rpartition(".")
    parent = root
    for part in parent_path.split(".") if parent_path else []:
        child = parent._modules.get(part)
        if child is None:
            child = nn.Module()
            parent._modules[part] = child
        parent = child
    parent._modules[leaf] = module


def _has_path(root: nn.Module, path: str) -> bool:
    m: nn.Module | None = root
    for part in path.split("."):
        m = m._modules.get(part) if m is not None else None
        if m is None:
            return False
    return True


def _reorder(root: nn.Module, order: Sequence[str]) -> None:
    """Children of every container in the original model's order, generated ones last."""
    rank = {p: i for i, p in enumerate(order)}
    for path, m in list(root.named_modules()):
        if not m._modules:
            continue
        prefix = f"{path}." if path else ""
        items = list(m._modules.items())
        items.sort(key=lambda kv: rank.get(prefix + kv[0], len(rank)))
        m._modules.clear()
        m._modules.update(items)


# ---------------------------------------------------------------------------------------------
# driver


@dataclass
class FusedIR:
    """The fused float IR of a copy of a model, before emission (:func:`build_fused_ir`)."""

    graph: Graph
    record: FuseRecord
    #: the deep copy the graph was traced from (its module tree decides what stays as Identity)
    root: nn.Module
    #: original module paths fusion consumed (they become Identity)
    consumed: set[str]
    class_name: str
    training: bool
    #: the tensors of the user's model ``root`` still holds (:mod:`qir.quantization.borrowed`; None:
    #: none): the graph holds none, and a module of ``root`` goes into a model only once owned
    borrowed: Borrowed | None = None


def build_fused(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    functionals: frozenset[str] = ADD_FUNCTIONALS,
    prepare_objects: Callable[[Graph], None] | None = None,
    keep_whole: frozenset[str] = frozenset(),
    pipeline: PipelineArg | None = None,
    quantized_values: Callable[[Graph], set[str]] | None = None,
) -> tuple[torch.fx.GraphModule, FuseRecord]:
    """The fused float GraphModule of a deep copy of ``model``, and what fusion did.

    ``functionals`` are the FloatFunctional methods whose functional spellings become
    generated modules; ``prepare_objects`` may swap opaque module objects in the IR
    (prepare turns torch's stubs into qir's) before emission. Modules at the paths in
    ``keep_whole`` (hybrid CPU modules) stay one opaque call each: never fused, kept as they are.
    ``pipeline`` replaces the prepare stage's IR pipeline (:func:`default_pipeline`; its
    ``insert-observers`` passes are skipped: fusion emits a float model).
    ``quantized_values(g)`` names the values computed on quantized tensors: only functional calls
    on them become generated modules (all calls when it is None).
    """
    fused = build_fused_ir(
        model,
        example_inputs,
        functionals=functionals,
        prepare_objects=prepare_objects,
        keep_whole=keep_whole,
        pipeline=pipeline,
        quantized_values=quantized_values,
    )
    return emit_fused(fused), fused.record


def build_fused_ir(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    functionals: frozenset[str] = ADD_FUNCTIONALS,
    prepare_objects: Callable[[Graph], None] | None = None,
    keep_whole: frozenset[str] = frozenset(),
    pipeline: PipelineArg | None = None,
    quantized_values: Callable[[Graph], set[str]] | None = None,
) -> FusedIR:
    """:func:`build_fused` up to emission: the fused IR with its module paths placed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    root, borrowed = borrowing_copy(model)
    record = FuseRecord()
    prior = root.meta.get(FUSER_RECORD_KEY) if isinstance(root, torch.fx.GraphModule) else None
    if isinstance(prior, FuseRecord):  # fusing an already-fused model: keep its history
        record = copy.deepcopy(prior)
    module_types = {p: type(m) for p, m in root.named_modules()}
    stubs = stub_classes()
    for p, m in root.named_modules():
        qc = getattr(m, "qconfig", None)
        # ``m.qconfig = None`` keeps the module and what it holds float, as torch's propagate_qconfig_
        # reads it; a stub's constructor sets None, which inherits
        if qc is not None or ("qconfig" in m.__dict__ and not isinstance(m, stubs)):
            record.qconfig_attrs.setdefault(p, qc)
    # the typing run (when shape formulas do not cover the graph) computes with the copy's tensors
    before_run = None if borrowed is None else (lambda: borrowed.own_module(root))
    g, owners = build_ir(root, example_inputs, keep_whole, before_run=before_run)
    for name, path in owners.items():
        if path and name not in record.owners:
            record.owners[name] = (path, module_types[path].__name__ if path in module_types else "")
    _note_bn_eps(g)
    passes_ = without_observers(resolve_pipeline("prepare", pipeline))
    if borrowed is not None and not builtin_only(passes_):  # a user's pass might write into a constant
        borrowed.own_module(root)
        borrowed.own_graph(g)
    # rank-only types (no example inputs) are not real shapes: skip the type verifier then
    # in place: g is this call's own graph
    g = run_stage_pipeline(g, passes_, "prepare", typed=example_inputs is not None, inplace=True).graph
    alloc = NameAllocator(p for p, _ in root.named_modules())
    ff_users: dict[str, int] = {}
    for n in g.nodes:
        if n.scope is not None and n.meta.get("float_functional"):
            ff_users[n.scope] = ff_users.get(n.scope, 0) + 1
    for n in g.nodes:  # an FF whose add fused is still counted once
        for f in fused_from(n):
            if f.role == "add" and f.scope:
                ff_users[f.scope] = ff_users.get(f.scope, 0) + 1
    consumed = _place_fused(g, owners, alloc, record, module_types, ff_users)
    quantized = quantized_values(g) if quantized_values is not None else None
    _replace_functionals(g, owners, functionals, alloc, record, quantized)
    if prepare_objects is not None:
        prepare_objects(g)
    if borrowed is not None:
        borrowed.check_untouched()
        borrowed.own_graph(g)
    return FusedIR(g, record, root, consumed, type(model).__name__, model.training, borrowed)


def emit_fused(fused: FusedIR, graph: Graph | None = None) -> torch.fx.GraphModule:
    """The GraphModule of ``graph`` (default: the fused graph; prepare passes the graph with
    QAT ops): the module tree in the source model's order, fused-away modules as Identity."""
    g = fused.graph if graph is None else graph
    root = fused.root
    gm = emit(g, class_name=fused.class_name)
    order: Sequence[str] = g.objects.get(MODULE_ORDER_KEY, ())
    # a QAT layer replaces its float module whole (a fused ConvReLU2d's conv and relu children go)
    qat = {f"{n.scope}." for n in g.nodes if n.scope and isinstance(n.op, QATModuleOp)}

    def replaced(path: str) -> bool:
        return any(p in qat for p in _prefixes_of(path))

    for path in fused.consumed:
        if path and not _has_path(gm, path) and not replaced(path):
            set_submodule_creating(gm, path, nn.Identity())
    for path in order:  # modules the graph no longer calls (fused away, unused) stay as Identity
        if path and not _has_path(gm, path) and not root.get_submodule(path)._modules and not replaced(path):
            set_submodule_creating(gm, path, nn.Identity())
    # inside a QAT layer its own children's order holds (a torch FloatFunctional's Identity
    # activation_post_process must not move ahead of the ConvAdd's weight_fake_quant replacing it)
    _reorder(gm, [p for p in order if not replaced(p)])
    # no recompile: emit compiled the graph, and the modules added or reordered here are not in its code
    gm.training = fused.training
    gm.meta[FUSER_RECORD_KEY] = fused.record
    gm.register_load_state_dict_pre_hook(fused.record.remap)
    return gm


def _prefixes_of(path: str) -> list[str]:
    """``"a.b.c"`` -> ``["a.", "a.b."]``: the paths of its ancestors, each with a trailing dot."""
    parts = path.split(".")
    return [".".join(parts[:i]) + "." for i in range(1, len(parts))]


def fuse_fx(model: nn.Module, example_inputs: Any = None, pipeline: PipelineArg | None = None) -> torch.fx.GraphModule:
    """Fuse conv[+bn][+add][+relu/relu6] of a deep copy of ``model`` into qir.nn.intrinsic modules.

    The input is never modified. ``example_inputs`` is optional: without it the graph is
    typed by rank only (an add fuses when its operands have the same rank). Float
    checkpoints load into the result by their original keys (batch norms folded on load).
    ``pipeline`` replaces the IR pipeline (default ``default_pipeline("prepare")``).
    """
    gm, _ = build_fused(model, example_inputs, pipeline=pipeline)
    return gm
