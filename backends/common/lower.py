"""Lowering's shared machinery: the rule registries, the :class:`LowerContext` rules emit
into, kernel policies and the helpers rules use. The walk over the IR graph is
:func:`backends.common.lower_ir.lower_ir`; the ``lower`` pass (:mod:`backends.common.lower_pass`)
runs it inside a pipeline.

Two kinds of rules, both keyed by march (``"*"`` = every march; a march's own rule wins):

* **op rules**, keyed by IR op name (:func:`register_op_rule`): ``rule(ctx, node, operands)``
  with the ``qir.ir`` node (its op's attributes, ``scope``, ``name``) and the lowered
  operands. This is the registry every rule moves to.
* **legacy rules**, keyed by quantized module class, QFunctional method, torch function or
  tensor method: ``rule(ctx, node, obj, args, kwargs)`` with a :class:`RuleNode`. The IR walk
  reaches them through its adapter for nodes no op rule covers (opaque module and method
  calls, and ops whose torch call or module form they know).

Rules read the modules' integer buffers and fixed scales (deriving multipliers with
:mod:`backends.common.numerics`, the rules' single implementation); they never call a
module's forward. While lowering, every emitted instruction runs once on the example
inputs with the Program's own kernels: later rules see concrete shapes, and layers with
several exact engines are timed and the fastest is kept (``opt >= 2``; the march's
:class:`KernelPolicy`).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from backends.common.kernels.base import F64_EXACT_ACC, get_kernel
from backends.common.kernels.schema import SchemaError
from backends.common.program import CONST_DTYPES, Instruction, ValueRef

__all__ = [
    "KernelPolicy",
    "LowerContext",
    "LoweringError",
    "Named",
    "OpRule",
    "RuleNode",
    "get_kernel_policy",
    "op_rule",
    "register_function_rule",
    "register_kernel_policy",
    "register_method_rule",
    "register_module_rule",
    "register_op_rule",
    "function_rule",
    "method_rule",
    "module_rule",
]


class LoweringError(RuntimeError):
    """The model cannot be lowered; the message names the node, module and op."""


# ----------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class KernelPolicy:
    """A march's kernel choices: engine preference (used as is below ``measure_from_opt``),
    the code dtypes it runs, and how many timed runs a measurement takes."""

    conv2d: tuple[str, ...] = ("dw", "int_mm", "int_mm_t", "f32", "f32_chunked", "f64")
    linear: tuple[str, ...] = ("f32", "int_mm", "f64")
    code_dtypes: tuple[str, ...] = ("qint8", "qint16", "qint32")
    measure_from_opt: int = 2
    repeats: int = 5


_POLICIES: dict[str, KernelPolicy] = {}


def register_kernel_policy(march: str, policy: KernelPolicy) -> None:
    _POLICIES[march] = policy


def get_kernel_policy(march: str) -> KernelPolicy:
    _load_backend(march)
    return _POLICIES.get(march, KernelPolicy())


def _load_backend(march: str) -> None:
    # backends register their rules and policies when their package is imported
    import importlib

    importlib.import_module(f"backends.{march}")


# ----------------------------------------------------------------------------- rule registry


class Named(Protocol):
    """What the helpers below read of the node being lowered: its name (instruction sources, errors)."""

    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class RuleNode:
    """The node a legacy rule lowers, in the shape those rules read: ``name`` (the IR value's
    name: instruction sources and messages), ``target`` (the module path, method name or
    callable) and ``args`` (the call's arguments; a QFunctional method's receiver first)."""

    name: str
    target: Any
    args: tuple[Any, ...] = ()


#: ``rule(ctx, node, operands)``: ``node`` is the ``qir.ir`` Node, ``operands`` its operands
#: lowered (a ValueRef for a run-time value, the tensor itself for a constant).
OpRule = Callable[["LowerContext", Any, list[Any]], Any]
Rule = Callable[["LowerContext", RuleNode, Any, list[Any], dict[str, Any]], Any]

_OP_RULES: dict[tuple[str, str], OpRule] = {}

_MODULE_RULES: dict[tuple[str, type], Rule] = {}
_FUNCTION_RULES: dict[tuple[str, Any], Rule] = {}
_METHOD_RULES: dict[tuple[str, str], Rule] = {}


def register_op_rule(op_name: str, rule: OpRule, march: str = "*") -> None:
    """``rule(ctx, node, operands)`` lowers every node of IR op ``op_name`` on ``march``
    (``"*"``: on every march that registers none of its own)."""
    from qir.ir.op import OP_REGISTRY

    if op_name not in OP_REGISTRY:
        raise ValueError(
            f"register_op_rule: {op_name!r} is not a registered IR op (docs/ir-ops.md lists them; "
            "register the op first)"
        )
    _OP_RULES[(march, op_name)] = rule


def op_rule(march: str, op_name: str) -> OpRule | None:
    """The op rule lowering ``op_name`` on ``march``: the march's own, else the common one."""
    return _OP_RULES.get((march, op_name)) or _OP_RULES.get(("*", op_name))


