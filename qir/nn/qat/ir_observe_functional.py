"""The ``insert-observers`` rule for FloatFunctional method nodes: ``ff.add(x, y)`` -> ``qat_functional``.

The front end turns a float FloatFunctional's method call into the float op it computes (``add``,
``cat{dim}``, ``mean{dim, keepdim}``, ``add{other=2.0}`` for ``add_scalar(x, 2.0)``, ...) with the
FloatFunctional's path as scope and the method in ``meta["float_functional"]``; a method with no float
op of its own (``add_relu``) is an opaque call of the method, whose argument templates bind to the
method's signature. The rule converts
the module with ``FloatFunctional.from_float`` (module swapping's arithmetic: the output fake quant,
or none for a high-precision ``matmul``), binds the method's arguments from the float op's fields
and operands, and reads the ``qat_functional`` op back with the QAT module's method reader — the
one that reads a prepared model's calls. A float op whose fields say something the method cannot
(``add(x, 2.0)`` spelled ``add``, a reversed operand order) is refused with the reason, so the
model is prepared by module swapping instead.
"""

from __future__ import annotations

import inspect
from typing import Any

import attrs
import torch
from torch.ao.nn.quantized import FloatFunctional as TorchFloatFunctional

from passes.insert_observers import MethodCall, register_observer_rule
from qir.ir.op import Op, resolve
from qir.ir.ops.core import Call
from qir.ir.ops.qat import FakeQuantSpec, QATModuleOp
from qir.ir.ops.qat_functional import FF_METHOD_FORMS, qat_method_reader
from qir.nn.modules.functional import SCALAR_FORMS
from qir.nn.modules.functional import FloatFunctional as FloatFF
from qir.nn.qat.functional import FloatFunctional
from qir.quantization.fake_quant_ir import fake_quant_factory
from qir.quantization.qconfig import QConfig

__all__ = ["observe_method"]


#: methods whose generated form of ``2.0 * x`` (a reversed float op) is the same call as ``x * 2.0``
_COMMUTATIVE = ("add_scalar", "mul_scalar")


class _Operand:
    """Stands for the node's operand ``index`` while the method's arguments are bound."""

    def __init__(self, index: int) -> None:
        self.index = index


def _bound_call(op: Call, module: Any, method: str, n: int) -> dict[str, Any]:
    """The method's arguments by name, from an opaque call's argument templates (a method with no
    float op of its own, such as ``add_relu``): bound to the float module's method signature."""
    xs = [_Operand(i) for i in range(n)]
    try:
        bound = inspect.signature(getattr(module, method)).bind(*resolve(op.args, xs), **resolve(op.kwargs, xs))
    except TypeError as e:
        raise NotImplementedError(f"FloatFunctional.{method}: {e}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def _bound(op: Op, method: str, n: int, module: Any = None) -> dict[str, Any]:
    """The method's arguments by name, from the float op's fields and its ``n`` operands."""
    form = FF_METHOD_FORMS.get(method)
    if form is None:
        raise NotImplementedError(f"FloatFunctional.{method} has no QAT op")
    if isinstance(op, Call):
        return _bound_call(op, module, method, n)
    kind = form[0]
    fields = attrs.asdict(op, recurse=False)
    if fields.get("reverse", False) and method not in _COMMUTATIVE:
        raise NotImplementedError(f"FloatFunctional.{method}: op {op.name!r} has its operands reversed")
    other = fields.get("other")
    xs = [_Operand(i) for i in range(n)]
    if kind == "scalar":
        if other is None:
            if n != 2:
                raise NotImplementedError(f"FloatFunctional.{method}: expected a tensor and a number, got {n} operands")
            return {"x": xs[0], "y": xs[1]}
        if n != 1:
            raise NotImplementedError(f"FloatFunctional.{method}: expected one tensor operand, got {n}")
        return {"x": xs[0], "y": other}
    if other is not None:
        raise NotImplementedError(f"FloatFunctional.{method}: op {op.name!r} takes a number ({other!r}), not a tensor")
    if kind in ("list", "unary") and method not in ("exp", "ceil", "floor") and "dim" not in fields:
        raise NotImplementedError(f"FloatFunctional.{method}: op {op.name!r} has no dim")
    if kind == "list":
        return {"x": xs, "dim": fields["dim"]}
    if kind == "binary":
        if n != 2:
            raise NotImplementedError(f"FloatFunctional.{method}: expected two operands, got {n}")
        return {"x": xs[0], "y": xs[1]}
    if n != 1:
        raise NotImplementedError(f"FloatFunctional.{method}: expected one operand, got {n}")
    if method in ("mean", "sum"):
        return {"x": xs[0], "dim": fields["dim"], "keepdim": fields.get("keepdim", False)}
    return {"x": xs[0]}


def _scalar_method(op: Op, method: str, n: int) -> tuple[str, float]:
    """``add_scalar`` / ``mul_scalar`` for ``add`` / ``sub`` / ``mul`` called with one tensor and a
    number (SCALAR_FORMS: the QAT and quantized modules run such a call as the scalar method)."""
    form = SCALAR_FORMS.get(method)
    if form is None or isinstance(op, Call) or n != 1:
        return method, 1.0
    other = getattr(op, "other", None)
    if other is None or (method == "sub" and getattr(op, "reverse", False)):
        return method, 1.0
    return form


def observe_method(
    op: Op,
    call: MethodCall,
    tensors: dict[str, torch.Tensor],
    activation: FakeQuantSpec | None,
    weight: FakeQuantSpec | None,
) -> tuple[QATModuleOp, dict[str, torch.Tensor]]:
    """The ``qat_functional`` op of one FloatFunctional method node and its output fake quant's state."""
    if not isinstance(call, MethodCall):
        raise TypeError(f"op {op.name!r}: a FloatFunctional rule takes a MethodCall, got {type(call).__name__}")
    method, sign = _scalar_method(op, call.method, call.operands)
    bound = _bound(op, method, call.operands, call.module)
    if sign != 1.0:  # sub(x, 2.0) is add_scalar(x, -2.0)
        bound["y"] = sign * bound["y"]
    qconfig = QConfig(activation=None if activation is None else fake_quant_factory(activation), weight=None)
    qat = FloatFunctional.from_float(call.module, qconfig)
    reader = qat_method_reader(qat)
    if reader is None:
        raise NotImplementedError(f"{type(qat).__name__} has no method reader (qir.nn.qat.ir_ops_functional)")
    qat_op, inputs = reader(qat, method, bound)
    order = [v.index if isinstance(v, _Operand) else None for v in inputs]
    if order != list(range(call.operands)):
        raise NotImplementedError(
            f"FloatFunctional.{call.method}: the QAT op takes its operands as {order}, the node has {call.operands}"
        )
    state = dict(qat.named_buffers(remove_duplicate=False))
    return qat_op, {role: state[role] for role in qat_op.param_roles()}


def _register() -> None:
    for cls in (FloatFF, TorchFloatFunctional):
        register_observer_rule(cls, observe_method)  # type: ignore[arg-type]


_register()
