"""The QAT FloatFunctional op: what a prepared model's ``self.ff.add(x, y)`` computes.

A prepared model's FloatFunctional (``qir.nn.qat.FloatFunctional``, one per call site, the
generated ``_generated_add_0`` too) computes each method in float and fake-quantizes the result
with its ``activation_post_process``. The front end turns each method call into one
``qat_functional`` node: the method and its literal arguments are attributes, the output fake
quant a :class:`~qir.ir.ops.qat.FakeQuantSpec` (None only for a high-precision ``matmul``), the
tensor arguments the leading operands, the fake quant's state the trailing ``constant`` operands
keyed by state-dict name (``_generated_add_0.activation_post_process.scale``, ...).

The method families and their literal fields mirror the integer ops the ``quantize`` pass makes
of them (:mod:`qir.ir.ops.integer_functional`): ``add`` / ``add_relu`` / ``sub`` / ``mul`` /
``div`` / ``maximum`` / ``minimum`` take two tensors, ``add_scalar`` / ``mul_scalar`` a tensor
and ``scalar`` (None: a number computed at run time, operand 1), ``matmul`` two tensors and
``x_trans`` / ``y_trans``, ``cat`` / ``concat`` / ``concatenate`` / ``stack`` ``count`` tensors
and ``dim``, ``mean`` / ``sum`` a tensor, ``dim`` and ``keepdim``, ``exp`` / ``ceil`` / ``floor``
a tensor.

As for the other QAT ops, the layer that defines the module registers how it is read from a
module and rebuilt (:func:`register_qat_functional`); evaluating the op calls the method on the
rebuilt module, so ``run_graph`` observes exactly as the prepared model does, and ``emit``
installs the module at the node's scope (calls that share a module share one installed module).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch

from qir.ir.meta_shapes import binary_shape, cat_shape, meta_result
from qir.ir.op import OP_REGISTRY, IRError, Op, bump_registry_version, register_op
from qir.ir.ops.qat import FakeQuantSpec, QATModuleOp, fake_quant_roles, is_int, is_number
from qir.ir.types import DType, ScalarType, TensorType, Type

__all__ = ["FF_METHOD_FORMS", "QATFunctional", "qat_method_reader", "register_qat_functional"]

#: method -> (its tensor operands: "binary", "scalar", "list" or "unary"; the literal fields it takes)
FF_METHOD_FORMS: dict[str, tuple[str, tuple[str, ...]]] = {
    **{m: ("binary", ()) for m in ("add", "add_relu", "sub", "mul", "div", "maximum", "minimum")},
    "matmul": ("binary", ("x_trans", "y_trans")),
    "add_scalar": ("scalar", ("scalar",)),
    "mul_scalar": ("scalar", ("scalar",)),
    **{m: ("list", ("count", "dim")) for m in ("cat", "concat", "concatenate", "stack")},
    "mean": ("unary", ("dim", "keepdim")),
    "sum": ("unary", ("dim", "keepdim")),
    **{m: ("unary", ()) for m in ("exp", "ceil", "floor")},
}
#: the float op the operator tables describe a method as (legality), when its name differs
_FLOAT_NAMES = {"add_relu": "add", "add_scalar": "add", "mul_scalar": "mul", "concat": "cat", "concatenate": "cat"}
#: the literal fields' defaults (a field a method does not take must keep its default)
_DEFAULTS: dict[str, Any] = {"scalar": None, "x_trans": False, "y_trans": False, "count": 1, "dim": None}
_DEFAULTS["keepdim"] = False

#: reader(module, method, arguments by name) -> (op, tensor operands); builder(op, tensors) -> module
MethodReader = Callable[[Any, str, dict[str, Any]], tuple["QATFunctional", list[Any]]]
Builder = Callable[["QATFunctional", dict[str, torch.Tensor]], Any]
_READERS: dict[type, MethodReader] = {}
_BUILDER: list[Builder] = []


def register_qat_functional(module_cls: type, reader: MethodReader, builder: Builder) -> None:
    """Read method calls of ``module_cls`` modules with ``reader`` (front end) and rebuild the module
    of a ``qat_functional`` op with ``builder``. Called by ``qir.nn.qat``."""
    _READERS[module_cls] = reader
    _BUILDER[:] = [builder]
    bump_registry_version()


def qat_method_reader(module: Any) -> MethodReader | None:
    """The reader of ``module``'s method calls (a QAT FloatFunctional), or None."""
    return _READERS.get(type(module))


def _dim(v: Any) -> Any:
    """A list of dims as a tuple (a text-form literal); anything else as given, for the field check."""
    return tuple(v) if isinstance(v, list) else v