def register_module_rule(cls: type, rule: Rule, march: str = "*") -> None:
    """``rule(ctx, node, module, args, kwargs)`` lowers calls of modules of ``cls`` (and subclasses)."""
    _MODULE_RULES[(march, cls)] = rule


def register_function_rule(target: Any, rule: Rule, march: str = "*") -> None:
    """``rule(ctx, node, target, args, kwargs)`` lowers calls of ``target``: a callable, or a qualified
    name string for functions of upper layers (see :func:`function_rule`)."""
    _FUNCTION_RULES[(march, target)] = rule


def register_method_rule(name: str, rule: Rule, march: str = "*") -> None:
    """``rule(ctx, node, name, args, kwargs)`` lowers tensor-method calls ``x.<name>(...)``."""
    _METHOD_RULES[(march, name)] = rule


def module_rule(march: str, m: nn.Module) -> Rule | None:
    """The module rule for ``m``'s class or its nearest base class that has one."""
    for cls in type(m).__mro__:
        for key in ((march, cls), ("*", cls)):
            if key in _MODULE_RULES:
                return _MODULE_RULES[key]
    return None


def _lookup(table: Mapping[tuple[str, Any], Rule], march: str, key: Any) -> Rule | None:
    try:
        return table.get((march, key)) or table.get(("*", key))
    except TypeError:  # unhashable target
        return None


def function_rule(march: str, target: Any) -> Rule | None:
    """The rule for calls of ``target``: registered for the callable itself, or for its qualified
    name (``"qir.quantization.code_ops.abs_codes"``: how the IR names an opaque call's target, so a
    rule for a function of an upper layer needs no import of it)."""
    rule = _lookup(_FUNCTION_RULES, march, target)
    if rule is None and not isinstance(target, str):
        module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
        if module and qualname:
            rule = _lookup(_FUNCTION_RULES, march, f"{module}.{qualname}")
    return rule


def method_rule(march: str, name: str) -> Rule | None:
    return _lookup(_METHOD_RULES, march, name)


# ----------------------------------------------------------------------------- context


