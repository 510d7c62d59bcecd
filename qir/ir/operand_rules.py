"""Operand rules the verifier adds to type inference: what torch's CPU kernels reject at run
time but inference on meta tensors lets through (meta kernels skip dtype checks), and what
an op cannot infer at all (opaque calls, scalar operands).

* :func:`check_operands`: an op that computes on a tensor gets a tensor as operand 0, not
  an object or a tuple; the state of a module op (weight, bias, running statistics) has
  the float dtype of its input (``conv2d`` of f32 with a bool bias, ``batch_norm`` with a
  qi8 mean); ``matmul`` / ``einsum`` operands share one float dtype; elementwise ops do
  not mix quantized and float tensors.
* :func:`run_on_meta`: an op whose type cannot be inferred from types alone (scalar
  operands, opaque calls of allowlisted torch functions and Tensor methods) runs on meta
  tensors (no memory, no data) with the scalars the verifier knows (sizes read from static
  shapes) or stand-ins, so operands of the wrong kind fail in ``verify``; a small call
  (operands and result under :data:`SMALL_CALL_ELEMENTS`) also runs on zeros, for the
  value checks meta kernels skip.
* :func:`value_matches`: a graph input's default is a value of its declared type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from qir.ir.call_targets import builtin_call_target, method_allowed
from qir.ir.op import Elementwise, HasWeight, IRError, ModuleOp, Op, Quantization, SameDtypeOperands, resolve
from qir.ir.types import ObjectType, ScalarType, SequenceType, TensorType, Type

#: module-op state roles that are counters, not float tensors
_COUNTER_ROLES = frozenset({"num_batches_tracked"})


def check_operands(op: Op, operand_types: Sequence[Type]) -> None:
    """Raise :class:`IRError` when the operands cannot be what ``op``'s kernel computes on."""
    computes_on_tensor = isinstance(op, ModuleOp) or op.has_trait(Elementwise) or op.has_trait(HasWeight)
    if computes_on_tensor and operand_types and isinstance(operand_types[0], (ObjectType, SequenceType)):
        raise IRError(f"op {op.name!r}: operand 0 must be a tensor, got {operand_types[0]}")
    if not operand_types or not isinstance(operand_types[0], TensorType):
        return
    x = operand_types[0]
    if isinstance(op, ModuleOp) and not op.has_trait(Quantization) and x.dtype.is_float:
        roles = op.param_roles()
        for role, t in zip(roles, op.module_params(operand_types), strict=False):
            if role in _COUNTER_ROLES or not isinstance(t, TensorType):
                continue
            if t.dtype.to_torch() != x.dtype.to_torch():
                raise IRError(
                    f"op {op.name!r}: {role} is {t} but the input is {x.dtype.value}; "
                    f"torch's kernel needs the same float dtype"
                )
    if isinstance(op, ModuleOp):
        _check_param_shapes(op, x, op.module_params(operand_types))
    if op.has_trait(SameDtypeOperands):
        dtypes = {t.dtype for t in operand_types if isinstance(t, TensorType)}
        if len(dtypes) > 1 and any(d.is_float for d in dtypes):
            raise IRError(
                f"op {op.name!r} needs operands of one dtype (torch does not promote here), got "
                f"{', '.join(sorted(d.value for d in dtypes))}"
            )
    if op.has_trait(Elementwise) and not op.has_trait(Quantization):
        dts = [t.dtype for t in operand_types if isinstance(t, TensorType)]
        # codes typed by their layer (qi8) meet codes read from a buffer (i8): both integers
        if any(d.is_quantized for d in dts) and any(d.is_float for d in dts):
            raise IRError(f"op {op.name!r} mixes quantized and float tensors: {', '.join(map(str, operand_types))}")


def _check_param_shapes(op: ModuleOp, x: TensorType, params: Sequence[Type]) -> None:
    """Bias length = output channels; batch-norm state length = input channels.

    Meta kernels do not check these (``F.conv2d`` on meta accepts any bias), CPU ones do."""
    p = {r: t for r, t in zip(op.param_roles(), params, strict=False) if isinstance(t, TensorType)}
    if op.has_trait(HasWeight) and "bias" in p and "weight" in p and p["weight"].rank >= 2:
        w = p["weight"]
        groups = getattr(op, "groups", 1)
        axis = getattr(op, "out_channel_axis", 0)
        out = w.shape[axis] * (groups if axis else 1)
        if p["bias"].shape != (out,):
            raise IRError(f"op {op.name!r}: bias is {p['bias']} but the weight {w} gives {out} output channels")
    if x.rank >= 2:
        for role in op.channel_state:
            if role in p and p[role].shape != (x.shape[1],):
                raise IRError(f"op {op.name!r}: {role} is {p[role]} but the input has {x.shape[1]} channels")


def _meta_value(t: Type) -> Any:
    if isinstance(t, TensorType):
        return torch.empty(t.shape, dtype=t.dtype.to_torch(), device="meta")
    raise LookupError


def _result_type(out: Any) -> Type | None:
    if isinstance(out, torch.Tensor):
        from qir.ir.types import DType

        try:
            return TensorType(tuple(out.shape), DType.from_torch(out.dtype))
        except (KeyError, ValueError):
            return None
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        elems = [_result_type(o) for o in out]
        if any(e is None for e in elems):
            return None
        return SequenceType(tuple(e for e in elems if e is not None), "list" if isinstance(out, list) else "tuple")
    return None