@register_op
@attrs.frozen
class QATFunctional(QATModuleOp):
    """``out_fq(method(*tensors, **literals))`` of a QAT FloatFunctional call site.

    Operands: the tensor arguments (``count`` of them for the list methods; for ``add_scalar`` /
    ``mul_scalar`` with ``scalar`` None, the run-time number second), then the output fake
    quant's state (``activation_post_process.*``; none for a high-precision ``matmul``)."""

    name: ClassVar[str] = "qat_functional"
    operand_names: ClassVar[tuple[str, ...]] = ("x", "y")
    legality_form: ClassVar[str] = "float_functional"

    method: str
    out_fq: FakeQuantSpec | None
    scalar: float | None = None
    x_trans: bool = False
    y_trans: bool = False
    count: int = 1
    dim: int | tuple[int, ...] | None = attrs.field(default=None, converter=_dim)
    keepdim: bool = False

    def __attrs_post_init__(self) -> None:
        form = FF_METHOD_FORMS.get(self.method)
        if form is None:
            raise IRError(f"qat_functional: method must be one of {tuple(FF_METHOD_FORMS)}, got {self.method!r}")
        kind, fields = form
        for field, default in _DEFAULTS.items():
            v = getattr(self, field)
            if field not in fields and v != default:
                raise IRError(f"qat_functional: {self.method} takes no {field} (got {field}={v!r})")
        if self.out_fq is None and self.method != "matmul":
            raise IRError(f"qat_functional: {self.method} needs an output fake quant; only matmul may have none")
        if self.out_fq is not None and self.out_fq.observer.axis is not None:
            raise IRError(
                f"qat_functional: the output fake quant must be per tensor, got axis {self.out_fq.observer.axis}"
            )
        for field in ("x_trans", "y_trans", "keepdim"):
            if not isinstance(getattr(self, field), bool):
                raise IRError(f"qat_functional: {field} must be a boolean, got {getattr(self, field)!r}")
        if self.scalar is not None and (not is_number(self.scalar) or not abs(self.scalar) < 2**62):
            raise IRError(f"qat_functional: scalar must be a finite number (or None: run time), got {self.scalar!r}")
        if not is_int(self.count) or not 1 <= self.count <= 65536:
            raise IRError(f"qat_functional: count must be an integer in [1, 65536], got {self.count!r}")
        if kind == "list" and not is_int(self.dim):
            raise IRError(f"qat_functional: {self.method} needs an integer dim, got {self.dim!r}")
        if kind == "unary" and self.dim is not None:
            dims = self.dim if isinstance(self.dim, tuple) else (self.dim,)
            if not dims or not all(is_int(d) for d in dims):
                raise IRError(f"qat_functional: {self.method}'s dim must be None or integers, got {self.dim!r}")

    # -- operands --------------------------------------------------------------------------------
    def num_inputs(self) -> int:
        kind = FF_METHOD_FORMS[self.method][0]
        if kind == "list":
            return self.count
        if kind == "scalar":
            return 1 if self.scalar is not None else 2
        return 2 if kind == "binary" else 1

    def param_roles(self) -> tuple[str, ...]:
        return fake_quant_roles("activation_post_process", self.out_fq)

    def module_signature(self) -> Any:
        # every method of one FloatFunctional shares its module: emit installs it once per scope
        return (QATFunctional, self.out_fq)

    def method_call(self, inputs: Sequence[Any]) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        """``(method, args, kwargs)`` of the call on the module."""
        kind = FF_METHOD_FORMS[self.method][0]
        if kind == "list":
            return self.method, (list(inputs),), {"dim": self.dim}
        if kind == "scalar":
            return self.method, (inputs[0], self.scalar if self.scalar is not None else inputs[1]), {}
        if self.method == "matmul":
            return self.method, tuple(inputs), {"x_trans": self.x_trans, "y_trans": self.y_trans}
        if self.method in ("mean", "sum"):
            dim = None if self.dim is None else list(self.dim) if isinstance(self.dim, tuple) else self.dim
            return self.method, tuple(inputs), {"dim": dim, "keepdim": self.keepdim}
        return self.method, tuple(inputs), {}

    @classmethod
    def from_call(
        cls, out_fq: FakeQuantSpec | None, method: str, bound: dict[str, Any]
    ) -> tuple[QATFunctional, list[Any]]:
        """The op and its tensor operands for ``m.<method>(**bound)`` (``bound``: arguments by name)."""
        form = FF_METHOD_FORMS.get(method)
        if form is None:
            raise IRError(f"FloatFunctional.{method} has no QAT op (methods: {', '.join(FF_METHOD_FORMS)})")
        kind, fields = form
        kw: dict[str, Any] = {}
        if kind == "list":
            tensors = list(bound["x"])
            kw = {"count": len(tensors), "dim": bound["dim"]}
        elif kind == "scalar":
            y = bound["y"]
            number = is_number(y)
            tensors = [bound["x"]] if number else [bound["x"], y]
            kw = {"scalar": float(y) if number else None}
        elif kind == "binary":
            tensors = [bound["x"], bound["y"]]
            kw = {f: bound.get(f, False) for f in fields}
        else:
            tensors = [bound["x"]]
            kw = {f: bound[f] for f in fields}
        return cls(method=method, out_fq=out_fq, **kw), tensors

    # -- semantics -------------------------------------------------------------------------------
    def to_module(self, tensors: dict[str, torch.Tensor]) -> Any:
        if not _BUILDER:
            raise IRError(
                "op 'qat_functional': no QAT FloatFunctional builder registered; importing qir.nn.qat registers "
                "qir's (qir.ir.ops.qat_functional.register_qat_functional)"
            )
        return _BUILDER[0](self, tensors)

    def evaluate(self, ctx: Any, operands: Sequence[Any]) -> Any:
        module = self.to_module(dict(zip(self.param_roles(), self.module_params(operands), strict=True)))
        module.train(bool(getattr(ctx, "training", False)))
        method, args, kwargs = self.method_call(self.module_inputs(operands))
        return getattr(module, method)(*args, **kwargs)

    def compute(self, *operands: Any) -> Any:
        """The float method's result on meta tensors (shape and dtype: the fake quant keeps both)."""
        inputs = list(operands[: self.num_inputs()])
        if any(isinstance(x, torch.Tensor) and x.device.type != "meta" for x in inputs):
            raise NotImplementedError("qat_functional runs as its QAT module (evaluate)")
        method, args, kwargs = self.method_call(inputs)
        if method in ("cat", "concat", "concatenate"):
            ts = list(args[0])
            if ts and len({t.dtype for t in ts}) == 1 and ts[0].is_floating_point():  # by formula: no meta kernel
                shape = cat_shape([tuple(t.shape) for t in ts], kwargs["dim"])
                if shape is not None:
                    return meta_result(shape, ts[0])
            return torch.cat(ts, dim=kwargs["dim"])
        if method == "stack":
            return torch.stack(args[0], dim=kwargs["dim"])
        x = args[0]
        if method == "matmul":
            y = args[1]
            return torch.matmul(x.transpose(-2, -1) if self.x_trans else x, y.transpose(-2, -1) if self.y_trans else y)
        if method in ("mean", "sum"):
            dim = kwargs["dim"]
            reduce = x.mean if method == "mean" else x.sum
            return reduce() if dim is None else reduce(dim=dim, keepdim=self.keepdim)
        if method in ("exp", "ceil", "floor", "add_scalar", "mul_scalar"):
            return torch.empty_like(x)
        shape = binary_shape(x, args[1])  # the elementwise binary methods: the broadcast shape
        return meta_result(shape, x) if shape is not None else torch.add(x, args[1])

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        metas: list[Any] = []
        for t in operand_types[: self.num_inputs()]:
            if isinstance(t, TensorType):
                metas.append(torch.empty(t.shape, dtype=t.dtype.to_torch(), device="meta"))
            elif isinstance(t, ScalarType):
                metas.append(1.0)  # the run-time number of add_scalar / mul_scalar
            else:
                raise IRError(f"op 'qat_functional' ({self.method}) takes tensors, got {t}")
        try:
            out = self.compute(*metas)
        except (RuntimeError, IndexError, ValueError, TypeError) as e:
            raise IRError(f"op 'qat_functional' ({self.method}) rejects its operand shapes: {e}") from None
        return TensorType(tuple(out.shape), DType.from_torch(out.dtype))

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        self.infer_type(operand_types)

    def label(self) -> str:
        return f"op 'qat_functional' ({self.method})"

    def check_input(self, index: int, t: Type) -> None:
        if index > 0 and FF_METHOD_FORMS[self.method][0] == "scalar":  # add_scalar's run-time number
            if not isinstance(t, ScalarType) or t.kind not in ("int", "float"):
                raise IRError(f"{self.label()}: operand {index} must be an int or a float, got {t}")
            return
        super().check_input(index, t)

    # -- legality --------------------------------------------------------------------------------
    def float_op(self) -> Op | None:
        name = _FLOAT_NAMES.get(self.method, self.method)
        cls: Callable[..., Op] | None = OP_REGISTRY.get(name)
        if cls is None:
            return None
        kwargs: dict[str, Any] = {}
        if self.method in ("add_scalar", "mul_scalar"):
            kwargs = {"other": self.scalar}
        elif FF_METHOD_FORMS[self.method][0] == "list":
            kwargs = {"dim": self.dim}
        elif self.method in ("mean", "sum"):
            kwargs = {"dim": self.dim if not is_int(self.dim) else (self.dim,), "keepdim": self.keepdim}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError, IRError):
            return None
