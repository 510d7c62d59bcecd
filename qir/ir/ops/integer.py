"""Integer ops: what a converted (integer) model computes, one op per integer layer kind.

A converted model's layers are integer modules (``qir.nn.quantized``): code tensors in,
code tensors out, with fixed scales, integer weights, int32 biases and requantization
multipliers / shifts. The front end turns each such module call into one of these ops, so
passes and the per-march lowering read integer layers as IR, never as torch modules:

* the op's **attributes** are the layer's plain data (conv hyper-parameters, the fused
  add's multiplier and shift, the march it was converted for), its input scales, and the
  output's :class:`~qir.ir.types.QuantSpec` (``out``: dtype and scale(s), per channel for a
  high-precision qint32 output);
* its **integer state** (weights, bias, multiplier, shift, tables) arrives as trailing
  ``constant`` operands named by :meth:`~qir.ir.op.ModuleOp.param_roles`, so the state-dict
  keys survive and passes can rewrite them like any other value;
* the node's result type carries ``out`` (``tensor<1x8x4x4xqi8, QuantSpec(...)>``).

The IR names no module package (``qir.ir`` sits below ``qir.nn``): the layer that defines the
integer modules registers, per op, the module classes it is built from and a builder that
rebuilds a module from the op (:func:`register_integer_module`). Evaluating an integer op
runs that rebuilt module, so the interpreter, emit and the lowering's reference agree with
the converted model by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np
import torch

from qir.ir.op import IRError, ModuleOp, Op, Pure, Trait, bump_registry_version, register_op
from qir.ir.ops import nn as float_ops
from qir.ir.ops.integer_values import check_linear_state
from qir.ir.types import DType, QuantSpec, TensorType, Type

__all__ = [
    "IntegerModuleOp",
    "QConv",
    "integer_method_op",
    "integer_module_builder",
    "register_integer_method",
    "register_integer_module",
]

Builder = Callable[["IntegerModuleOp", dict[str, torch.Tensor]], Any]

#: op name -> builder(op, tensors) -> integer module; filled by the module library on import
_BUILDERS: dict[str, Builder] = {}


def register_integer_module(op_cls: type[IntegerModuleOp], module_cls: type, builder: Builder) -> None:
    """Build ``op_cls`` from modules of ``module_cls`` (front end) and rebuild modules with ``builder``.

    Called by the layer that defines the integer modules (``qir.nn.quantized``) for each of
    its classes; the IR itself imports none of them.
    """
    if module_cls not in op_cls.module_types:
        op_cls.module_types = (*op_cls.module_types, module_cls)
    _BUILDERS[op_cls.name] = builder
    bump_registry_version()


#: (module class, method name) -> the op a call of that method is (QFunctional's ``add``, ...)
_METHODS: dict[tuple[type, str], type[IntegerModuleOp]] = {}


def register_integer_method(op_cls: type[IntegerModuleOp], module_cls: type, builder: Builder) -> None:
    """Build ``op_cls`` from calls ``m.<method>(...)`` of modules of ``module_cls``, for each method
    in ``op_cls.ff_methods``; ``builder`` rebuilds the module from the op."""
    for method in getattr(op_cls, "ff_methods", ()):
        _METHODS[(module_cls, method)] = op_cls
    _BUILDERS[op_cls.name] = builder
    bump_registry_version()


def integer_method_op(module: Any, method: str) -> type[IntegerModuleOp] | None:
    """The op a call ``module.<method>(...)`` is, or None."""
    return _METHODS.get((type(module), method))


def integer_module_builder(name: str) -> Builder:
    try:
        return _BUILDERS[name]
    except KeyError:
        raise IRError(
            f"op {name!r}: no integer module builder registered; importing qir.nn.quantized registers qir's "
            "(qir.ir.ops.integer.register_integer_module)"
        ) from None


def _floats(v: Any) -> tuple[float, ...]:
    return tuple(float(x) for x in v)


def _opt_ints(v: Any) -> tuple[int, ...] | None:
    if v is None:
        return None
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


def _padding(v: Any) -> Any:
    return v if v is None or isinstance(v, str) else _opt_ints(v)


@attrs.frozen
class IntegerModuleOp(ModuleOp):
    """Base of the integer layer ops: an ``out`` spec, input scales, integer state operands."""

    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure})
    #: the integer state tensors, in operand order after the inputs (the module's buffer names)
    state_roles: ClassVar[tuple[str, ...]] = ()
    #: how the legality pass reads the layer: a module call or a FloatFunctional method call
    legality_form: ClassVar[str] = "module"

    def param_roles(self) -> tuple[str, ...]:
        return self.state_roles

    def to_module(self, tensors: dict[str, torch.Tensor]) -> Any:
        return integer_module_builder(self.name)(self, tensors)

    def evaluate(self, ctx: Any, operands: Sequence[Any]) -> Any:
        roles = self.param_roles()
        params = self.module_params(operands)
        module = self.to_module(dict(zip(roles, params, strict=True)))
        inputs = self.module_inputs(operands)
        call = self.method_call(inputs)
        if call is None:
            return module(*inputs)
        method, args, kwargs = call
        return getattr(module, method)(*args, **kwargs)

    def verify_values(self, operand_types: Sequence[Type], values: Sequence[torch.Tensor | None]) -> None:
        """The bound state constants' values (:meth:`verify_state`); the inputs' are not the layer's."""
        k = self.num_inputs()
        state = {r: t for r, t in zip(self.param_roles(), values[k:], strict=False) if t is not None}
        if state:
            self.verify_state(operand_types, state)

    def verify_state(self, operand_types: Sequence[Type], state: dict[str, torch.Tensor]) -> None:
        """Check the values of the state tensors the kernel trusts (``state``: role -> the bound
        constant, for the roles bound to one); the types were checked by :meth:`verify_`."""

    def method_call(self, inputs: Sequence[Any]) -> tuple[str, tuple[Any, ...], dict[str, Any]] | None:
        """``(method, args, kwargs)`` when the layer is a method of its module (QFunctional's
        ``add``), None when it is the module's forward."""
        return None

    def module_signature(self) -> Any:
        """What identifies the module this op rebuilds: nodes with equal signatures (and state)
        share one installed module when emitted."""
        return self

    def float_op(self) -> Op | type | None:
        """The float op the operator tables describe this layer as (legality checks read its
        rows and facts); a module class when the tables list the layer under a module no IR op
        stands for (``QuantStub``: its row, no facts); None when the tables have no row for it."""
        return None

    def result_type(self, shape: Sequence[int]) -> TensorType:
        """The result type at ``shape``: the ``out`` spec's dtype, the spec attached."""
        out: QuantSpec = self.out  # type: ignore[attr-defined]
        return TensorType(tuple(shape), out.dtype, out)

    def typed_result(self, t: Type) -> Type:
        """The front end's type ``t`` of the example result, with the layer's QuantSpec attached
        (a tuple-valued layer, ``qlstm_cell``, overrides it to type each element)."""
        return self.result_type(t.shape) if isinstance(t, TensorType) else t

    def compute(self, *operands: Any) -> Any:
        # no meta-tensor reference: the result type cannot be inferred (CannotInfer), the front end
        # types it from the example run with ``result_type``
        raise NotImplementedError(f"op {self.name!r} runs as its integer module (evaluate), not on meta tensors")

    def verify_(self, operand_types: Sequence[Type]) -> None:
        n = self.num_inputs() + len(self.param_roles())
        if len(operand_types) != n:
            raise IRError(
                f"op {self.name!r} takes {n} operands ({self.num_inputs()} inputs + {self.param_roles()}), "
                f"got {len(operand_types)}"
            )
        for role, t in zip(self.param_roles(), operand_types[self.num_inputs() :], strict=True):
            if not isinstance(t, TensorType):
                raise IRError(f"op {self.name!r}: state operand {role} must be a tensor, got {t}")


