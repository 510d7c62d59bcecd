"""QAT ops: what a prepared (QAT) model computes, one op per QAT layer kind.

A ``prepare_qat_fx`` model's layers are QAT modules: float tensors in and out, with fake
quants on the weight and the output. The front end turns each such module call into one
of these ops, so passes (``quantize``) read the trainable model as IR:

* the op's **attributes** are the layer's plain data: the conv hyper-parameters, the fused
  add / activation, and each fake quant as a :class:`FakeQuantSpec` (its observer as an
  :class:`~qir.ir.ops.quant.ObserverSpec`, the fake-quant class and its switches);
* its **state** (weight, bias, and every buffer of the fake quants and their observers)
  arrives as trailing ``constant`` operands keyed by state-dict name
  (``conv.weight_fake_quant.observer.min_val``), so emit rebuilds a trainable module with
  the same keys, sharing the tensors.

The IR names no module package (``qir.ir`` sits below ``qir.nn``): the layer that defines the
QAT modules registers, per op, the module classes it reads, a reader (module -> op) and a
builder (op + tensors -> module) with :func:`register_qat_module`. Evaluating a QAT op runs
the rebuilt module, so the interpreter and emit agree with the prepared model by
construction. The rebuilt module is not bound to the integer grid (its binding points at the
producers' fake-quant modules, which an op does not own): run_graph computes the float
fake-quant forward, and ``prepare_qat_fx`` binds the emitted model again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F

from qir.ir.meta_shapes import conv_shape, linear_shape, meta_result
from qir.ir.op import (
    IRError,
    ModuleOp,
    Op,
    Quantization,
    Trait,
    bump_registry_version,
    meta_tensor,
    meta_type,
    register_op,
)
from qir.ir.ops.integer import _opt_ints, _padding, conv_float_op
from qir.ir.ops.quant import ObserverSpec
from qir.ir.printer import register_attr_class
from qir.ir.types import TensorType, Type

__all__ = [
    "FAKE_QUANT_STATES",
    "FakeQuantSpec",
    "QATConv",
    "QATDequantStub",
    "QATModuleOp",
    "QATQuantStub",
    "fake_quant_roles",
    "is_int",
    "is_number",
    "register_qat_module",
]

Reader = Callable[[Any], "QATModuleOp"]
Builder = Callable[["QATModuleOp", dict[str, torch.Tensor]], Any]

#: op name -> builder(op, tensors) -> QAT module; filled by the module library on import
_BUILDERS: dict[str, Builder] = {}
#: module class -> reader(module) -> op
_READERS: dict[type, Reader] = {}

#: the fake-quant states of ``set_fake_quantize`` (None: never set)
FAKE_QUANT_STATES = (None, "qat", "calibration", "validation")
#: observer kinds whose state is min / max / scale only, and the extra buffers of the others
_HISTOGRAM_KINDS = ("percentile",)


@register_attr_class
@attrs.frozen
class FakeQuantSpec:
    """A fake-quant module as data: its observer, whether it is the calibration class, its switches.

    ``observe`` / ``fake_quant`` are the module's ``observer_enabled`` / ``fake_quant_enabled``;
    ``state`` the :class:`~qir.quantization.FakeQuantState` value ``set_fake_quantize`` last set.
    """

    observer: ObserverSpec
    calibration: bool = False
    observe: bool = True
    fake_quant: bool = True
    state: str | None = "qat"

    def __attrs_post_init__(self) -> None:
        if self.state not in FAKE_QUANT_STATES:
            raise IRError(f"fake quant state must be one of {FAKE_QUANT_STATES}, got {self.state!r}")

    def roles(self) -> tuple[str, ...]:
        """The module's state-dict entries, relative to the fake quant (``observer.min_val``, ...)."""
        extra = ("observer.histogram", "observer.hist_range") if self.observer.observer in _HISTOGRAM_KINDS else ()
        return (
            "scale",
            "zero_point",
            "observer.min_val",
            "observer.max_val",
            "observer.scale",
            *extra,
            "observer.nonfinite_batches",
        )


def fake_quant_roles(prefix: str, spec: FakeQuantSpec | None) -> tuple[str, ...]:
    return () if spec is None else tuple(f"{prefix}.{r}" for r in spec.roles())