def _same(declared: Type, got: Type) -> bool:
    if isinstance(declared, TensorType) and isinstance(got, TensorType):
        return declared.shape == got.shape and declared.dtype.to_torch() == got.dtype.to_torch()
    if isinstance(declared, SequenceType) and isinstance(got, SequenceType):
        return len(declared.elements) == len(got.elements) and all(
            _same(d, g) for d, g in zip(declared.elements, got.elements, strict=True)
        )
    return not isinstance(declared, (TensorType, SequenceType))


def allowed_call(op: Op) -> Any:
    """The torch function or Tensor method an opaque ``call`` names on the built-in allowlist,
    or None (the user's own functions may have effects: they are never run by ``verify``)."""
    kind, target = op.kind, op.target  # type: ignore[attr-defined]
    if "device" in op.kwargs:  # type: ignore[attr-defined]
        return None  # would leave the meta device
    if kind == "function":
        return builtin_call_target(target)
    if kind == "method" and method_allowed(target) and callable(getattr(torch.Tensor, target, None)):
        return getattr(torch.Tensor, target)
    return None


def run_on_meta(op: Op, values: Sequence[Any], exact: bool) -> tuple[bool, Any]:
    """Compute ``op`` on meta tensors and operand values: (ran, result).

    ``exact``: every non-tensor operand holds its real value, so any failure is the graph's
    fault. Otherwise scalars are stand-ins (1, 0.5, True) of the declared kind and only a
    ``TypeError`` / ``AttributeError`` (an operand of the wrong kind: a float where torch
    wants a tensor, ``.shape`` of an int) is reported.
    """
    if op.name == "call":
        fn = allowed_call(op)
        if fn is None:
            return False, None
        args = resolve(tuple(op.args), values)  # type: ignore[attr-defined]
        kwargs = resolve(dict(op.kwargs), values)  # type: ignore[attr-defined]
        if op.kind == "method" and not (args and isinstance(args[0], torch.Tensor)):  # type: ignore[attr-defined]
            return False, None  # a method of another object (a FloatFunctional): not a Tensor method

        def call() -> Any:
            return fn(*args, **kwargs)

    else:

        def call() -> Any:
            return op.compute(*values)

    try:
        with torch.device("meta"):
            out = call()
    except NotImplementedError:
        return False, None
    except (TypeError, AttributeError) as e:  # decided by operand kinds, which stand-ins share
        raise IRError(f"op {op.name!r} rejects its operand kinds: {type(e).__name__}: {e}") from None
    except Exception as e:
        text = str(e)
        if not exact or "meta" in text.lower() or "data-dependent" in text.lower():
            return False, None  # needs real data (item(), nonzero(), copies to the CPU)
        first = text.splitlines()[0] if text else ""
        raise IRError(f"op {op.name!r} rejects its operands: {type(e).__name__}: {first}") from None
    if op.name == "call" and exact:
        _rerun_small_call(op, values, out)
    return True, out


#: an allowlisted call whose operands and result stay under this many elements is also run
#: on zeros: meta kernels skip value checks the CPU makes (a scalar that overflows float32)
SMALL_CALL_ELEMENTS = 4096


def _numel(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel()
    if isinstance(v, (tuple, list)):
        return sum(_numel(x) for x in v)
    return 0


def _rerun_small_call(op: Op, values: Sequence[Any], meta_out: Any) -> None:
    if _numel(meta_out) > SMALL_CALL_ELEMENTS or _numel(list(values)) > SMALL_CALL_ELEMENTS:
        return
    real = [torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v for v in values]
    fn = allowed_call(op)
    if fn is None:
        return
    try:
        fn(*resolve(tuple(op.args), real), **resolve(dict(op.kwargs), real))  # type: ignore[attr-defined]
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise IRError(f"op {op.name!r} rejects its operands: {type(e).__name__}: {first}") from None


def result_type(out: Any) -> Type | None:
    """The IR type of a meta result, when it is tensors (else None: not compared)."""
    return _result_type(out)


def same_type(declared: Type, got: Type) -> bool:
    return _same(declared, got)


STAND_INS = {"int": 1, "float": 0.5, "bool": True}


def value_matches(value: Any, t: Type) -> bool:
    """True when ``value`` (an input's default) is a run-time value of type ``t``."""
    if isinstance(t, ScalarType):
        if t.kind == "bool":
            return type(value) is bool
        if t.kind == "int":
            return type(value) is int
        return type(value) in (int, float)
    if isinstance(t, SequenceType):
        kinds: dict[str, tuple[type, ...]] = {"tuple": (tuple,), "list": (list,), "size": (tuple, torch.Size)}
        if not isinstance(value, kinds.get(t.kind, (tuple, list))):
            return False
        items: Sequence[Any] = value  # type: ignore[assignment]
        return len(items) == len(t.elements) and all(
            value_matches(v, e) for v, e in zip(items, t.elements, strict=True)
        )
    if isinstance(t, TensorType):
        return isinstance(value, torch.Tensor) and t.admits(value.shape) and value.dtype == t.dtype.to_torch()
    if isinstance(t, ObjectType):
        return t.name in (type(value).__name__, type(value).__qualname__, "object")
    return True