def _first_bad_scale(scales: Sequence[float]) -> float | None:
    """The first of ``scales`` that is not a positive finite float32 value (one rounding to float32 must
    not give 0 or beyond its largest finite value), or None: one vectorised check, as a per-channel
    qint32 output holds a scale per channel."""
    a = np.asarray(scales, dtype=np.float64)
    ok = (a > 0.0) & (a < 3.4e38) & (np.minimum(a, 3.4e38).astype(np.float32) != 0.0)
    if bool(ok.all()):
        return None
    return float(a[int(np.argmin(ok))])


_KINDS = ("conv1d", "conv2d", "conv3d", "conv_transpose2d", "linear")
#: bound on stride / dilation / padding / groups: far above any real layer, small enough that
#: the output-size arithmetic stays cheap and exact
_MAX_CONV_PARAM = 4096
_ACTS = (None, "relu", "relu6")


def conv_float_op(op: Any, bias: bool) -> Op:
    """The float conv / linear op a conv-like layer op (``qconv``, ``qat_conv``: fields ``kind``,
    ``stride``, ``padding``, ``dilation``, ``groups``, ``output_padding``, ``padding_mode``,
    ``add``, ``act``) stands for, with or without a ``bias``: what the operator tables describe it as."""
    if op.kind == "linear":
        return float_ops.Linear(bias=bias, add=op.add, act=op.act)
    if op.kind == "conv_transpose2d":
        transposed: Any = float_ops.ConvTranspose2d
        return transposed(
            stride=op.stride or (1, 1),
            padding=op.padding or (0, 0),
            output_padding=op.output_padding or (0, 0),
            dilation=op.dilation or (1, 1),
            groups=op.groups,
            bias=bias,
            add=op.add,
            act=op.act,
        )
    cls: Any = {"conv1d": float_ops.Conv1d, "conv2d": float_ops.Conv2d, "conv3d": float_ops.Conv3d}[op.kind]
    return cls(
        stride=op.stride,
        padding=op.padding,
        dilation=op.dilation,
        groups=op.groups,
        padding_mode=op.padding_mode,
        bias=bias,
        add=op.add,
        act=op.act,
    )