@dataclass
class LowerContext:
    """State of one lowering: the Program being built and the example values of its names."""

    march: str
    opt: int
    policy: KernelPolicy
    instructions: list[Instruction] = field(default_factory=list)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    _const_ids: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)
    _count: int = 0

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"%{self._count}_{hint.replace('.', '_')}"

    def const(self, hint: str, t: torch.Tensor) -> str:
        """Register an integer (or boundary float32) array; the same tensor object is stored once."""
        key = id(t)
        hit = self._const_ids.get(key)
        if hit is not None:
            return hit[0]
        name = f"{hint}#{len(self.constants)}"
        self.constants[name] = t.detach().clone().contiguous()
        # Keep ``t`` alive: an id() of a freed temporary can be reused by a different tensor.
        self._const_ids[key] = (name, t)
        return name

    def example(self, v: Any) -> Any:
        """The example value of a value name (or a nested structure of them); literals pass through."""
        if isinstance(v, ValueRef):
            return self.values[v.name]
        if isinstance(v, str) and v in self.values:
            return self.values[v]
        if isinstance(v, (list, tuple)):
            return type(v)(self.example(x) for x in v)
        return v

    def emit(
        self,
        op: str,
        inputs: Sequence[str],
        attrs: Mapping[str, Any],
        consts: Mapping[str, str],
        source: str,
        hint: str | None = None,
    ) -> str:
        """Append one instruction, run it on the example values, return its output name."""
        out = self.fresh(hint or op)
        inst = Instruction(op, tuple(inputs), (out,), dict(attrs), dict(consts), source)
        try:  # the schema the artifact loader checks: the compiler writes nothing it would refuse
            get_kernel(op).schema.check(inst, self.constants)
        except SchemaError as e:
            raise LoweringError(f"{op} for '{source}': {e.field}: {e.rule}") from None
        self.values[out] = self.run(inst)[0]
        self.instructions.append(inst)
        return out

    def run(self, inst: Instruction) -> list[Any]:
        kernel = get_kernel(inst.op)
        state = kernel.prepare(inst, self.constants)
        try:
            return kernel.run(inst, [self.values[v] for v in inst.inputs], state)
        except LoweringError:
            raise
        except Exception as e:
            raise LoweringError(f"{inst.op} for '{inst.source}' failed on the example input: {e}") from e

    def choose_engine(
        self,
        op: str,
        inputs: Sequence[str],
        attrs: dict[str, Any],
        consts: Mapping[str, str],
        candidates: Sequence[str],
        source: str,
    ) -> dict[str, Any]:
        """``attrs`` with the engine set: the first candidate, or the fastest one measured (opt >= 2)."""
        if not candidates:
            raise LoweringError(f"{op} for '{source}': no exact engine applies")
        if len(candidates) == 1 or self.opt < self.policy.measure_from_opt:
            return {**attrs, "engine": candidates[0]}
        # round-robin over engines, best of ``repeats``: a preempted run (shared machines) hits every
        # engine alike and the minimum discards it
        runs = []
        for eng in candidates:
            inst = Instruction(op, tuple(inputs), ("%probe",), {**attrs, "engine": eng}, dict(consts), source)
            kernel = get_kernel(op)
            state = kernel.prepare(inst, self.constants)
            kernel.run(inst, [self.values[v] for v in inputs], state)  # warm-up (allocator, oneDNN primitives)
            runs.append((eng, kernel, inst, state))
        args = [self.values[v] for v in inputs]
        best = dict.fromkeys(candidates, float("inf"))
        for _ in range(self.policy.repeats):
            for eng, kernel, inst, state in runs:
                t0 = time.perf_counter()
                kernel.run(inst, args, state)
                best[eng] = min(best[eng], time.perf_counter() - t0)
        timings = {e: round(t * 1e6, 1) for e, t in best.items()}
        engine = min(timings, key=lambda e: timings[e])
        return {**attrs, "engine": engine, "timings_us": timings}

    def check_dtype(self, name: str, source: str) -> None:
        v = self.values.get(name)
        if isinstance(v, torch.Tensor) and not v.is_floating_point():
            dt = {torch.int8: "qint8", torch.int16: "qint16", torch.int32: "qint32"}.get(v.dtype)
            if dt is not None and dt not in self.policy.code_dtypes:
                raise LoweringError(
                    f"'{source}': {dt} tensors are not supported on {self.march} "
                    f"(valid: {', '.join(self.policy.code_dtypes)})"
                )


# ----------------------------------------------------------------------------- values


def names_in(v: Any) -> list[str]:
    """The value names a (nested) argument refers to: what an instruction reading it depends on."""
    return _names_in(v)


def _names_in(v: Any) -> list[str]:
    if isinstance(v, ValueRef):
        return [v.name]
    if isinstance(v, (list, tuple)):
        return [x for e in v for x in _names_in(e)]
    if isinstance(v, slice):  # x[:, :, : h // 2]: run-time slice bounds are inputs too
        return _names_in([v.start, v.stop, v.step])
    if isinstance(v, dict):
        return _names_in(list(v.values()))
    return []


# ----------------------------------------------------------------------------- helpers for rules


def tensor_ref(v: Any, node: Named, what: str = "input") -> str:
    """The value name of a tensor argument (raises naming the node for a literal)."""
    if not isinstance(v, ValueRef):
        raise LoweringError(f"node '{node.name}': {what} must be a tensor, got {v!r:.60}")
    return v.name


