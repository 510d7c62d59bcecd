"""What the legality pass knows about one IR node, in the operator tables' vocabulary.

Three questions per node, answered from the node's op class, operands, types and (for
opaque module calls) the module object the graph keeps:

* :func:`skip_reason` - is it compute at all? Constants, attribute reads, element reads
  of a sequence, results that are not tensors, and value-preserving transparent nodes
  (identity, eval-mode dropout: "optimized out during deployment") are not checked.
* :func:`subject_of` - what was called: the op (rebuilt from the module for an opaque
  call such as a fused ``ConvAddReLU2d`` or a QAT module; from a registered function view
  for a converted model's integer form such as ``abs_codes``), how it was called (module,
  function/method, FloatFunctional) and the exact torch spelling when the graph tells it.
* :func:`build_facts` - the facts dict the rules read (``backends.common.rules.FIELDS``;
  names listed in docs/operators.md). Float models get the dtype each value *would* have
  once quantized (:class:`Domains`).

Nothing here names a backend or an operator table row: :func:`rows_for` narrows the rows
a table returns for the op's IR name by the node's spelling and form.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from qir.ir.graph import Graph, Node, Value
from qir.ir.op import OP_REGISTRY, ModuleOp, Op, Transparent, registry_version, resolve
from qir.ir.ops.attention import MultiheadAttention
from qir.ir.ops.core import Call, Constant, GetAttr, GetItem
from qir.ir.ops.elementwise import Add, BinaryOp, Relu, Relu6
from qir.ir.ops.integer import IntegerModuleOp
from qir.ir.ops.nn import BatchNorm, ConvNd, ConvTransposeNd, Linear, WeightedOp
from qir.ir.ops.norm import LayerNorm
from qir.ir.ops.pool import AdaptivePool, AvgPoolNd, MaxPoolNd
from qir.ir.ops.qat import QATModuleOp
from qir.ir.ops.reduce import Argmax, Argmin, Max, Reduction
from qir.ir.ops.shape import Permute, Transpose
from qir.ir.ops.vision import GridSample, Interpolate, Pad
from qir.ir.types import DType, ObjectType, SequenceType, TensorType, Type

#: The section id the tables give rows spelled as ``torch.nn`` module classes.
MODULE_SECTION = "torch_nn_module"
#: How a node was called.
FORM_MODULE, FORM_FUNCTION, FORM_FLOAT_FUNCTIONAL, FORM_OPAQUE = "module", "function", "float_functional", "opaque"
#: ``node.meta`` key a front end may set to the exact torch spelling of the call.
SPELLING_META = "torch_spelling"

_ITEM_BYTES = {"qint8": 1, "qint16": 2, "qint32": 4, "qbool": 1, "float32": 4}
_INT_AS_QUANT = {
    DType.int8: "qint8",
    DType.int16: "qint16",
    DType.int32: "qint32",
    DType.int64: "qint32",
    DType.bool: "qbool",
    DType.uint8: "qint8",
}


# ----------------------------------------------------------------------------- spellings


def _public_names(cls: type) -> list[str]:
    """``module.qualname`` of ``cls`` and of every parent package that re-exports it
    (``qir.quantization.stubs.QuantStub`` is also ``qir.quantization.QuantStub``)."""
    mod = getattr(cls, "__module__", "") or ""
    name = cls.__qualname__
    names = [f"{mod}.{name}"]
    parts = mod.split(".")
    for i in range(len(parts) - 1, 0, -1):
        pkg = sys.modules.get(".".join(parts[:i]))
        if pkg is not None and getattr(pkg, cls.__name__, None) is cls:
            names.append(f"{'.'.join(parts[:i])}.{cls.__name__}")
    return names


def class_spellings(cls: type) -> list[str]:
    """Spellings a module class may have in a table: its torch name (``torch.nn.Conv2d``,
    ``torch.quantization.QuantStub`` for torch.ao's stub) and its public qualified names."""
    out: list[str] = []
    spaces: list[tuple[str, Any]] = [("torch.nn", nn), ("torch.quantization", torch.ao.quantization)]
    for mod_name in ("torchvision.ops", "torchvision.models.detection.rpn"):
        mod = sys.modules.get(mod_name)  # only when the user already imported torchvision
        if mod is not None:
            spaces.append((mod_name, mod))
    for prefix, space in spaces:
        if getattr(space, cls.__name__, None) is cls:
            out.append(f"{prefix}.{cls.__name__}")
    public = _public_names(cls)
    # qir's public paths mirror torch's (qir.quantization.DeQuantStub ~ torch.quantization.DeQuantStub)
    mirrored = ["torch" + n[3:] for n in public if n.startswith("qir.")]
    return out + public + mirrored


def _module_lineage(cls: type) -> list[type]:
    """``cls``, its bases, and the float class a QAT/quantized class names in ``_FLOAT_MODULE``."""
    seen: list[type] = []
    for c in cls.__mro__:
        if c in (nn.Module, object):
            break
        seen.append(c)
    float_cls = getattr(cls, "_FLOAT_MODULE", None)
    if isinstance(float_cls, type) and float_cls not in seen:
        seen.extend(_module_lineage(float_cls))
    return seen


@attrs.frozen
class _TableIndex:
    """Lookups :func:`row_for_module_class` needs besides ``table.get``, built once per table."""

    #: eager replacement name -> the one row it replaces (names replacing several rows,
    #: like FloatFunctional, say nothing about a single call and are left out)
    replacements: dict[str, Any]
    #: lowercased spelling -> row: the source spells some classes differently from torch
    #: (``torch.nn.HardSigmoid`` for ``torch.nn.Hardsigmoid``)
    folded: dict[str, Any]


_INDEXES: dict[int, tuple[Any, _TableIndex]] = {}


def _index(table: Any) -> _TableIndex:
    hit = _INDEXES.get(id(table))
    if hit is not None and hit[0] is table:
        return hit[1]
    repl: dict[str, list[Any]] = {}
    folded: dict[str, Any] = {}
    for entry in table:
        for name in getattr(entry, "eager_replacement", ()):
            repl.setdefault(name, []).append(entry)
        folded.setdefault(entry.spelling.lower(), entry)
    index = _TableIndex({k: v[0] for k, v in repl.items() if len(v) == 1}, folded)
    _INDEXES[id(table)] = (table, index)  # the table is kept alive with its index, so ids stay unique
    return index


def row_for_module_class(table: Any, cls: type) -> Any | None:
    """The table row of a module class: by its own spelling (case-insensitively), a base
    class's, or as the eager replacement of exactly one row (``qir.quantization.QuantStub``)."""
    index = _index(table)
    for c in _module_lineage(cls):
        for s in class_spellings(c):
            entry = table.get(s) or index.replacements.get(s) or index.folded.get(s.lower())
            if entry is not None:
                return entry
    return None


# ----------------------------------------------------------------------------- subjects


@attrs.frozen
class Params:
    """Weight / bias types of a weighted node (from operands, or from the module object)."""

    weight: TensorType | None = None
    bias: TensorType | None = None


@attrs.frozen(eq=False)
class Subject:
    """One node as the legality pass sees it.

    ``op`` is the node's op, or for an opaque module call the op rebuilt from the module
    (None when no registered op describes it). ``inputs`` are the data operands (not the
    weights), ``addend`` the fused add operand of a conv.
    """

    node: Node
    op: Op | None
    form: str
    spelling: str | None
    inputs: tuple[Value, ...]
    params: Params
    addend: Value | None = None
    #: The module class the row is looked up by (opaque module calls).
    row_class: type | None = None

    @property
    def scope(self) -> str | None:
        return self.node.scope

    @property
    def ir_name(self) -> str:
        return self.op.name if self.op is not None else self.node.op.name


_BY_MODULE: tuple[int, dict[type, type[ModuleOp]]] = (-1, {})


def _module_op_classes() -> dict[type, type[ModuleOp]]:
    """Module class -> the registered op built from it (rebuilt when the registry grows)."""
    global _BY_MODULE
    if _BY_MODULE[0] != registry_version():
        out: dict[type, type[ModuleOp]] = {}
        for cls in OP_REGISTRY.values():
            if issubclass(cls, ModuleOp):
                for t in cls.module_types:
                    out.setdefault(t, cls)
        _BY_MODULE = (registry_version(), out)
    return _BY_MODULE[1]


def _tensor_type(t: Any) -> TensorType | None:
    if not isinstance(t, torch.Tensor):
        return None
    if t.is_quantized:  # torch's own quantized tensors
        dtype = {torch.qint32: DType.qint32}.get(t.dtype, DType.qint8)
        return TensorType(tuple(t.shape), dtype)
    try:
        return TensorType(tuple(t.shape), DType.from_torch(t.dtype))
    except ValueError:  # a dtype the IR has no name for: its dtype facts stay unknown
        return None


#: Functions mapping a module the tables do not name (a QAT or integer module) to the float
#: module or module class it stands for, or None. The layers that define such modules
#: register one (qir.quantization.check does for qir.nn.qat / qir.nn.quantized).
ModuleView = Callable[[nn.Module], "nn.Module | type | Op | None"]
_MODULE_VIEWS: list[ModuleView] = []


def register_module_view(view: ModuleView) -> ModuleView:
    """Add ``view`` to the functions :func:`module_view` tries (idempotent)."""
    if view not in _MODULE_VIEWS:
        _MODULE_VIEWS.append(view)
    return view


def module_view(m: nn.Module) -> nn.Module | type | Op:
    """The float module (or class) the tables describe ``m`` as, or the op of the functional
    call it stands for (``qir.nn.GridSample`` is ``F.grid_sample``): the first registered
    view's answer, else ``m`` itself."""
    for view in _MODULE_VIEWS:
        found = view(m)
        if found is not None:
            return found
    return m


#: Functions mapping an opaque function call to the op it computes, keyed by the function's
#: qualified name: a converted model's integer forms (``abs_codes`` is ``abs`` on codes) are
#: checked against the rows of the op they stand for. ``view(args, kwargs)`` gets the call's
#: arguments (graph values for tensors) and returns the op, or None when it cannot tell.
FunctionView = Callable[[Sequence[Any], dict[str, Any]], "Op | None"]
_FUNCTION_VIEWS: dict[str, FunctionView] = {}


def register_function_view(target: str, view: FunctionView) -> FunctionView:
    """Check calls of the function named ``target`` (``module.qualname``) as the op ``view`` returns."""
    _FUNCTION_VIEWS[target] = view
    return view


def function_view(target: str) -> FunctionView | None:
    """The view registered for calls of the function named ``target``, or None."""
    return _FUNCTION_VIEWS.get(target)


def _fusion(cls: type) -> tuple[bool, str | None] | None:
    """Class-level ``has_add`` / ``act`` of a fused module class (float, QAT or integer)."""
    has_add = getattr(cls, "has_add", None)
    return (has_add, getattr(cls, "act", None)) if isinstance(has_add, bool) else None


def _op_from_module(m: nn.Module, fusion: tuple[bool, str | None] | None) -> tuple[Op | None, nn.Module]:
    """The registered op a module computes, and the module holding its weights.

    A fused module (a ``conv`` child, ``FusedModule``) is its conv's op; ``fusion``
    (the called class's ``has_add`` / ``act``) sets the fused add and activation. QAT and
    integer classes are found through their bases or ``_FLOAT_MODULE``.
    """
    by_module = _module_op_classes()
    inner = getattr(m, "conv", None)
    holder = inner if isinstance(inner, nn.Module) and fusion is not None else m
    for c in _module_lineage(type(holder)):
        cls = by_module.get(c)
        if cls is None:
            continue
        try:
            op = cls.from_module(holder)
        except (NotImplementedError, TypeError, ValueError, AttributeError, KeyError):
            return None, holder
        if isinstance(op, WeightedOp) and fusion is not None:
            op = attrs.evolve(op, add=fusion[0], act=fusion[1])  # type: ignore[call-arg]
        return op, holder
    return None, holder


def _weighted_params(op: WeightedOp, operands: Sequence[Value]) -> tuple[Params, Value | None, Value]:
    x, w, b, other = op.split(operands)
    wt = w.type if isinstance(w.type, TensorType) else None
    bt = b.type if b is not None and isinstance(b.type, TensorType) else None
    return Params(wt, bt), other, x


def subject_of(node: Node, graph: Graph) -> Subject:
    """Describe ``node``: its op, call form, spelling, data inputs and weights."""
    op = node.op
    spelling = node.meta.get(SPELLING_META)
    if isinstance(op, Call):
        module = graph.objects.get(f"module:{op.target}") if op.kind == "module" else None
        # the call's arguments in order (an operand passed twice, x and addend, appears twice)
        call_args = [a for a in resolve(op.args, node.operands) if isinstance(a, Value)]
        tensors = tuple(v for v in call_args if isinstance(v.type, TensorType))
        if isinstance(module, nn.Module):
            view = module_view(module)
            if isinstance(view, Op):  # a module standing for a functional call: that function's rows
                return Subject(node, view, FORM_FUNCTION, spelling, tensors, Params())
            if not isinstance(view, nn.Module):  # a class: enough to find the row
                return Subject(node, None, FORM_MODULE, spelling, tensors, Params(), row_class=view)
            rebuilt, holder = _op_from_module(view, _fusion(type(module)))
            # the called module's own tensors first: an integer module keeps int8 / int32 weights
            weight = _tensor_type(getattr(module, "weight", None)) or _tensor_type(getattr(holder, "weight", None))
            bias = _tensor_type(getattr(module, "bias", None)) or _tensor_type(getattr(holder, "bias", None))
            fused_add = isinstance(rebuilt, WeightedOp) and bool(getattr(rebuilt, "add", False))
            addend = tensors[1] if fused_add and len(tensors) > 1 else None
            inputs = tensors[:1] if addend is not None else tensors
            # a fused module is looked up by its conv (the module holding the weights)
            return Subject(node, rebuilt, FORM_MODULE, spelling, inputs, Params(weight, bias), addend, type(holder))
        fview = _FUNCTION_VIEWS.get(op.target) if op.kind == "function" else None
        viewed = fview(resolve(op.args, node.operands), resolve(op.kwargs, node.operands)) if fview else None
        if viewed is not None:
            return Subject(node, viewed, FORM_FUNCTION, spelling, tensors, Params())
        return Subject(node, None, FORM_OPAQUE, spelling, tensors, Params())
    if isinstance(op, (IntegerModuleOp, QATModuleOp)):
        return _integer_subject(node, op, spelling)
    if "float_functional" in node.meta:
        form = FORM_FLOAT_FUNCTIONAL
    elif isinstance(op, ModuleOp) and node.scope is not None:
        form = FORM_MODULE
    else:
        form = FORM_FUNCTION
    if isinstance(op, WeightedOp):
        params, addend, x = _weighted_params(op, node.operands)
        return Subject(node, op, form, spelling, (x,), params, addend)
    if isinstance(op, ModuleOp):
        inputs = tuple(v for v in op.module_inputs(node.operands) if isinstance(v, Value))
        return Subject(node, op, form, spelling, inputs, Params())
    tensors = tuple(v for v in node.operands if isinstance(v.type, TensorType))
    return Subject(node, op, form, spelling, tensors, Params())


def _integer_subject(node: Node, op: IntegerModuleOp | QATModuleOp, spelling: str | None) -> Subject:
    """An integer or QAT layer is checked as the float op its rows describe (``qconv`` and
    ``qat_conv`` as ``nn.Conv2d``)."""
    fop = op.float_op()
    # tensor inputs only: a run-time size operand (resize) is not data the rows describe
    ins = tuple(v for v in op.module_inputs(node.operands) if isinstance(v, Value) and isinstance(v.type, TensorType))
    state = dict(zip(op.param_roles(), op.module_params(node.operands), strict=False))
    w, b = state.get("weight"), state.get("bias")
    params = Params(
        w.type if w is not None and isinstance(w.type, TensorType) else None,
        b.type if b is not None and isinstance(b.type, TensorType) else None,
    )
    if fop is None:
        return Subject(node, None, FORM_OPAQUE, spelling, ins, params)
    if isinstance(fop, type):  # a module class the tables list (QuantStub): its row, no op facts
        return Subject(node, None, FORM_MODULE, spelling, ins, params, row_class=fop)
    if op.legality_form in (FORM_FLOAT_FUNCTIONAL, FORM_FUNCTION):  # qgrid_sample: the F.grid_sample call
        return Subject(node, fop, op.legality_form, spelling, ins, params)
    addend = ins[1] if bool(getattr(fop, "add", False)) and len(ins) > 1 else None
    inputs = ins[:1] if addend is not None else ins
    row_class = fop.module_types[0] if isinstance(fop, ModuleOp) and fop.module_types else None
    return Subject(node, fop, FORM_MODULE, spelling, inputs, params, addend, row_class)


def _module_class_of(subject: Subject) -> type | None:
    """The module class a module-form node was built from (the op rebuilds it on meta)."""
    if subject.row_class is not None:
        return subject.row_class
    op = subject.op
    if not isinstance(op, ModuleOp):
        return None
    if len(op.module_types) == 1:
        return op.module_types[0]
    try:
        if op in _CLASS_OF_OP:
            return _CLASS_OF_OP[op]
        cacheable = True
    except TypeError:  # an attribute value that does not hash
        cacheable = False
    params = op.module_params(subject.node.operands)
    tensors = {
        role: torch.empty(v.type.shape, dtype=v.type.dtype.to_torch(), device="meta")
        for role, v in zip(op.param_roles(), params, strict=False)
        if isinstance(v.type, TensorType)
    }
    try:
        cls: type | None = type(op.to_module(tensors))
    except Exception:  # an op that cannot rebuild its module: the caller falls back to the op's rows
        cls = None
    if cacheable:
        _CLASS_OF_OP[op] = cls  # the class depends on the op's attributes, not on tensor shapes
    return cls


_CLASS_OF_OP: dict[Op, type | None] = {}


def rows_for(table: Any, subject: Subject) -> tuple[tuple[Any, ...], str]:
    """The table rows that describe ``subject``, and the spelling they were found by.

    An exact spelling (``node.meta['torch_spelling']``, or the module class of a module
    call) picks one row; a module class the table does not list yields no rows when the
    table lists the op under other module classes (``BatchNorm1d`` next to ``BatchNorm2d``),
    and the op's function rows otherwise (``nn.Upsample`` -> ``F.interpolate``). Function
    calls use the op's non-module rows (several when the table lists ``torch.max`` and
    ``torch.Tensor.max`` separately; the pass then compares them).
    """
    if subject.spelling:
        entry = table.get(subject.spelling)
        return ((entry,), subject.spelling) if entry is not None else ((), subject.spelling)
    rows = tuple(table.by_ir_op(subject.ir_name)) if subject.op is not None else ()
    module_rows = tuple(r for r in rows if r.section == MODULE_SECTION)
    other_rows = tuple(r for r in rows if r.section != MODULE_SECTION)
    if subject.form == FORM_MODULE:
        cls = _module_class_of(subject)
        if cls is not None:
            entry = row_for_module_class(table, cls)
            if entry is not None:
                return (entry,), entry.spelling
            name = class_spellings(cls)[0]
            if module_rows or not other_rows:
                return (), name
            return other_rows, name
        return (module_rows or other_rows), subject.ir_name
    if subject.form == FORM_OPAQUE:
        # a function no op describes may still have a row of its own, spelled as its qualified name
        # (qir.functional.centered_yuv2rgb)
        name = _opaque_name(subject.node)
        entry = table.get(name) if isinstance(subject.node.op, Call) and subject.node.op.kind == "function" else None
        return ((entry,), name) if entry is not None else ((), name)
    rows = other_rows or module_rows
    if len(rows) == 1 or subject.op is None:
        return rows, rows[0].spelling if rows else subject.ir_name
    return rows, function_spelling(subject.op)


def _opaque_name(node: Node) -> str:
    op = node.op
    return str(op.target) if isinstance(op, Call) else op.name


def function_spelling(op: Op) -> str:
    """How a function-form op reads in a report: ``torch.flatten``, ``torch.Tensor.view``."""
    for fn in type(op).functions:
        for prefix, space in (("torch", torch), ("torch.nn.functional", torch.nn.functional)):
            name = getattr(fn, "__name__", None)
            if name is not None and getattr(space, name, None) is fn:
                return f"{prefix}.{name}"
    if type(op).methods:
        return f"torch.Tensor.{type(op).methods[0]}"
    return op.name


# ----------------------------------------------------------------------------- skipping


def _tensor_result(t: Type) -> bool:
    if isinstance(t, TensorType):
        return True
    return isinstance(t, SequenceType) and any(isinstance(e, TensorType) for e in t.elements)


def skip_reason(node: Node, graph: Graph) -> str | None:
    """Why ``node`` is not checked, or None when it is compute the march must run."""
    op = node.op
    if isinstance(op, (Constant, GetAttr)):
        return "constant"
    if isinstance(op, GetItem) and isinstance(node.operands[0].type, SequenceType):
        return "element of a sequence"  # the producer of the sequence is checked
    if not _tensor_result(node.type):
        return "no tensor result"
    if op.has_trait(Transparent) and node.operands and node.type == node.operands[0].type:
        # identity / contiguous (no attributes) and mode-dependent ops outside training
        # (dropout, stochastic depth): the tables' "transparent operators ... optimized out"
        training = getattr(op, "training", True)
        if not op.attributes() or training is False or (training is None and not graph.training):
            return "transparent"
    return None


# ----------------------------------------------------------------------------- dtypes


def dtype_name(t: Type | None, assumed: str) -> str | None:
    """Table dtype name of a value: its quantized dtype, an integer dtype as the quantized
    one it stores, or ``assumed`` for a float value inside the quantized region."""
    if isinstance(t, SequenceType):
        t = next((e for e in t.elements if isinstance(e, TensorType)), None)
    if not isinstance(t, TensorType):
        return None
    if t.quant is not None or t.dtype.is_quantized:
        return t.dtype.name
    if t.dtype in _INT_AS_QUANT:
        return _INT_AS_QUANT[t.dtype]
    return assumed


@attrs.define
class Domains:
    """Which values lie in the quantized region, and the dtype each would have.

    With quantization boundaries in the graph (rows whose input dtypes are exactly
    ``float32``: QuantStub; rows whose output dtypes are exactly ``float32``: DeQuantStub),
    graph inputs are float, a quantize's result is quantized and a dequantize's is float;
    other nodes are quantized when a data input is. Without boundaries the whole graph is
    taken as quantized (prepare quantizes the inputs). Float values inside the region get
    ``assumed`` (qint8 by default) as their would-be dtype.
    """

    assumed: str = "qint8"
    quantized: dict[Value, bool] = attrs.field(factory=dict)
    #: The graph's output values (computed once: every node asks whether it is one).
    outputs: frozenset[Value] = frozenset()

    def is_quantized(self, v: Value) -> bool:
        return self.quantized.get(v, True)

    def dtype(self, v: Value | None) -> str | None:
        if v is None:
            return None
        t: Type | None = v.type
        if isinstance(t, SequenceType):  # a list of float tensors (AnchorGenerator's anchors) is float too
            t = next((e for e in t.elements if isinstance(e, TensorType)), None)
        if not self.is_quantized(v) and isinstance(t, TensorType) and t.dtype.is_float:
            return "float32"
        return dtype_name(v.type, self.assumed)


def boundary_kind(entry: Any) -> str | None:
    """``"quantize"`` / ``"dequantize"`` for rows that convert between float and quantized."""
    ins, outs = getattr(entry, "input_dtypes", None), getattr(entry, "output_dtypes", None)
    if ins == ("float32",):
        return "quantize"
    if outs == ("float32",):
        return "dequantize"
    return None


def _holds_tensor(t: Type) -> bool:
    return isinstance(t, TensorType) or (isinstance(t, SequenceType) and any(_holds_tensor(e) for e in t.elements))


def compute_domains(graph: Graph, boundaries: dict[Node, str], assumed: str) -> Domains:
    """Propagate float / quantized through ``graph`` given the boundary nodes."""
    dom = Domains(assumed, outputs=frozenset(graph.output_values))
    if not boundaries:
        return dom
    for a in graph.inputs:
        dom.quantized[a] = False
    for node in graph.nodes:
        kind = boundaries.get(node)
        if kind is not None:
            dom.quantized[node] = kind == "quantize"
        elif isinstance(node.op, Constant):
            # weights are quantized with whatever uses them; a parameter a QuantStub quantizes
            # (a DETR query embedding's weight) is a float input of that stub
            users = node.users
            dom.quantized[node] = not users or any(boundaries.get(u) != "quantize" for u in users)
        else:
            data = [v for v in node.operands if not (isinstance(v, Node) and isinstance(v.op, Constant))]
            # sizes read from a quantized tensor (x.shape[0], w // 2) are ints, not codes: a tensor
            # built from them (torch.arange(w), torch.zeros(b, c)) is float, outside the region
            dom.quantized[node] = _holds_tensor(node.type) and any(dom.quantized.get(v, False) for v in data)
    return dom


# ----------------------------------------------------------------------------- facts


def _spatial(v: Any, n: int) -> tuple[int, ...] | None:
    if v is None:
        return None
    if isinstance(v, int):
        return (v,) * n
    t = tuple(int(x) for x in v)
    return t * n if len(t) == 1 and n > 1 else t


def _conv_padding(op: ConvNd, kernel: tuple[int, ...]) -> tuple[int, ...]:
    if op.padding == "valid":
        return (0,) * len(kernel)
    if op.padding == "same":
        # torch pads (dilation * (k - 1)) in total, the larger half after: report the larger
        return tuple(math.ceil(d * (k - 1) / 2) for d, k in zip(op.dilation, kernel, strict=True))
    return _spatial(op.padding, len(kernel)) or (0,) * len(kernel)


def _is_output(outs: frozenset[Value], node: Node) -> bool:
    if node in outs:
        return True
    return any(isinstance(u.op, GetItem) and u in outs for u in node.users)


def _index_values(node: Node) -> list[Value]:
    """The indices ``node`` returns (argmax, the indices of max(dim): ``r[1]`` or ``r.indices``) as
    graph values. Indices are int64; a converted model's int8 / int16 / int32 codes are not."""
    if isinstance(node.type, TensorType):
        return [node] if node.type.dtype is DType.int64 else []
    return [
        u
        for u in node.users
        if isinstance(u.op, (GetItem, GetAttr)) and isinstance(u.type, TensorType) and u.type.dtype is DType.int64
    ]


def _broadcast_facts(inputs: Sequence[TensorType], out: TensorType) -> dict[str, Any]:
    count, batch = 0, False
    for t in inputs:
        if t.shape == out.shape:
            continue
        count += 1
        padded = (1,) * (out.rank - t.rank) + t.shape
        if out.rank >= 2 and padded[0] != out.shape[0]:  # a rank-1 tensor's one dim is C, not N
            batch = True
    return {"broadcast_input_count": count, "broadcasts_batch": batch}


#: Which of N, C, D, H, W each dim of a rank-r tensor is. The tables speak of [N, C, H, W] and
#: [N, C, D, H, W]; the other ranks follow torch's layouts: (C) unbatched features, (N, C)
#: features (Linear, LSTMCell), (N, C, W) a 1-D signal (Conv1d's (N, C, L); a detection head's
#: (N, anchors, k) after permute + reshape). Dims a rank does not have are 1.
NCHW_LAYOUTS: dict[int, tuple[str, ...]] = {
    1: ("c",),
    2: ("n", "c"),
    3: ("n", "c", "w"),
    4: ("n", "c", "h", "w"),
    5: ("n", "c", "d", "h", "w"),
}
#: The dim of an [N, C, H, W] tensor each letter is (D has none: reduce_dims over it is not built).
_NCHW_AXIS = {"n": 0, "c": 1, "h": 2, "w": 3}


def nchw_dims(shape: Sequence[int]) -> dict[str, int] | None:
    """``{"n", "c", "h", "w"}`` (and ``"d"`` for rank 5) sizes of a tensor of ``shape`` read as
    the tables' [N, C, (D,) H, W]; None for rank 0 and ranks above 5, which the tables do not describe."""
    layout = NCHW_LAYOUTS.get(len(shape))
    if layout is None:
        return None
    dims = {"n": 1, "c": 1, "h": 1, "w": 1}
    dims.update(zip(layout, (int(d) for d in shape), strict=True))
    return dims


def nchw_axis(dim: int, rank: int) -> int | None:
    """The [N, C, H, W] position of dim ``dim`` of a rank-``rank`` tensor (None: D, or no layout)."""
    layout = NCHW_LAYOUTS.get(rank)
    if layout is None or not -rank <= dim < rank:
        return None
    return _NCHW_AXIS.get(layout[dim % rank])


def shape_facts(t: TensorType) -> dict[str, Any]:
    """``input_rank`` / ``input_shape``, [N, C, (D,) H, W] (:func:`nchw_dims`), ``in_channels``
    (C) and ``input_abs_max`` of a first input of type ``t``."""
    s = t.shape
    f: dict[str, Any] = {"input_rank": len(s), "input_shape": s}
    dims = nchw_dims(s)
    if dims is not None:
        f["input_n"], f["input_c"], f["input_h"], f["input_w"] = dims["n"], dims["c"], dims["h"], dims["w"]
        f["in_channels"] = dims["c"]
        if "d" in dims:
            f["input_d"] = dims["d"]
    if t.quant is not None:
        qmax = t.dtype.qrange[1]
        f["input_abs_max"] = max(t.quant.scale) * qmax
    return f


def _weighted_facts(op: WeightedOp, params: Params, out: TensorType | None, domains: Domains) -> dict[str, Any]:
    f: dict[str, Any] = {"has_bias": bool(op.bias)}  # type: ignore[attr-defined]
    w = params.weight
    f["weight_dtype"] = dtype_name(w, "qint8")
    if params.bias is not None:
        f["bias_dtype"] = dtype_name(params.bias, "qint32")
    if w is None:
        return f
    ws = w.shape
    if isinstance(op, Linear):
        f["in_features"], f["out_features"] = ws[1], ws[0]
        return f
    f["weight_n"], f["weight_c"] = ws[0], ws[1]
    f["weight_h"], f["weight_w"] = ws[-2] if len(ws) >= 4 else 1, ws[-1]
    if len(ws) == 5:
        f["weight_d"] = ws[2]
    kernel = tuple(ws[2:])
    f["kernel"] = kernel
    assert isinstance(op, (ConvNd, ConvTransposeNd))
    f["stride"], f["dilation"], f["groups"] = tuple(op.stride), tuple(op.dilation), op.groups
    if isinstance(op, ConvTransposeNd):
        f["in_channels"] = ws[0]
        f["padding"] = tuple(op.padding)
        f["output_padding"] = tuple(op.output_padding)
    else:
        f["in_channels"] = ws[1] * op.groups
        f["padding"] = _conv_padding(op, kernel)
    if out is not None and out.rank >= 2:
        f["out_channels"] = out.shape[1]
    return f


def _op_facts(op: Op, x: TensorType | None, out: TensorType | None) -> dict[str, Any]:
    """Facts read from the op's attributes (pools, interpolate, reductions, ...)."""
    f: dict[str, Any] = {}
    nsp = max((x.rank - 2) if x is not None else 2, 1)
    if isinstance(op, (MaxPoolNd, AvgPoolNd)):
        kernel = _spatial(op.kernel_size, nsp)
        f["kernel"] = kernel
        f["stride"] = _spatial(op.stride, nsp) if op.stride not in (None, ()) else kernel
        f["padding"] = _spatial(op.padding, nsp)
        if isinstance(op, MaxPoolNd):
            f["dilation"] = _spatial(op.dilation, nsp)
    elif isinstance(op, AdaptivePool) and x is not None and out is not None:
        # the window an adaptive pool uses when the output divides the input
        f["kernel"] = tuple(math.ceil(i / o) for i, o in zip(x.shape[2:], out.shape[2:], strict=True))
    elif isinstance(op, Interpolate):
        f["mode"], f["align_corners"] = op.mode, op.align_corners
        if x is not None and out is not None:
            f["scale_factor"] = tuple(o / i for i, o in zip(x.shape[2:], out.shape[2:], strict=True))
    elif isinstance(op, GridSample):
        f["mode"], f["padding_mode"], f["align_corners"] = op.mode, op.padding_mode, op.align_corners
    elif isinstance(op, Pad):
        f["mode"] = op.mode
    elif isinstance(op, Reduction) and x is not None:
        dims = op.dim
        dims = tuple(range(x.rank)) if dims is None else (tuple(dims) if isinstance(dims, (tuple, list)) else (dims,))
        if all(isinstance(d, int) for d in dims):
            # as dims of the tables' [N, C, H, W]: reducing W of an (N, C, W) tensor is dim 3
            axes = [nchw_axis(d, x.rank) for d in dims]
            if all(a is not None for a in axes):
                f["reduce_dims"] = tuple(sorted(a for a in axes if a is not None))
    elif isinstance(op, LayerNorm):
        shape = tuple(op.normalized_shape)
        f["normalized_w"] = shape[-1]
        f["normalized_h"] = shape[-2] if len(shape) >= 2 else 1
    elif isinstance(op, Transpose) and x is not None:
        f["moves_batch_dim"] = 0 in (op.dim0 % max(x.rank, 1), op.dim1 % max(x.rank, 1))
    elif isinstance(op, Permute):
        f["moves_batch_dim"] = bool(op.dims) and op.dims[0] != 0
    elif isinstance(op, MultiheadAttention):
        # the front end builds the op only for packed q/k/v without bias_kv / zero_attn
        f.update(add_bias_kv=False, add_zero_attn=False, qkv_same_embed_dim=True)
    return f


def build_facts(subject: Subject, graph: Graph, domains: Domains) -> dict[str, Any]:
    """The facts of ``subject`` that can be read from the graph (absent ones are left out)."""
    node = subject.node
    op = subject.op
    out_t = node.type
    if isinstance(out_t, SequenceType):
        out_t = next((e for e in out_t.elements if isinstance(e, TensorType)), ObjectType("none"))
    out = out_t if isinstance(out_t, TensorType) else None
    tensor_inputs = [v for v in subject.inputs if isinstance(v.type, TensorType)]
    x_val = tensor_inputs[0] if tensor_inputs else None
    x = x_val.type if x_val is not None and isinstance(x_val.type, TensorType) else None
    f: dict[str, Any] = {"static_shape": True, "is_model_output": _is_output(domains.outputs, node)}
    f["input_count"] = len(tensor_inputs)
    if x is not None:
        f.update(shape_facts(x))
        f["input_dtype"] = domains.dtype(x_val)
    if len(tensor_inputs) > 1:
        f["other_dtype"] = domains.dtype(tensor_inputs[1])
    f["output_dtype"] = domains.dtype(node)
    all_in = [v for v in subject.inputs if isinstance(v.type, TensorType)]
    if subject.addend is not None:
        all_in.append(subject.addend)
    if all_in:
        f["input_bytes"] = max(
            v.type.numel * _ITEM_BYTES.get(domains.dtype(v) or "float32", 4)
            for v in all_in
            if isinstance(v.type, TensorType)
        )
    consts = any(isinstance(v, Node) and isinstance(v.op, Constant) for v in subject.inputs)
    scalar_other = isinstance(op, BinaryOp) and op.other is not None
    f["has_constant_operand"] = consts or scalar_other
    if out is not None and tensor_inputs:
        f.update(_broadcast_facts([v.type for v in tensor_inputs], out))  # type: ignore[misc]
    if isinstance(op, (Max, Argmax, Argmin)):  # Min derives from Max
        f["index_used_internally"] = any(v.users for v in _index_values(node))
    if isinstance(op, WeightedOp):
        f.update(_weighted_facts(op, subject.params, out, domains))
        f["sumin"] = bool(op.add)  # type: ignore[attr-defined]
        if subject.addend is not None:
            f["sumin_dtype"] = domains.dtype(subject.addend)
    elif isinstance(op, BatchNorm) and x is not None and x.rank >= 2:
        f["out_channels"] = x.shape[1]
    if op is not None:
        f.update(_op_facts(op, x, out))
    return f


def fused_parts(subject: Subject) -> list[tuple[str, Any]]:
    """The extra ops a fused conv carries, as (IR op name, facts override) pairs.

    A conv with ``add`` runs the add row's rules on (conv result, addend); with ``act``
    the activation row's rules on the sum. Names come from the op classes' registry names.
    """
    op = subject.op
    if not isinstance(op, WeightedOp):
        return []
    parts: list[tuple[str, Any]] = []
    if op.add and subject.addend is not None:  # type: ignore[attr-defined]
        parts.append((Add.name, subject.addend))
    act = op.act  # type: ignore[attr-defined]
    if act is not None:
        parts.append(((Relu6 if act == "relu6" else Relu).name, None))
    return parts


def part_facts(base: dict[str, Any], subject: Subject, addend: Value | None, domains: Domains) -> dict[str, Any]:
    """Facts for the add / activation part of a fused conv: it reads the conv's result."""
    node = subject.node
    out = node.type if isinstance(node.type, TensorType) else None
    f: dict[str, Any] = {k: base[k] for k in ("static_shape", "is_model_output", "output_dtype") if k in base}
    if out is None:
        return f
    f.update(shape_facts(out))
    f["input_dtype"] = base.get("output_dtype")
    f["has_constant_operand"] = False
    inputs = [out]
    if addend is not None and isinstance(addend.type, TensorType):
        f["other_dtype"] = domains.dtype(addend)
        inputs.append(addend.type)
    f["input_count"] = len(inputs)
    f.update(_broadcast_facts(inputs, out))
    return f


def iter_checked(graph: Graph) -> Iterable[Node]:
    """Nodes :func:`skip_reason` keeps, in graph order."""
    return (n for n in graph.nodes if skip_reason(n, graph) is None)
