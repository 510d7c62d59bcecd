"""Module-backed ops with weights: convolutions, linear, batch norm.

Conv-like ops carry the fusion attributes the BPU executes in one kernel:
``add`` (one extra trailing operand added to the output) and ``act``
(``None``, ``"relu"`` or ``"relu6"`` applied last). Unfused ops have
``add=False, act=None``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from qir.ir.meta_modules import load_tensors, meta_module
from qir.ir.meta_shapes import conv_shape, linear_shape, meta_result
from qir.ir.op import HasWeight, IRError, ModuleOp, Pure, Trait, register_op
from qir.ir.types import TensorType, Type

#: (plain module type, has add, act) -> the fused module class that wraps it. The IR names no
#: module package: qir.nn.intrinsic registers its classes here on import (a spelling table).
FUSED_MODULE_CLASSES: dict[tuple[type[nn.Module], bool, str | None], Callable[[nn.Module], nn.Module]] = {}


def register_fused_module(
    plain: type[nn.Module], add: bool, act: str | None, cls: Callable[[nn.Module], nn.Module]
) -> None:
    """Make ``to_module`` of a fused conv / linear op wrap its plain module in ``cls``."""
    FUSED_MODULE_CLASSES[(plain, add, act)] = cls


_ACTS = (None, "relu", "relu6")


def _tuple(n: int) -> Any:
    def conv(v: Any) -> tuple[int, ...]:
        if isinstance(v, int):
            return (v,) * n
        return tuple(int(x) for x in v)

    return conv


def apply_act(y: torch.Tensor, act: str | None) -> torch.Tensor:
    if y.device.type == "meta":  # shape inference: ReLU / ReLU6 keep shape and dtype, and are slow on meta
        return y
    if act == "relu":
        return torch.relu(y)
    if act == "relu6":
        return F.relu6(y)
    return y


def _meta_batch_norm_ok(x: Any, state: dict[str, Any]) -> bool:
    """Whether ``F.batch_norm`` would accept meta ``x`` and return its shape and dtype: a floating
    input with a channel dimension and per-channel state of that size and dtype (anything else
    goes to torch for its error)."""
    if not (isinstance(x, torch.Tensor) and x.device.type == "meta" and x.is_floating_point() and x.dim() >= 2):
        return False
    if state.get("running_mean") is None or state.get("running_var") is None:
        return False  # eval batch norm needs its statistics: torch says so
    for role in ("weight", "bias", "running_mean", "running_var"):
        t = state.get(role)
        if t is not None and not (
            isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape[0] == x.shape[1] and t.dtype == x.dtype
        ):
            return False
    return True


def _check_act(op: Any) -> None:
    if op.act not in _ACTS:
        raise IRError(f"op {op.name!r}: act must be one of {_ACTS}, got {op.act!r}")


@attrs.frozen
class WeightedOp(ModuleOp):
    """Shared layout: operands ``(input, weight[, bias][, addend])``."""

    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, HasWeight})
    operand_names: ClassVar[tuple[str, ...]] = ("input", "weight", "bias", "addend")
    #: the weight axis that counts output channels (per group); 1 for transposed convs
    out_channel_axis: ClassVar[int] = 0

    def param_roles(self) -> tuple[str, ...]:
        return ("weight", "bias") if self.bias else ("weight",)  # type: ignore[attr-defined]

    def expected_operands(self) -> int:
        return 1 + len(self.param_roles()) + (1 if self.add else 0)  # type: ignore[attr-defined]

    def split(self, operands: Sequence[Any]) -> tuple[Any, Any, Any, Any]:
        x, w = operands[0], operands[1]
        i = 2
        b = None
        if self.bias:  # type: ignore[attr-defined]
            b = operands[i]
            i += 1
        other = operands[i] if self.add else None  # type: ignore[attr-defined]
        return x, w, b, other

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """The functional spelling (``F.conv2d(x, w, b, ...)``) of an unfused op."""
        if self.add or self.act is not None:  # type: ignore[attr-defined]
            raise IRError(f"op {self.name!r} with fused add/act has no single functional call; emit it as a module")
        x, w, b, _ = self.split(operands)
        return self.functional_call(x, w, b)

    def functional_call(self, x: Any, w: Any, b: Any) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        raise IRError(f"op {self.name!r} has no functional spelling")

    def module_inputs(self, operands: Sequence[Any]) -> list[Any]:
        # A fused module's forward is (x, addend): the addend trails the parameters.
        return [operands[0], operands[-1]] if self.add else [operands[0]]  # type: ignore[attr-defined]

    def plain_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        """The unfused torch module (conv / linear) holding ``tensors``."""
        raise NotImplementedError(f"op {self.name!r} has no module form")

    def to_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        """The plain module, or the fused module class registered for it around it."""
        m = self.plain_module(tensors)
        if not self.add and self.act is None:  # type: ignore[attr-defined]
            return m
        key = (type(m), self.add, self.act)  # type: ignore[attr-defined]
        cls = FUSED_MODULE_CLASSES.get(key)
        if cls is None:
            raise IRError(
                f"op {self.name!r}: no fused module class registered for {type(m).__name__} with "
                f"add={key[1]} act={key[2]!r}; importing qir.nn.intrinsic registers qir's (register_fused_module)"
            )
        return cls(m)

    def finish(self, y: torch.Tensor, other: Any) -> torch.Tensor:
        if other is not None:
            y = y + other
        return apply_act(y, self.act)  # type: ignore[attr-defined]

    def verify_(self, operand_types: Sequence[Type]) -> None:
        _check_act(self)
        n = self.expected_operands()
        if len(operand_types) != n:
            raise IRError(
                f"op {self.name!r}: bias={self.bias} add={self.add} needs {n} operands, "  # type: ignore[attr-defined]
                f"got {len(operand_types)}"
            )
        for role, t in zip(self.operand_names, operand_types, strict=False):
            if not isinstance(t, TensorType):
                raise IRError(f"op {self.name!r}: operand {role} must be a tensor, got {t}")


@attrs.frozen
class ConvNd(WeightedOp):
    """``nn.ConvNd`` / ``F.convNd`` (+ fused add / activation)."""

    dims: ClassVar[int] = 2

    stride: tuple[int, ...] = attrs.field(default=(1, 1), converter=lambda v: _tuple(2)(v))
    padding: Any = (0, 0)  # tuple of ints, or "same" / "valid"
    dilation: tuple[int, ...] = attrs.field(default=(1, 1), converter=lambda v: _tuple(2)(v))
    groups: int = 1
    padding_mode: str = "zeros"
    bias: bool = True
    add: bool = False
    act: str | None = None

    def num_inputs(self) -> int:
        return 1

    def compute(self, *operands: Any) -> Any:
        x, w, b, other = self.split(operands)
        if self.padding_mode == "zeros" and w is not None and w.dim() == self.dims + 2:
            shape = conv_shape(x, w, b, other, self.stride, self.padding, self.dilation, self.groups)
            if shape is not None:  # shape inference without torch's (slow) meta kernels
                return meta_result(shape, x)
        fn = (F.conv1d, F.conv2d, F.conv3d)[self.dims - 1]
        if self.padding_mode != "zeros":
            pad = [p for p in reversed(self.padding) for _ in range(2)]  # type: ignore[arg-type]
            x = F.pad(x, pad, mode=self.padding_mode)
            y = fn(x, w, b, self.stride, 0, self.dilation, self.groups)
        else:
            y = fn(x, w, b, self.stride, self.padding, self.dilation, self.groups)
        return self.finish(y, other)

    def functional_call(self, x: Any, w: Any, b: Any) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        if self.padding_mode != "zeros":
            raise IRError(f"op {self.name!r}: padding_mode {self.padding_mode!r} has no single functional call")
        fn = (F.conv1d, F.conv2d, F.conv3d)[self.dims - 1]
        return fn, (x, w, b, self.stride, self.padding, self.dilation, self.groups), {}

    @classmethod
    def from_module(cls, m: Any) -> ConvNd:
        return cls(
            stride=m.stride,
            padding=m.padding if isinstance(m.padding, str) else tuple(m.padding),
            dilation=m.dilation,
            groups=m.groups,
            padding_mode=m.padding_mode,
            bias=m.bias is not None,
        )

    def plain_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        w = tensors["weight"]
        cls: Any = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[self.dims - 1]  # shapes are checked by torch
        m = meta_module(
            cls,
            w.shape[1] * self.groups,
            w.shape[0],
            tuple(w.shape[2:]),
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            groups=self.groups,
            bias=self.bias,
            padding_mode=self.padding_mode,
            tensors=tensors,
        )
        return m


@register_op
@attrs.frozen
class Conv2d(ConvNd):
    name: ClassVar[str] = "conv2d"
    dims: ClassVar[int] = 2
    module_types: ClassVar[tuple[type, ...]] = (nn.Conv2d,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.conv2d,)


@register_op
@attrs.frozen
class Conv1d(ConvNd):
    name: ClassVar[str] = "conv1d"
    dims: ClassVar[int] = 1
    module_types: ClassVar[tuple[type, ...]] = (nn.Conv1d,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.conv1d,)

    stride: tuple[int, ...] = attrs.field(default=(1,), converter=lambda v: _tuple(1)(v))
    padding: Any = (0,)
    dilation: tuple[int, ...] = attrs.field(default=(1,), converter=lambda v: _tuple(1)(v))


@register_op
@attrs.frozen
class Conv3d(ConvNd):
    name: ClassVar[str] = "conv3d"
    dims: ClassVar[int] = 3
    module_types: ClassVar[tuple[type, ...]] = (nn.Conv3d,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.conv3d,)

    stride: tuple[int, ...] = attrs.field(default=(1, 1, 1), converter=lambda v: _tuple(3)(v))
    padding: Any = (0, 0, 0)
    dilation: tuple[int, ...] = attrs.field(default=(1, 1, 1), converter=lambda v: _tuple(3)(v))


@attrs.frozen
class ConvTransposeNd(WeightedOp):
    """``nn.ConvTransposeNd`` (+ fused add / activation)."""

    dims: ClassVar[int] = 2
    out_channel_axis: ClassVar[int] = 1

    stride: tuple[int, ...] = attrs.field(converter=tuple)
    padding: tuple[int, ...] = attrs.field(converter=tuple)
    output_padding: tuple[int, ...] = attrs.field(converter=tuple)
    dilation: tuple[int, ...] = attrs.field(converter=tuple)
    groups: int = 1
    bias: bool = True
    add: bool = False
    act: str | None = None

    def compute(self, *operands: Any) -> Any:
        x, w, b, other = self.split(operands)
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[self.dims - 1]
        y = fn(x, w, b, self.stride, self.padding, self.output_padding, self.groups, self.dilation)
        return self.finish(y, other)

    def functional_call(self, x: Any, w: Any, b: Any) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[self.dims - 1]
        return fn, (x, w, b, self.stride, self.padding, self.output_padding, self.groups, self.dilation), {}

    @classmethod
    def from_module(cls, m: Any) -> ConvTransposeNd:
        if m.padding_mode != "zeros":
            raise IRError(f"{type(m).__name__}: padding_mode {m.padding_mode!r} is not supported")
        return cls(
            stride=m.stride,
            padding=m.padding,
            output_padding=m.output_padding,
            dilation=m.dilation,
            groups=m.groups,
            bias=m.bias is not None,
        )

    def plain_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        w = tensors["weight"]
        cls: Any = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[self.dims - 1]
        m = meta_module(
            cls,
            w.shape[0],
            w.shape[1] * self.groups,
            tuple(w.shape[2:]),
            stride=self.stride,
            padding=self.padding,
            output_padding=self.output_padding,
            groups=self.groups,
            bias=self.bias,
            dilation=self.dilation,
            tensors=tensors,
        )
        return m


@register_op
@attrs.frozen
class ConvTranspose1d(ConvTransposeNd):
    name: ClassVar[str] = "conv_transpose1d"
    dims: ClassVar[int] = 1
    module_types: ClassVar[tuple[type, ...]] = (nn.ConvTranspose1d,)


@register_op
@attrs.frozen
class ConvTranspose2d(ConvTransposeNd):
    name: ClassVar[str] = "conv_transpose2d"
    dims: ClassVar[int] = 2
    module_types: ClassVar[tuple[type, ...]] = (nn.ConvTranspose2d,)


@register_op
@attrs.frozen
class ConvTranspose3d(ConvTransposeNd):
    name: ClassVar[str] = "conv_transpose3d"
    dims: ClassVar[int] = 3
    module_types: ClassVar[tuple[type, ...]] = (nn.ConvTranspose3d,)


@register_op
@attrs.frozen
class Linear(WeightedOp):
    """``nn.Linear`` / ``F.linear`` (+ fused add / activation)."""

    name: ClassVar[str] = "linear"
    module_types: ClassVar[tuple[type, ...]] = (nn.Linear,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.linear,)

    bias: bool = True
    add: bool = False
    act: str | None = None

    def compute(self, *operands: Any) -> Any:
        x, w, b, other = self.split(operands)
        shape = linear_shape(x, w, b, other)
        if shape is not None:  # shape inference without torch's meta kernels
            return meta_result(shape, x)
        return self.finish(F.linear(x, w, b), other)

    def functional_call(self, x: Any, w: Any, b: Any) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return F.linear, (x, w, b), {}

    @classmethod
    def from_module(cls, m: Any) -> Linear:
        return cls(bias=m.bias is not None)

    def plain_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        w = tensors["weight"]
        return meta_module(nn.Linear, w.shape[1], w.shape[0], bias=self.bias, tensors=tensors)


_BN_CLASSES: dict[tuple[int, bool], type[nn.Module]] = {
    (1, False): nn.BatchNorm1d,
    (2, False): nn.BatchNorm2d,
    (3, False): nn.BatchNorm3d,
    (0, True): nn.SyncBatchNorm,
}


@register_op
@attrs.frozen
class BatchNorm(ModuleOp):
    """``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm`` and ``F.batch_norm``.

    Operands: ``(input[, weight, bias][, running_mean, running_var, num_batches_tracked])``.
    ``dims`` is 1/2/3 for the module flavours and 0 for SyncBatchNorm or the function.
    """

    name: ClassVar[str] = "batch_norm"
    channel_state: ClassVar[tuple[str, ...]] = ("weight", "bias", "running_mean", "running_var")
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure})
    operand_names: ClassVar[tuple[str, ...]] = ("input",)
    module_types: ClassVar[tuple[type, ...]] = tuple(_BN_CLASSES.values())
    #: module classes that stand for every flavour in patterns (SyncBatchNorm becomes BatchNormNd)
    any_flavor_modules: ClassVar[tuple[type, ...]] = (nn.SyncBatchNorm,)

    eps: float = 1e-5
    momentum: float | None = 0.1
    affine: bool = True
    track_running_stats: bool = True
    dims: int = 2
    sync: bool = False
    #: whether num_batches_tracked is an operand (modules have it, F.batch_norm does not)
    counter: bool = True

    def module_flavor(self) -> type | None:
        """The one module class of :attr:`module_types` this op stands for (None: ``F.batch_norm``)."""
        return _BN_CLASSES.get((self.dims, self.sync))

    def param_roles(self) -> tuple[str, ...]:
        roles: tuple[str, ...] = ("weight", "bias") if self.affine else ()
        if self.track_running_stats:
            roles += ("running_mean", "running_var")
            if self.counter:
                roles += ("num_batches_tracked",)
        return roles

    def compute(self, x: Any, *params: Any) -> Any:
        if _meta_batch_norm_ok(x, dict(zip(self.param_roles(), params, strict=True))):
            return x  # shape inference: torch's meta batch norm costs ~3 ms (a decomposition)
        fn, args, kwargs = self.torch_call((x, *params))
        return fn(*args, **kwargs)

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """The eval form, as ``nn.BatchNormNd.forward`` calls it in eval mode:
        ``F.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps)``."""
        if not self.track_running_stats:
            raise IRError("op 'batch_norm' without running statistics has no eval form")
        p = dict(zip(self.param_roles(), operands[1:], strict=True))
        momentum = 0.0 if self.momentum is None else self.momentum
        stats = (p.get("running_mean"), p.get("running_var"), p.get("weight"), p.get("bias"))
        return F.batch_norm, (operands[0], *stats, False, momentum, self.eps), {}

    def module_form_only(self) -> bool:
        # a module batch norm updates its running statistics in training, which the eval call does not
        return self.module_flavor() is not None

    def verify_(self, operand_types: Sequence[Type]) -> None:
        n = 1 + len(self.param_roles())
        if len(operand_types) != n:
            names = ", ".join(("input", *self.param_roles()))
            raise IRError(f"op 'batch_norm': expects {n} operands ({names}), got {len(operand_types)}")
        if not self.track_running_stats:
            raise IRError("op 'batch_norm': track_running_stats=False has no eval semantics in a graph")
        # shape inference skips F.batch_norm (_meta_batch_norm_ok), whose argument parser refuses these
        for field, v in (("eps", self.eps), ("momentum", self.momentum)):
            if (v is not None or field == "eps") and (isinstance(v, bool) or not isinstance(v, (int, float))):
                none = " or None" if field == "momentum" else ""
                raise IRError(f"op 'batch_norm': {field} must be a number{none}, got {v!r}")

    @classmethod
    def from_module(cls, m: Any) -> BatchNorm:
        sync = isinstance(m, nn.SyncBatchNorm)
        dims = 0 if sync else {nn.BatchNorm1d: 1, nn.BatchNorm2d: 2, nn.BatchNorm3d: 3}[type(m)]
        return cls(
            eps=m.eps,
            momentum=m.momentum,
            affine=m.affine,
            track_running_stats=m.track_running_stats,
            dims=dims,
            sync=sync,
        )

    def to_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        cls = _BN_CLASSES.get((self.dims, self.sync))
        if cls is None:
            raise IRError(f"batch_norm dims={self.dims} sync={self.sync} has no module form")
        ref = tensors.get("running_mean", tensors.get("weight"))
        assert ref is not None
        m = cls(
            ref.shape[0],
            eps=self.eps,
            momentum=self.momentum,
            affine=self.affine,
            track_running_stats=self.track_running_stats,
            device="meta",
        )
        load_tensors(m, tensors)
        return m