@register_op
@attrs.frozen
class QConv(IntegerModuleOp):
    """An integer conv / linear (+ fused add, + ReLU / ReLU6): int32 accumulation, int32 bias
    at ``s_in * s_w``, per-channel integer requantization to ``out`` (or the qint32 accumulator
    itself when ``out`` is qint32). Operands: ``input[, addend], weight, bias, multiplier,
    shift, relu6_bound`` (docs/semantics.md "Conv / linear")."""

    name: ClassVar[str] = "qconv"
    operand_names: ClassVar[tuple[str, ...]] = ("input", "addend")
    state_roles: ClassVar[tuple[str, ...]] = ("weight", "bias", "multiplier", "shift", "relu6_bound")

    kind: str
    out: QuantSpec
    in_scales: tuple[float, ...] = attrs.field(converter=_floats)
    march: str
    stride: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_ints)
    padding: Any = attrs.field(default=None, converter=_padding)
    dilation: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_ints)
    groups: int = 1
    output_padding: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_ints)
    padding_mode: str = "zeros"
    reversed_padding: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_ints)
    add: bool = False
    act: str | None = None
    add_multiplier: int = 0
    add_shift: int = 0
    extra_bits: int = 0

    def __attrs_post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise IRError(f"qconv: kind must be one of {_KINDS}, got {self.kind!r}")
        if self.act not in _ACTS:
            raise IRError(f"qconv: act must be one of {_ACTS}, got {self.act!r}")
        if len(self.in_scales) != (2 if self.add else 1):
            raise IRError(f"qconv: add={self.add} needs {2 if self.add else 1} input scale(s), got {self.in_scales}")
        if self.add and self.out.dtype is DType.qint32:
            raise IRError("qconv: a fused add has no qint32 (high-precision) output")
        if self.kind != "linear":
            self._check_conv_fields()
        if self.march not in ("bayes", "bernoulli2"):
            raise IRError(f"qconv: march must be 'bayes' or 'bernoulli2', got {self.march!r}")
        for name, lo, hi in (("add_multiplier", -(2**31) + 1, 2**31 - 1), ("add_shift", 0, 62), ("extra_bits", 0, 62)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise IRError(f"qconv: {name} must be an integer in [{lo}, {hi}], got {v!r}")

    def _check_conv_fields(self) -> None:
        """A conv's hyper-parameters, as torch would accept them (the module runs torch's conv)."""
        dims = 2 if self.kind == "conv_transpose2d" else int(self.kind[4])
        for name in ("stride", "dilation"):
            v = getattr(self, name)
            if v is None or len(v) != dims or any(not 1 <= d <= _MAX_CONV_PARAM for d in v):
                raise IRError(f"qconv: {name} must be {dims} integers in [1, {_MAX_CONV_PARAM}], got {v}")
        pad = self.padding
        if not isinstance(pad, str) and (
            pad is None or len(pad) != dims or any(not 0 <= p <= _MAX_CONV_PARAM for p in pad)
        ):
            raise IRError(
                f"qconv: padding must be 'same', 'valid' or {dims} integers in [0, {_MAX_CONV_PARAM}], got {pad}"
            )
        if isinstance(pad, str) and (pad not in ("same", "valid") or self.kind == "conv_transpose2d"):
            raise IRError(f"qconv: padding must be 'same', 'valid' or {dims} integers, got {pad!r}")
        if not 1 <= self.groups <= _MAX_CONV_PARAM:
            raise IRError(f"qconv: groups must be in [1, {_MAX_CONV_PARAM}], got {self.groups}")
        if self.padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise IRError(f"qconv: unknown padding_mode {self.padding_mode!r}")

    def num_inputs(self) -> int:
        return 2 if self.add else 1

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        x = operand_types[0]
        if isinstance(x, TensorType) and x.dtype.is_float:
            raise IRError(f"qconv takes integer codes, got {x}; quantize the input first")
        w = operand_types[self.num_inputs()]
        if isinstance(w, TensorType) and w.dtype not in (DType.int8, DType.int16, DType.qint8, DType.qint16):
            raise IRError(f"qconv: weight must hold int8 / int16 codes, got {w}")
        bad = _first_bad_scale((*self.in_scales, *self.out.scale))
        if bad is not None:
            raise IRError(f"qconv: scales must be positive and finite float32 values, got {bad!r}")
        if self.add and isinstance(operand_types[1], TensorType) and operand_types[1].dtype.is_float:
            raise IRError(f"qconv: the fused add's addend holds codes, got {operand_types[1]}")
        self._check_state(operand_types[self.num_inputs() :])

    def _out_channels(self, w: TensorType) -> int:
        return w.shape[1] * self.groups if self.kind == "conv_transpose2d" else w.shape[0]

    def _check_state(self, state: Sequence[Type]) -> None:
        """bias / multiplier / shift / relu6_bound: one integer per output channel (the module
        broadcasts them along the channel axis); a per-channel ``out`` as many scales."""
        w = state[0]
        assert isinstance(w, TensorType)
        if w.rank < 2:
            raise IRError(f"qconv: weight must have at least 2 dimensions, got {w}")
        c = self._out_channels(w)
        for role, t in zip(self.state_roles[1:], state[1:], strict=True):
            assert isinstance(t, TensorType)
            if t.shape != (c,) or t.dtype.is_float:
                raise IRError(f"qconv: {role} must hold {c} integers (one per output channel), got {t}")
        if self.out.axis is not None and len(self.out.scale) != c:
            raise IRError(f"qconv: a per-channel out needs {c} scales, got {len(self.out.scale)}")

    def verify_state(self, operand_types: Sequence[Type], state: dict[str, torch.Tensor]) -> None:
        """Requantization multiplier / shift, int32 bias, ReLU6 bound, int64 accumulator products."""
        axis = 1 if self.kind == "conv_transpose2d" else 0
        check_linear_state(
            self.name,
            state,
            operand_types[0],
            self.out.dtype,
            out_axis=axis,
            groups=self.groups,
            relu6=self.act == "relu6",
        )

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        """The float conv's shape rule on meta tensors (its operands ``input, weight, bias[, addend]``),
        after :meth:`verify_` (a float input or weight must not be typed as codes)."""
        self.verify_(operand_types)
        return self.infer_verified_type(operand_types)

    def infer_verified_type(self, operand_types: Sequence[Type]) -> Type:
        """:meth:`infer_type` without :meth:`verify_`, which the verifier has just run on these types."""
        n = self.num_inputs()
        x, w, b = operand_types[0], operand_types[n], operand_types[n + 1]
        floats = [t for t in (x, w, b, *operand_types[1:n]) if isinstance(t, TensorType)]
        if len(floats) != n + 2:
            raise IRError(f"qconv: input, weight, bias and addend must be tensors, got {list(operand_types)}")
        as_float = [TensorType(t.shape, DType.float32) for t in floats]
        try:
            shape = self.float_op().infer_type(as_float)
        except IRError as e:
            raise IRError(f"qconv: {e}") from None
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            raise IRError(f"qconv ({self.kind}) rejects its operand shapes {[str(t) for t in floats]}: {e}") from None
        assert isinstance(shape, TensorType)
        return self.result_type(shape.shape)

    def hyper_parameters(self) -> dict[str, Any]:
        """The conv hyper-parameters under the names the integer module keeps them (``hp``)."""
        return {
            "stride": self.stride,
            "padding": self.padding,
            "dilation": self.dilation,
            "groups": self.groups,
            "output_padding": self.output_padding,
            "padding_mode": self.padding_mode,
            "reversed_padding": self.reversed_padding,
        }

    def float_op(self) -> Op:
        return conv_float_op(self, bias=True)  # the integer layer always has its int32 bias

    @classmethod
    def from_module(cls, m: Any) -> QConv:
        hp = m.hp
        dtype: DType = m.dtype
        scale = m.scale.detach().reshape(-1)
        axis = None if scale.numel() == 1 else int(m.out_axis)
        return cls(
            kind={
                "Conv1d": "conv1d",
                "Conv2d": "conv2d",
                "Conv3d": "conv3d",
                "ConvTranspose2d": "conv_transpose2d",
                "Linear": "linear",
            }[m.kind],
            out=QuantSpec(tuple(float(s) for s in scale.tolist()), dtype, axis),
            in_scales=tuple(float(s.reshape(-1)[0]) for s in m.input_scales),
            march=str(m.march),
            stride=hp["stride"],
            padding=hp["padding"],
            dilation=hp["dilation"],
            groups=int(hp["groups"] or 1),
            output_padding=hp["output_padding"],
            padding_mode=str(hp["padding_mode"]),
            reversed_padding=hp["reversed_padding"],
            add=bool(m.has_add),
            act=m.act,
            add_multiplier=int(getattr(m, "add_multiplier", 0)) if m.has_add else 0,
            add_shift=int(getattr(m, "add_shift", 0)) if m.has_add else 0,
            extra_bits=int(getattr(m, "extra_bits", 0)) if m.has_add else 0,
        )