def register_qat_module(op_cls: type[QATModuleOp], module_cls: type, reader: Reader, builder: Builder) -> None:
    """Build ``op_cls`` from modules of ``module_cls`` with ``reader`` (front end) and rebuild
    modules with ``builder``. Called by the layer that defines the QAT modules (``qir.nn.qat``)."""
    if module_cls not in op_cls.module_types:
        op_cls.module_types = (*op_cls.module_types, module_cls)
    _READERS[module_cls] = reader
    _BUILDERS[op_cls.name] = builder
    bump_registry_version()


def _builder(name: str) -> Builder:
    try:
        return _BUILDERS[name]
    except KeyError:
        raise IRError(
            f"op {name!r}: no QAT module builder registered; importing qir.nn.qat registers qir's "
            "(qir.ir.ops.qat.register_qat_module)"
        ) from None


def is_int(v: Any) -> bool:
    """An integer attribute value (``True`` is a bool, not a count or a dim)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """An int or float attribute value, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_state(op: Op, roles: Sequence[str], types: Sequence[Type], float_roles: Sequence[str]) -> None:
    for role, t in zip(roles, types, strict=True):
        if not isinstance(t, TensorType):
            raise IRError(f"op {op.name!r}: state operand {role} must be a tensor, got {t}")
        if role in float_roles and not t.dtype.is_float:
            raise IRError(f"op {op.name!r}: state operand {role} must be a float tensor, got {t}")