def bind(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Arguments of a call by parameter name, defaults filled (``fn`` a method: ``self`` skipped)."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if params and params[0].name == "self":
        sig = sig.replace(parameters=params[1:])
    b = sig.bind(*args, **kwargs)
    b.apply_defaults()
    return dict(b.arguments)


#: dtypes of the constant tensors a ``constant`` instruction may hold (a buffer the model reads): a program's
#: constant dtypes but uint8, which no kernel reads as a value
_STORED_DTYPES = tuple(d for d in CONST_DTYPES.values() if d is not torch.uint8)


def stored_constants(ctx: LowerContext, node: Named, v: Any) -> Any:
    """``v`` with each tensor in it (a buffer or parameter the model reads: a BEV grid repeated over
    the batch, a decoder's anchor grid) stored in the program and read by a ``constant`` instruction:
    instruction attributes hold plain data only."""
    if isinstance(v, torch.Tensor):
        if v.dtype not in _STORED_DTYPES:
            raise LoweringError(
                f"node '{node.name}': reads a {v.dtype} constant; a program stores float32, int64 and integer-code "
                "constants (register the buffer as float32)"
            )
        c = ctx.const(f"{node.name}.const", v)
        return ValueRef(ctx.emit("constant", [], {}, {"value": c}, node.name, f"{node.name}_const"))
    if isinstance(v, list):
        return [stored_constants(ctx, node, x) for x in v]
    if isinstance(v, tuple):
        return tuple(stored_constants(ctx, node, x) for x in v)
    if isinstance(v, dict):
        return {k: stored_constants(ctx, node, x) for k, x in v.items()}
    return v


def shape_call(
    ctx: LowerContext, node: Named, fn: str, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None
) -> ValueRef:
    """Emit a ``shape_fn`` instruction calling allow-listed ``fn`` on (nested) values and literals
    (tensor literals stored as constants)."""
    args, kwargs = stored_constants(ctx, node, list(args)), stored_constants(ctx, node, dict(kwargs or {}))
    used = sorted(set(_names_in(list(args)) + _names_in(list((kwargs or {}).values()))))
    return ValueRef(
        ctx.emit("shape_fn", used, {"fn": fn, "args": list(args), "kwargs": dict(kwargs or {})}, {}, node.name, hint=fn)
    )


def acc_bound(weight: torch.Tensor, x: torch.Tensor, out_axis: int = 0) -> tuple[int, int]:
    """``(max|x| * max_c sum|w_c|, same per-element bound)``: partial-sum bounds for exactness proofs."""
    amax = 128 if x.dtype == torch.int8 else 32768 if x.dtype == torch.int16 else 2**31
    dims = [d for d in range(weight.dim()) if d != out_axis]
    wsum = int(weight.to(torch.int64).abs().sum(dim=dims).max()) if weight.numel() else 0
    return amax * wsum, amax


def requant_mode(
    bound: int, bias: torch.Tensor, multiplier: torch.Tensor | None = None, shift: torch.Tensor | None = None
) -> str:
    """``f64`` when the float64 requantization is provably exact for this accumulator bound:
    ``(bound + |b|) * M < 2**52`` and ``shift <= 52`` (so ``2**(shift-1)`` adds exactly). Without
    ``multiplier`` / ``shift``, ``M <= 32767`` and small shifts are assumed (``F64_EXACT_ACC``); the
    fused conv + add's 31-bit multipliers need them passed."""
    b = int(bias.to(torch.int64).abs().max()) if bias.numel() else 0
    if multiplier is None:
        return "f64" if bound + b < F64_EXACT_ACC else "i64"
    m = int(multiplier.to(torch.int64).max()) if multiplier.numel() else 0
    s = int(shift.to(torch.int64).max()) if shift is not None and shift.numel() else 0
    return "f64" if (bound + b) * m < 2**52 and s <= 52 else "i64"


def f32_scale(v: Any) -> float:
    return float(torch.as_tensor(v).detach().reshape(-1)[0].to(torch.float32))


__all__ += ["acc_bound", "bind", "f32_scale", "requant_mode", "shape_call", "tensor_ref"]
