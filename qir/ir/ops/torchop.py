"""Base classes for ops that are one torch call: the spelling, the binding, the call.

A :class:`TorchOp` describes how the front end binds a torch call to the op and how
the op calls torch again (``torch_call``), so the interpreter, type inference and the
torch emitter share one definition:

* ``signature``: the parameter names of the canonical call (``functions[0]``), in
  positional order. Attribute fields carry the same names.
* ``inputs``: the leading parameters that become operands (tensors). With
  ``list_input`` the first parameter is a sequence of tensors (``torch.cat``).
* ``method_varargs``: the parameter that a method spelling passes as ``*args``
  (``x.permute(0, 2, 1)`` binds ``dims=(0, 2, 1)``).

Attribute values may hold :class:`~qir.ir.op.Ref` to trailing operands (run-time sizes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch

from qir.ir.op import (
    Elementwise,
    IRError,
    ModuleOp,
    Op,
    Pure,
    ShapePreserving,
    Trait,
    iter_refs,
    register_op,
    resolve,
)


class TorchCallMixin:
    """``torch_call`` / ``compute`` for ops whose fields mirror a torch signature."""

    name: ClassVar[str]
    functions: ClassVar[tuple[Callable[..., Any], ...]]
    signature: ClassVar[tuple[str, ...]] = ("input",)
    inputs: ClassVar[tuple[str, ...]] = ("input",)
    list_input: ClassVar[bool] = False
    method_varargs: ClassVar[str | None] = None
    #: attribute names passed positionally (torch functions without keyword names for them)
    positional: ClassVar[tuple[str, ...]] = ()
    #: keyword arguments left out of the call when None (functions that reject an explicit None)
    omit_none: ClassVar[tuple[str, ...]] = ()
    #: qualified names of spellings that live outside torch (matched without importing them)
    function_names: ClassVar[tuple[str, ...]] = ()

    def num_leading(self, operands: Sequence[Any]) -> int:
        """How many leading operands are call inputs (the rest are referenced by Refs)."""
        if self.list_input:
            refs = [r.index for v in attrs.asdict(self, recurse=False).values() for r in iter_refs(v)]  # type: ignore[arg-type]
            return min(refs) if refs else len(operands)
        return len(self.inputs)

    def call_target(self) -> Callable[..., Any]:
        return type(self).functions[0]

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """The torch callable and its arguments, with operands substituted for Refs.

        Operands may be tensors (interpreter) or any stand-in (fx nodes while emitting).
        """
        n = self.num_leading(operands)
        args: list[Any] = [list(operands[:n])] if self.list_input else list(operands[:n])
        kwargs: dict[str, Any] = {}
        fields = {f.name: getattr(self, f.name) for f in attrs.fields(type(self))}  # type: ignore[arg-type]
        for pname in self.positional:
            v = fields.pop(pname)
            if v is None and pname in self.omit_none:
                break
            args.append(resolve(v, operands))
        for k, v in fields.items():
            if k in self.signature and not (v is None and k in self.omit_none):
                kwargs[k] = resolve(v, operands)
        return self.call_target(), tuple(args), kwargs

    def compute(self, *operands: Any) -> Any:
        fn, args, kwargs = self.torch_call(operands)
        return fn(*args, **kwargs)


@attrs.frozen
class TorchOp(TorchCallMixin, Op):
    """A pure op that is one torch function call (see the module docstring)."""

    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure})
    arity: ClassVar[tuple[int, int | None]] = (1, None)
    operand_names: ClassVar[tuple[str, ...]] = ("input",)


@attrs.frozen
class TorchModuleOp(TorchCallMixin, ModuleOp):
    """A stateless module-backed op that is also one torch call (``nn.Hardswish``/``F.hardswish``).

    ``module_fields`` lists the attribute fields that are the module's constructor
    arguments (read back from the module by ``from_module``).
    """

    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure})
    arity: ClassVar[tuple[int, int | None]] = (1, None)
    operand_names: ClassVar[tuple[str, ...]] = ("input",)
    module_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_module(cls, m: Any) -> TorchModuleOp:
        return cls(**{f: _freeze(getattr(m, f)) for f in cls.module_fields})

    def to_module(self, tensors: dict[str, torch.Tensor]) -> Any:
        return self.module_types[0](**{f: getattr(self, f) for f in self.module_fields})


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


_UNARY_TRAITS = frozenset({Pure, Elementwise, ShapePreserving})


def unary_op(
    module_name: str,
    class_name: str,
    op_name: str,
    functions: tuple[Callable[..., Any], ...],
    methods: tuple[str, ...] = (),
    module: type | None = None,
    doc: str = "",
    traits: frozenset[type[Trait]] = _UNARY_TRAITS,
) -> type[Op]:
    """Build and register one elementwise unary op class (``abs``, ``sigmoid``, ...).

    With ``module`` the class is a module-backed op (``nn.Sigmoid``) without state.
    The class gets a real name and docstring; ``module_name`` is the defining module.
    """
    base: type = TorchModuleOp if module is not None else TorchOp
    ns: dict[str, Any] = {
        "__doc__": doc or f"Elementwise ``{op_name}`` ({', '.join(_spell(f) for f in functions)}).",
        "__qualname__": class_name,
        "__module__": module_name,
        "__annotations__": {},
        "name": op_name,
        "traits": traits,
        "arity": (1, 1),
        "functions": functions,
        "methods": methods,
        "signature": ("input",),
        "inputs": ("input",),
    }
    if module is not None:
        ns["module_types"] = (module,)
    cls = type(class_name, (base,), ns)
    cls = attrs.frozen(cls)
    return register_op(cls)


def _spell(f: Callable[..., Any]) -> str:
    mod = getattr(f, "__module__", None) or "torch"
    if mod.startswith("torch._C") or mod == "torch.functional":
        mod = "torch"
    return f"{mod}.{getattr(f, '__name__', repr(f))}"


def check_dim(op: Op, dim: Any, rank: int) -> None:
    """Raise naming the op when an int ``dim`` is outside ``[-rank, rank)``."""
    if isinstance(dim, int) and not -max(rank, 1) <= dim < max(rank, 1):
        raise IRError(f"op {op.name!r}: dim {dim} out of range for rank {rank}")