@attrs.frozen
class QATModuleOp(ModuleOp):
    """Base of the QAT layer ops: float inputs, state operands, fake quants as attributes.

    Not Pure: in training, observing updates the fake quants' state (the constants). The
    Quantization trait: the state mixes dtypes (int32 zero points, int64 counters) by design."""

    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Quantization})
    legality_form: ClassVar[str] = "module"
    #: its input is on a quantized grid (the producer's scale is an input scale of the conversion);
    #: False for the QuantStub, which reads float
    reads_codes: ClassVar[bool] = True
    #: its result is integer codes after conversion; False for the DeQuantStub, which gives float
    makes_codes: ClassVar[bool] = True
    #: who registers the module classes (docs/ir-ops.md lists this, not the import-dependent classes)
    registered_by: ClassVar[str] = "QAT modules of qir.nn.qat"

    @classmethod
    def from_module(cls, module: Any) -> QATModuleOp:
        reader = _READERS.get(type(module))
        if reader is None:
            raise NotImplementedError(f"op {cls.name!r}: no reader registered for {type(module).__name__}")
        return reader(module)

    def to_module(self, tensors: dict[str, torch.Tensor]) -> Any:
        return _builder(self.name)(self, tensors)

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The module call's arguments for the data operands: them in order; a layer whose forward
        takes a list or a nested state (RoIAlign's boxes, an LSTM cell's ``(h, c)``) regroups them."""
        return tuple(inputs), {}

    def evaluate(self, ctx: Any, operands: Sequence[Any]) -> Any:
        module = self.to_module(dict(zip(self.param_roles(), self.module_params(operands), strict=True)))
        module.train(bool(getattr(ctx, "training", False)))
        args, kwargs = self.module_call(self.module_inputs(operands))
        return module(*args, **kwargs)

    def module_signature(self) -> Any:
        return self

    def reads_codes_at(self, index: int) -> bool | None:
        """Whether input ``index`` is quantized (codes after conversion): all of them for a layer that
        :attr:`reads_codes`; a RoIAlign's boxes stay float (False); None: codes when a quantized layer
        made them, else float (an AnchorGenerator's images, whose values it never reads)."""
        return self.reads_codes

    def own_per_site(self, role: str) -> bool:
        """Whether each call site of a module called at several places holds state ``role`` for
        itself (its output observer) rather than sharing the first call's (weights, weight fake
        quants), as module swapping ties them (qir/quantization/shared_calls.py)."""
        return role.startswith("activation_post_process")

    def float_op(self) -> Op | type | None:
        """The float op the operator tables describe this layer as (legality)."""
        return None

    def compute(self, *operands: Any) -> Any:
        raise NotImplementedError(f"op {self.name!r} runs as its QAT module (evaluate), not on meta tensors")

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        x = operand_types[0]
        if not isinstance(x, TensorType):
            raise IRError(f"op {self.name!r}: input must be a tensor, got {x}")
        return x

    def verify_(self, operand_types: Sequence[Type]) -> None:
        n = self.num_inputs() + len(self.param_roles())
        if len(operand_types) != n:
            raise IRError(
                f"{self.label()} takes {n} operands ({self.num_inputs()} inputs + {self.param_roles()}), "
                f"got {len(operand_types)}"
            )
        for i, t in enumerate(operand_types[: self.num_inputs()]):
            self.check_input(i, t)
        _check_state(self, self.param_roles(), operand_types[self.num_inputs() :], ())

    def label(self) -> str:
        """How verify's errors name this op."""
        return f"op {self.name!r}"

    def check_input(self, index: int, t: Type) -> None:
        """Input operand ``index`` is what the layer computes on: a float tensor (QAT computes in float)."""
        if not isinstance(t, TensorType) or not t.dtype.is_float:
            raise IRError(f"{self.label()}: input {index} must be a float tensor (QAT computes in float), got {t}")


_KINDS = ("conv1d", "conv2d", "conv3d", "conv_transpose2d", "linear")
_ACTS = (None, "relu", "relu6")


@register_op
@attrs.frozen
class QATConv(QATModuleOp):
    """A QAT conv / linear (+ fused add, + ReLU / ReLU6): ``out_fq(act(conv(x, weight_fq(w)) + b + addend))``.

    Operands: ``input[, addend], weight[, bias]``, then the weight fake quant's state
    (``weight_fake_quant.*``) and the output fake quant's (``activation_post_process.*``;
    none when ``out_fq`` is None: a high-precision qint32 output)."""

    name: ClassVar[str] = "qat_conv"
    operand_names: ClassVar[tuple[str, ...]] = ("input", "addend")

    kind: str
    in_channels: int
    out_channels: int
    weight_fq: FakeQuantSpec
    out_fq: FakeQuantSpec | None
    kernel_size: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_ints)
    stride: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_ints)
    padding: Any = attrs.field(default=None, converter=_padding)
    dilation: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_ints)
    groups: int = 1
    output_padding: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_ints)
    padding_mode: str = "zeros"
    bias: bool = True
    add: bool = False
    act: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise IRError(f"qat_conv: kind must be one of {_KINDS}, got {self.kind!r}")
        if self.act not in _ACTS:
            raise IRError(f"qat_conv: act must be one of {_ACTS}, got {self.act!r}")
        if self.in_channels < 1 or self.out_channels < 1 or self.groups < 1:
            raise IRError(
                f"qat_conv: in_channels, out_channels and groups must be >= 1, got "
                f"{self.in_channels}, {self.out_channels}, {self.groups}"
            )
        w_axis = 1 if self.kind == "conv_transpose2d" else 0
        if self.weight_fq.observer.axis not in (None, w_axis):
            raise IRError(
                f"qat_conv: the weight fake quant's channel axis must be {w_axis} (output channels) or None, "
                f"got {self.weight_fq.observer.axis}"
            )
        if self.out_fq is not None and self.out_fq.observer.axis is not None:
            raise IRError(f"qat_conv: the output fake quant must be per tensor, got axis {self.out_fq.observer.axis}")
        if self.out_fq is None and self.add:
            raise IRError("qat_conv: a fused add needs an output fake quant (no high-precision output)")
        if self.kind != "linear":
            dims = 2 if self.kind == "conv_transpose2d" else int(self.kind[4])
            for field in ("kernel_size", "stride", "dilation"):
                v = getattr(self, field)
                if v is None or len(v) != dims or any(d < 1 for d in v):
                    raise IRError(f"qat_conv: {field} must be {dims} positive integers, got {v}")

    def num_inputs(self) -> int:
        return 2 if self.add else 1

    def param_roles(self) -> tuple[str, ...]:
        return (
            ("weight", "bias")[: 2 if self.bias else 1]
            + fake_quant_roles("weight_fake_quant", self.weight_fq)
            + fake_quant_roles("activation_post_process", self.out_fq)
        )

    def weight_shape(self) -> tuple[int, ...]:
        if self.kind == "linear":
            return (self.out_channels, self.in_channels)
        assert self.kernel_size is not None
        if self.kind == "conv_transpose2d":
            return (self.in_channels, self.out_channels // self.groups, *self.kernel_size)
        return (self.out_channels, self.in_channels // self.groups, *self.kernel_size)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        k = self.num_inputs()
        w = operand_types[k]
        assert isinstance(w, TensorType)
        if not w.dtype.is_float or tuple(w.shape) != self.weight_shape():
            raise IRError(f"qat_conv: weight must be a float tensor of shape {self.weight_shape()}, got {w}")
        if self.bias:
            b = operand_types[k + 1]
            assert isinstance(b, TensorType)
            if not b.dtype.is_float or tuple(b.shape) != (self.out_channels,):
                raise IRError(f"qat_conv: bias must be a float tensor of shape ({self.out_channels},), got {b}")
        x = operand_types[0]
        assert isinstance(x, TensorType)
        axis = -1 if self.kind == "linear" else 1
        if x.rank < 2 or x.shape[axis] != self.in_channels:
            raise IRError(f"qat_conv: input {x} does not have {self.in_channels} channels on axis {axis}")

    def compute(self, *operands: Any) -> Any:
        x = operands[0]
        if x.device.type != "meta":
            raise NotImplementedError("qat_conv runs as its QAT module (evaluate)")
        # the shape (and float dtype) of the float conv: its fake quants keep both
        w = operands[self.num_inputs()]
        if self.kind == "linear":
            shape = linear_shape(x, w, None, None)
        elif self.kind != "conv_transpose2d" and self.padding_mode == "zeros" and self.stride and self.dilation:
            shape = conv_shape(x, w, None, None, self.stride, self.padding, self.dilation, self.groups)
        else:
            shape = None
        if shape is not None:  # by formula, without torch's (slow) meta kernels
            return meta_result(shape, x)
        if self.kind == "linear":
            return F.linear(x, w)
        if self.kind == "conv_transpose2d":
            hp: Any = (self.stride, self.padding, self.output_padding or 0, self.groups, self.dilation)
            return F.conv_transpose2d(x, w, None, hp[0], hp[1], hp[2], hp[3], hp[4])
        conv: Any = {"conv1d": F.conv1d, "conv2d": F.conv2d, "conv3d": F.conv3d}[self.kind]
        padding = self.padding
        if self.padding_mode != "zeros" and not isinstance(padding, str):
            x = F.pad(x, [p for p in reversed(padding) for _ in range(2)], mode=self.padding_mode)
            padding = 0
        return conv(x, w, None, self.stride, padding, self.dilation, self.groups)

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        k = self.num_inputs()
        if len(operand_types) <= k or not all(isinstance(t, TensorType) for t in operand_types):
            return Op.infer_type(self, operand_types)  # its error names the operand that is no tensor
        # compute reads the input and the weight alone: meta tensors of those two, not of the dozen state
        # operands a layer has besides (the same result, at a fraction of the cost per layer)
        args: list[Any] = [None] * len(operand_types)
        args[0], args[k] = meta_tensor(operand_types[0]), meta_tensor(operand_types[k])
        return meta_type(self.compute(*args))

    def float_op(self) -> Op:
        return conv_float_op(self, bias=self.bias)


@register_op
@attrs.frozen
class QATQuantStub(QATModuleOp):
    """The model input's fake quant: ``out_fq(x)``; its state is ``activation_post_process.*``."""

    name: ClassVar[str] = "qat_quant_stub"
    reads_codes: ClassVar[bool] = False
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    out_fq: FakeQuantSpec

    def param_roles(self) -> tuple[str, ...]:
        return fake_quant_roles("activation_post_process", self.out_fq)

    def float_op(self) -> type:
        from torch.ao.quantization import QuantStub

        return QuantStub


@register_op
@attrs.frozen
class QATDequantStub(QATModuleOp):
    """The end of quantized computation: the identity in QAT (the value stays float)."""

    name: ClassVar[str] = "qat_dequant_stub"
    makes_codes: ClassVar[bool] = False
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    def float_op(self) -> type:
        from torch.ao.quantization import DeQuantStub

        return DeQuantStub
