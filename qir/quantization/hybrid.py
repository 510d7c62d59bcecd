"""Hybrid (CPU + BPU) preparation: which modules stay float on the CPU, and the stubs at the boundaries.

``prepare_qat_fx(model, qconfig_dict, hybrid=True, hybrid_dict=...)`` (docs/hybrid.md):

1. **Placement** (:func:`cpu_modules`, before fusion). A module whose path equals or lies
   under a ``hybrid_dict["module_name"]`` entry, or that is an instance of a
   ``hybrid_dict["module_type"]`` class, is a CPU module: traced as one opaque call (its
   forward runs as written), never fused with its neighbours, given no qconfig and not
   swapped.
2. **Boundaries** (:func:`place_boundaries`, after the QAT swap). One walk over the fx
   graph marks every value quantized (produced by a QAT module, or by a scale-preserving
   op on a quantized value), float (model inputs, CPU outputs, DeQuantStub outputs) or
   not a tensor. An op without a quantized form that receives a quantized value is placed
   on the CPU too ("no BPU form"). A float value feeding a QAT module gets a generated
   QAT ``QuantStub`` (one per value and activation qconfig, shared by its consumers); a
   quantized value feeding a CPU op, a QuantStub or the model output gets a generated
   ``DeQuantStub``. Stub names follow :mod:`qir.quantization.names`
   (``layer1._generated_quant_0``, scoped to the consumers' common parent module), so a
   calibrated model's stub scales carry into the QAT model by name.

Every decision is kept as a :class:`HybridPlan` in ``GraphModule.meta[HYBRID_KEY]``
(:func:`hybrid_placement` returns it; ``print`` shows it as a table). ``convert_fx``,
``check_model`` and ``compile_model`` read it.
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from qir.quantization.names import NameAllocator
from qir.quantization.qconfig import QConfig
from qir.quantization.qconfig_dict import parse_hybrid_dict
from qir.quantization.scale_ops import (
    CODE_OPS,
    CODES,
    PAIR,
    PRESERVING_MODULES,
    QUERY_FUNCTIONS,
    QUERY_METHODS,
    REDUCE,
    code_op,
    is_preserving_call,
    module_self,
    pair_item,
)

__all__ = [
    "BPU",
    "CPU",
    "HYBRID_KEY",
    "HybridBoundary",
    "HybridPlacement",
    "HybridPlan",
    "HybridSpec",
    "check_cpu_calls",
    "cpu_modules",
    "hybrid_placement",
    "hybrid_plan_of",
    "place_boundaries",
]

#: ``GraphModule.meta`` key of the :class:`HybridPlan` of a hybrid QAT (and converted) model.
HYBRID_KEY = "qir.hybrid"

CPU = "CPU"
BPU = "BPU"

# value kinds of the boundary walk
_Q, _F, _N = "quantized", "float", "none"


# ---------------------------------------------------------------------------------------------
# what the user asked for


@dataclass(frozen=True)
class HybridSpec:
    """A validated ``hybrid_dict``: module names and module classes to run on the CPU."""

    module_name: tuple[str, ...] = ()
    module_type: tuple[type, ...] = ()

    @classmethod
    def parse(cls, hybrid_dict: Mapping[str, Any] | None) -> HybridSpec:
        parsed = parse_hybrid_dict(hybrid_dict)
        return cls(tuple(dict.fromkeys(parsed["module_name"])), tuple(dict.fromkeys(parsed["module_type"])))

    def same_as(self, other: HybridSpec) -> bool:
        """Equal up to order and repetition."""
        return set(self.module_name) == set(other.module_name) and set(self.module_type) == set(other.module_type)

    def __str__(self) -> str:
        types = ", ".join(t.__name__ for t in self.module_type)
        return f"{{'module_name': {list(self.module_name)}, 'module_type': [{types}]}}"


def _under(path: str, name: str) -> bool:
    return path == name or path.startswith(name + ".")


def _missing_name_error(root: nn.Module, name: str) -> ValueError:
    """'names no module', with the children of the nearest existing parent (or close matches)."""
    modules = dict(root.named_modules())
    parts = name.split(".")
    parent = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in modules), "")
    head = f"hybrid_dict['module_name'] entry '{name}' names no module"
    children = {f"{parent}.{k}" if parent else k: m for k, m in modules[parent]._modules.items() if m is not None}
    if parent and not children:
        kind = type(modules[parent]).__name__
        return ValueError(f"{head}; '{parent}' ({kind}) has no submodules: name '{parent}' to run it on the CPU")
    listed = ", ".join(f"{p} ({type(m).__name__})" for p, m in children.items())
    text = f"{head}; {f'modules under {parent!r}' if parent else 'top-level modules'}: {listed}"
    close = [c for c in difflib.get_close_matches(name, [p for p in modules if p], n=3) if c not in children]
    if close:
        text += f"; did you mean {', '.join(repr(c) for c in close)}?"
    return ValueError(text)


def check_cpu_calls(gm: torch.fx.GraphModule, cpu: Mapping[str, str]) -> None:
    """Every CPU module lies outside the modules the traced graph calls whole (their insides are never seen).

    A CPU module the graph does not call at all (unused) is fine."""
    called = {str(n.target) for n in gm.graph.nodes if n.op in ("call_module", "get_attr")}
    for path in cpu:
        if path in called:
            continue
        parts = path.split(".")
        anc = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in called), None)
        if anc is not None:
            kind = type(gm.get_submodule(anc)).__name__
            raise ValueError(
                f"hybrid_dict places '{path}' on the CPU, but it lies inside '{anc}' ({kind}), which is traced as one "
                f"module: name '{anc}' instead"
            )


def cpu_modules(root: nn.Module, spec: HybridSpec) -> dict[str, str]:
    """Outermost CPU module paths of ``root`` -> the reason (``hybrid_dict module_name 'conv0'``).

    Raises ValueError for an entry naming no module (with the nearest existing paths), a
    class matching no module, or the root itself (:func:`check_cpu_calls` checks, once
    traced, that no CPU module lies inside a module the graph calls whole).
    """
    modules = dict(root.named_modules())
    for name in spec.module_name:
        if name == "":
            raise ValueError(
                "hybrid_dict['module_name'] entry '' names the whole model; nothing would be quantized: "
                "name the submodules that should run on the CPU"
            )
        if name not in modules:
            raise _missing_name_error(root, name)
    for cls in spec.module_type:
        if not any(isinstance(m, cls) for m in modules.values()):
            raise ValueError(
                f"hybrid_dict['module_type'] entry {cls.__module__}.{cls.__qualname__} matches no module "
                f"of {type(root).__name__}; module classes in the model: "
                f"{', '.join(sorted({type(m).__name__ for m in modules.values()}))}"
            )
    if isinstance(root, spec.module_type):
        raise ValueError(
            f"hybrid_dict['module_type'] matches the model itself ({type(root).__name__}); nothing "
            "would be quantized: name the submodules that should run on the CPU"
        )
    found: dict[str, str] = {}
    for path, m in modules.items():
        if not path or any(_under(path, p) for p in found):
            continue  # the root, or inside a CPU module (it runs as a whole)
        named = [n for n in spec.module_name if _under(path, n)]
        typed = [t for t in spec.module_type if isinstance(m, t)]
        if named:
            found[path] = f"hybrid_dict module_name '{min(named, key=len)}'"
        elif typed:
            found[path] = f"hybrid_dict module_type {typed[0].__name__}"
    return found


# ---------------------------------------------------------------------------------------------
# what prepare decided


@dataclass(frozen=True)
class HybridPlacement:
    """Where one call of the prepared graph runs.

    ``node``: the fx node; ``target``: module path, or the function / method name;
    ``kind``: the module's class name, ``function`` or ``method``; ``device``: ``CPU`` or
    ``BPU``; ``placed``: True when hybrid preparation moved it to the CPU (hybrid_dict or
    no BPU form), False when it is BPU work or float work outside the quantized region.
    """

    node: str
    target: str
    kind: str
    device: str
    reason: str
    placed: bool = False


@dataclass(frozen=True)
class HybridBoundary:
    """A generated stub: ``quant`` (float -> BPU) or ``dequant`` (BPU -> float) of value ``source``."""

    stub: str
    kind: str
    source: str
    consumers: tuple[str, ...]


@dataclass(frozen=True)
class HybridPlan:
    """Every placement and generated stub of a hybrid model; ``str(plan)`` is a table."""

    placements: tuple[HybridPlacement, ...]
    boundaries: tuple[HybridBoundary, ...]

    def on(self, device: str) -> tuple[HybridPlacement, ...]:
        return tuple(p for p in self.placements if p.device == device)

    def cpu_modules(self) -> list[str]:
        """Targets hybrid preparation put on the CPU (hybrid_dict or no BPU form), once each, in graph order."""
        return list(dict.fromkeys(p.target for p in self.placements if p.placed))

    def stubs(self, kind: str) -> list[str]:
        return [b.stub for b in self.boundaries if b.kind == kind]

    def __str__(self) -> str:
        placed = sum(p.placed for p in self.placements)
        lines = [
            f"hybrid placement: {len(self.on(BPU))} BPU, {len(self.on(CPU))} CPU call(s) ({placed} placed by "
            f"hybrid); {len(self.stubs('quant'))} quant / {len(self.stubs('dequant'))} dequant stub(s) generated"
        ]
        rows = [("node", "target", "kind", "device", "reason")]
        rows += [(p.node, p.target, p.kind, p.device, p.reason) for p in self.placements]
        lines += _columns(rows)
        if self.boundaries:
            lines += ["", "generated stubs:"]
            brows = [("stub", "kind", "value", "consumers")]
            brows += [(b.stub, b.kind, b.source, ", ".join(b.consumers)) for b in self.boundaries]
            lines += _columns(brows)
        return "\n".join(lines)


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def hybrid_placement(model: nn.Module) -> HybridPlan:
    """The placement of a model prepared with ``prepare_qat_fx(..., hybrid=True)`` (or converted from one)."""
    plan = model.meta.get(HYBRID_KEY) if isinstance(model, torch.fx.GraphModule) else None
    if not isinstance(plan, HybridPlan):
        raise ValueError(
            f"{type(model).__name__} was not prepared with prepare_qat_fx(..., hybrid=True): it has no hybrid placement"
        )
    return plan


def hybrid_plan_of(model: Any) -> HybridPlan | None:
    """The :class:`HybridPlan` of ``model``, or None for a model that is not hybrid."""
    plan = model.meta.get(HYBRID_KEY) if isinstance(model, torch.fx.GraphModule) else None
    return plan if isinstance(plan, HybridPlan) else None


# ---------------------------------------------------------------------------------------------
# the boundary walk


def _data_inputs(n: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((n.args, n.kwargs), found.append)
    return list(dict.fromkeys(found))


def _reduces_along_dim(n: torch.fx.Node) -> bool:
    """``torch.max(x, dim)`` / ``x.min(dim=...)``: returns (values, indices); not ``max(x)`` or ``max(x, y)``."""
    second = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    return second is not None and not isinstance(second, torch.fx.Node)


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _common_owner(paths: Iterable[str]) -> str:
    split = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _is_python_op(n: torch.fx.Node) -> bool:
    """Plain Python arithmetic (on sizes): operator.* and builtins."""
    mod = getattr(n.target, "__module__", None)
    return n.op == "call_function" and mod in ("_operator", "builtins", operator.__name__)


class _Walk:
    def __init__(
        self, gm: torch.fx.GraphModule, cpu: Mapping[str, str], qconfigs: Mapping[str, QConfig], fallback: QConfig
    ) -> None:
        self.gm = gm
        self.cpu = cpu
        self.qconfigs = qconfigs
        self.fallback = fallback
        self.kind: dict[torch.fx.Node, str] = {}
        self.placements: list[HybridPlacement] = []
        #: quantized value -> its float consumers (CPU ops, QuantStubs, the output)
        self.to_float: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        #: float value -> its BPU consumers and their qconfigs
        self.to_quant: dict[torch.fx.Node, list[tuple[torch.fx.Node, QConfig]]] = {}
        #: consumer node -> the module path it calls (for stub scopes)
        self.owner: dict[torch.fx.Node, str] = {}
        #: BPU calls returning (values, indices): max / min along a dim, topk
        self.pairs: set[torch.fx.Node] = set()

    def place(self, n: torch.fx.Node, target: str, kind: str, device: str, reason: str, placed: bool = False) -> None:
        self.placements.append(HybridPlacement(n.name, target, kind, device, reason, placed))

    def needs_float(self, n: torch.fx.Node, ins: Sequence[torch.fx.Node]) -> None:
        for a in ins:
            if self.kind.get(a) == _Q:
                self.to_float.setdefault(a, []).append(n)

    def run(self) -> None:
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                self.kind[n] = _F
            elif n.op == "get_attr":
                self.kind[n] = _N
            elif n.op == "output":
                self.needs_float(n, _data_inputs(n))
            else:
                self.kind[n] = self.call(n)

    def call(self, n: torch.fx.Node) -> str:
        from qir.nn import qat

        ins = [a for a in _data_inputs(n) if self.kind.get(a) in (_Q, _F)]
        quantized = [a for a in ins if self.kind[a] == _Q]
        path, m = self.module_of(n)
        if m is not None:
            self.owner[n] = _parent(path)
            kind = type(m).__name__
            if path in self.cpu:
                self.place(n, path, kind, CPU, self.cpu[path], placed=True)
                self.needs_float(n, ins)
                return _F
            if isinstance(m, qat.QuantStub):
                self.place(n, path, kind, BPU, "quantize (QuantStub)")
                self.needs_float(n, ins)
                return _Q
            if isinstance(m, qat.DeQuantStub):
                if quantized:
                    self.place(n, path, kind, BPU, "dequantize (DeQuantStub)")
                else:
                    self.place(n, path, kind, CPU, "DeQuantStub of a float value: identity")
                return _F
            if isinstance(m, qat.QATModule):
                qc = self.qconfigs.get(path, self.fallback)
                for a in ins:
                    if self.kind[a] == _F:
                        self.to_quant.setdefault(a, []).append((n, qc))
                self.place(n, path, kind, BPU, f"qat.{kind}")
                return _Q
            if not quantized:
                self.place(n, path, kind, CPU, "float input")
                return _F
            if isinstance(m, PRESERVING_MODULES):
                self.place(n, path, kind, BPU, "scale-preserving")
                return _Q
            from qir.quantization.qat_classes import qat_class_for

            why = "no qconfig (stays float)" if qat_class_for(m) is not None else "no BPU form"
            self.place(n, path, kind, CPU, why, placed=True)
            self.needs_float(n, ins)
            return _F
        item = pair_item(n)
        if item is not None and item[0] in self.pairs:  # values keep the codes; indices are exact, not codes
            return _Q if item[1] == 0 else _N
        if (n.op == "call_method" and n.target in QUERY_METHODS) or (
            n.op == "call_function" and n.target in QUERY_FUNCTIONS
        ):
            return _N
        if not ins:  # size arithmetic stays a number; a tensor made from sizes (torch.zeros) is float
            return _N if _is_python_op(n) else _F
        name = str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
        first = n.args[0] if n.args else None
        if not quantized:
            self.place(n, name, n.op.removeprefix("call_"), CPU, "float input")
            return _F
        op = code_op(n)
        if op is not None and self.on_codes(n, op, ins):
            self.place(n, name, n.op.removeprefix("call_"), BPU, "exact on codes")
            kind = CODE_OPS[op]
            if kind == PAIR or (kind == REDUCE and _reduces_along_dim(n)):
                self.pairs.add(n)
            return _Q if kind in (CODES, PAIR, REDUCE) else _N
        if is_preserving_call(n) and isinstance(first, torch.fx.Node) and self.kind.get(first) == _Q:
            self.place(n, name, n.op.removeprefix("call_"), BPU, "scale-preserving")
            return _Q
        self.place(n, name, n.op.removeprefix("call_"), CPU, "no BPU form", placed=True)
        self.needs_float(n, ins)
        return _F

    def on_codes(self, n: torch.fx.Node, op: str, ins: Sequence[torch.fx.Node]) -> bool:
        """A code op runs on the BPU when its data inputs are quantized (gather's index may be any tensor)."""
        index = n.args[2] if op == "gather" and len(n.args) > 2 else n.kwargs.get("index")
        return all(self.kind[a] == _Q or (op == "gather" and a is index) for a in ins)

    def module_of(self, n: torch.fx.Node) -> tuple[str, nn.Module | None]:
        if n.op == "call_module":
            return str(n.target), self.gm.get_submodule(str(n.target))
        m = module_self(self.gm, n)
        if m is not None:
            return str(n.args[0].target), m  # type: ignore[union-attr]
        return "", None


def _set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    parent._modules[leaf] = module


def place_boundaries(
    gm: torch.fx.GraphModule, cpu: Mapping[str, str], qconfigs: Mapping[str, QConfig], fallback: QConfig
) -> HybridPlan:
    """Place every call of the QAT-swapped ``gm`` and insert the generated stubs, in place.

    ``cpu``: CPU module paths -> reason; ``qconfigs``: the qconfig of each swapped module
    (a generated QuantStub takes its first consumer's activation); ``fallback``: the
    qconfig of stubs whose consumers have no activation fake quant (high-precision convs).
    """
    from qir.nn import qat
    from qir.quantization.stubs import QuantStub as FloatQuantStub

    walk = _Walk(gm, cpu, qconfigs, fallback)
    walk.run()
    graph = gm.graph
    alloc = NameAllocator(p for p, _ in gm.named_modules())
    boundaries: list[HybridBoundary] = []

    def insert(src: torch.fx.Node, consumers: list[torch.fx.Node], kind: str, module: nn.Module) -> None:
        path = alloc.new(_common_owner(walk.owner.get(c, "") for c in consumers), kind)
        module.train(gm.training)
        _set_module(gm, path, module)
        with graph.inserting_before(consumers[0]):
            stub = graph.call_module(path, (src,))
        for c in consumers:
            c.replace_input_with(src, stub)
        boundaries.append(HybridBoundary(path, kind, src.name, tuple(c.name for c in consumers)))

    for src, uses in walk.to_quant.items():
        groups: dict[Any, list[tuple[torch.fx.Node, QConfig]]] = {}
        for c, qc in uses:
            use = qc if qc.activation is not None else fallback
            groups.setdefault(use.activation, []).append((c, use))
        for group in groups.values():
            consumers = list(dict.fromkeys(c for c, _ in group))
            insert(src, consumers, "quant", qat.QuantStub.from_float(FloatQuantStub(), group[0][1]))
    for src, consumers in walk.to_float.items():
        insert(src, list(dict.fromkeys(consumers)), "dequant", qat.DeQuantStub())
    gm.recompile()
    return HybridPlan(tuple(walk.placements), tuple(boundaries))
