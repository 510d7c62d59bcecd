"""QAT conv / linear modules, plain and fused (add, ReLU, ReLU6), generated from one table.

``qat.Conv2d``, ``qat.ConvAddReLU2d``, ``qat.LinearReLU6``, ...: each subclasses the torch
module of its kind (so ``weight``/``bias``/hyperparameters are where torch keeps them),
fake-quantizes its weight with ``weight_fake_quant`` (per channel: axis 0, axis 1 for
conv transpose) and its output with ``activation_post_process`` (``None`` = high-precision
output). ``forward(x, addend=None) = fq(act(conv(x, fq(w)) + addend))``.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from backends.common.kernels.random_skip import skip_uniform_draws
from qir.ir.meta_modules import meta_module
from qir.nn.intrinsic.fused import FUSED_CLASSES, FusedModule
from qir.nn.qat._base import QATModule, make_activation_fq, make_weight_fq, resolve_qconfig
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.integer_grid import conv_forward
from qir.quantization.qconfig import QConfig

__all__ = ["QAT_CONV_CLASSES", "QATConvBase"]

C = TypeVar("C", bound="QATConvBase")


class QATConvBase(QATModule):
    """Behaviour shared by every generated QAT conv / linear class."""

    float_conv: ClassVar[type[nn.Module]] = nn.Conv2d
    has_add: ClassVar[bool] = False
    act: ClassVar[str | None] = None
    weight_axis: ClassVar[int] = 0  # the weight's output-channel axis
    out_axis: ClassVar[int] = 1  # the output's channel axis
    #: tensor inputs on a quantized grid (the input, and the addend of a fused add): prepare_qat_fx
    #: binds their fake quants so training runs on the integer grid (qir.quantization.integer_grid)
    grid_inputs: ClassVar[int] = 1
    weight: nn.Parameter
    bias: nn.Parameter | None
    weight_fake_quant: FakeQuantize

    def __init__(self, *args: Any, qconfig: QConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_qat(qconfig)

    def _init_qat(self, qconfig: QConfig) -> None:
        """The constructor's part after torch's: the qconfig and the fake quants built from it."""
        name = type(self).__name__
        self.qconfig = qconfig
        self.weight_fake_quant = make_weight_fq(qconfig, name, self.weight_axis)
        self.activation_post_process = make_activation_fq(qconfig, name, required=False)

    def _linear_op(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The conv / linear of ``x`` with weight ``w`` and ``bias`` (default: the module's own)."""
        b = self.bias if bias is None else bias
        kind = self.float_conv
        if kind is nn.Linear:
            return F.linear(x, w, b)
        if kind is nn.ConvTranspose2d:
            m: Any = self
            return F.conv_transpose2d(x, w, b, m.stride, m.padding, m.output_padding, m.groups, m.dilation)
        out: torch.Tensor = self._conv_forward(x, w, b)  # type: ignore[operator]
        return out

    def _finish(self, y: torch.Tensor, addend: torch.Tensor | None) -> torch.Tensor:
        """The fused add, activation and output fake quant after the conv / linear."""
        if self.has_add:
            if addend is None:
                raise TypeError(f"{type(self).__name__}.forward needs the addend (second input)")
            y = y + addend
        elif addend is not None:
            raise TypeError(f"{type(self).__name__} has no fused add; got a second input")
        if self.act == "relu":
            y = F.relu(y)
        elif self.act == "relu6":
            y = F.relu6(y)
        if self.activation_post_process is not None:
            y = self.activation_post_process(y)
        return y

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``FloatFunctional.add``'s call form (eager models fused at the add): ``self(x, y)``."""
        if not self.has_add:
            raise TypeError(f"{type(self).__name__} has no fused add; call it as a module")
        out: torch.Tensor = self(x, y)
        return out

    def forward(self, x: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
        on_grid = conv_forward(self, x, addend)
        if on_grid is not None:
            return on_grid
        return self._finish(self._linear_op(x, self.weight_fake_quant(self.weight)), addend)

    @classmethod
    def from_float(cls: type[C], mod: nn.Module, qconfig: QConfig | None = None) -> C:
        """A QAT copy of the float ``mod`` (plain conv/linear or fused module); never shares its tensors."""
        want = fused_float_class(cls)
        if type(mod) is not want:
            raise TypeError(f"{cls.__name__}.from_float takes a {want.__name__}, got {type(mod).__name__}")
        conv: Any = mod.conv if isinstance(mod, FusedModule) else mod
        if qconfig is None and getattr(mod, "qconfig", None) is None:
            qconfig = getattr(conv, "qconfig", None)  # a fused module may carry it on its conv child
        qc = resolve_qconfig(mod, qconfig, cls.__name__)
        new = _built_without_init_draw(cls, conv, qc)
        if new is None:
            new = cls(**_ctor_kwargs(conv), qconfig=qc)
            with torch.no_grad():
                new.weight.copy_(conv.weight)
                new.weight.requires_grad_(conv.weight.requires_grad)
                if conv.bias is not None and new.bias is not None:
                    new.bias.copy_(conv.bias)
                    new.bias.requires_grad_(conv.bias.requires_grad)
        new.train(mod.training)
        return new

    def extra_repr(self) -> str:
        base = super().extra_repr()
        hp = self.activation_post_process is None
        return f"{base}{', high_precision_output=True' if hp else ''}"


#: the reset_parameters whose draws _built_without_init_draw replays: torch's own (a class or a
#: library that replaces it initializes differently, and takes the constructor)
_TORCH_RESETS = {
    (nn.Linear, "torch.nn.modules.linear", "Linear.reset_parameters"),
    *((c, "torch.nn.modules.conv", "_ConvNd.reset_parameters") for c in (nn.Conv1d, nn.Conv2d, nn.Conv3d)),
    (nn.ConvTranspose2d, "torch.nn.modules.conv", "_ConvNd.reset_parameters"),
}


def _built_without_init_draw(cls: type[C], conv: Any, qconfig: QConfig) -> C | None:
    """What ``cls(**_ctor_kwargs(conv), qconfig=qconfig)`` builds once ``conv``'s weight and bias are
    copied into it, the global random stream included, without its random initialization: the
    module is a copy of a meta-device prototype (qir.ir.meta_modules) holding one fresh copy of
    each tensor, and the generator of the weight's device is advanced past the draws torch's
    ``reset_parameters`` makes (``kaiming_uniform_`` of the weight, then ``uniform_`` of the bias,
    in the weight's dtype and device) instead of drawing them (backends/common/kernels/random_skip.py).
    None where the constructor must run: a zero-element weight (torch warns and draws nothing), a
    replaced ``reset_parameters``, tensors whose shapes are not the constructor's, an argument
    that cannot key a prototype."""
    w, b = conv.weight, conv.bias
    kind = cls.float_conv
    reset = getattr(kind, "reset_parameters", None)
    torch_reset = (kind, getattr(reset, "__module__", None), getattr(reset, "__qualname__", None)) in _TORCH_RESETS
    if w.numel() == 0 or not torch_reset:
        return None
    kwargs = _ctor_kwargs(conv)
    device = kwargs.pop("device")
    try:
        new: Any = meta_module(kind, instance_of=cls, **kwargs)
    except TypeError:  # an unhashable argument
        return None
    slots = new._parameters
    if slots["weight"].shape != w.shape or (b is not None and slots["bias"].shape != b.shape):
        return None
    with torch.no_grad():
        weight = torch.empty(w.shape, dtype=w.dtype, device=device).copy_(w)
        bias = None if b is None else torch.empty(b.shape, dtype=w.dtype, device=device).copy_(b)
    skip_uniform_draws(w.numel(), w.dtype, device)
    if bias is not None:
        skip_uniform_draws(bias.numel(), w.dtype, device)
    slots["weight"] = nn.Parameter(weight, requires_grad=w.requires_grad)
    if bias is not None:
        slots["bias"] = nn.Parameter(bias, requires_grad=b.requires_grad)
    new._init_qat(qconfig)
    return new  # type: ignore[no-any-return]


def _ctor_kwargs(conv: Any) -> dict[str, Any]:
    w = conv.weight
    common = {"bias": conv.bias is not None, "device": w.device, "dtype": w.dtype}
    if isinstance(conv, nn.Linear):
        return {"in_features": conv.in_features, "out_features": conv.out_features, **common}
    kw = {
        "in_channels": conv.in_channels,
        "out_channels": conv.out_channels,
        "kernel_size": conv.kernel_size,
        "stride": conv.stride,
        "padding": conv.padding,
        "dilation": conv.dilation,
        "groups": conv.groups,
        "padding_mode": conv.padding_mode,
        **common,
    }
    if isinstance(conv, nn.ConvTranspose2d):
        kw["output_padding"] = conv.output_padding
    return kw


_KINDS: dict[str, tuple[type[nn.Module], int, int]] = {
    # name: (torch class, weight output-channel axis, output channel axis)
    "Conv1d": (nn.Conv1d, 0, 1),
    "Conv2d": (nn.Conv2d, 0, 1),
    "Conv3d": (nn.Conv3d, 0, 1),
    "ConvTranspose2d": (nn.ConvTranspose2d, 1, 1),
    "Linear": (nn.Linear, 0, -1),
}
_VARIANTS: list[tuple[str, bool, str | None]] = [
    ("", False, None),
    ("ReLU", False, "relu"),
    ("ReLU6", False, "relu6"),
    ("Add", True, None),
    ("AddReLU", True, "relu"),
    ("AddReLU6", True, "relu6"),
]


def class_name(kind: str, suffix: str) -> str:
    """``Conv2d`` + ``AddReLU`` -> ``ConvAddReLU2d``; ``Linear`` + ``ReLU6`` -> ``LinearReLU6``."""
    if kind == "Linear" or not suffix:
        return f"{kind}{suffix}"
    return f"{kind[:-2]}{suffix}{kind[-2:]}"


def fused_float_class(cls: type[QATConvBase]) -> type[nn.Module]:
    """The float class a generated QAT/quantized conv class converts from."""
    if not cls.has_add and cls.act is None:
        return cls.float_conv
    return FUSED_CLASSES[(cls.float_conv, cls.has_add, cls.act)]


#: (torch conv class, has_add, act) -> QAT class
QAT_CONV_CLASSES: dict[tuple[type[nn.Module], bool, str | None], type[QATConvBase]] = {}


def _make() -> dict[str, Any]:
    made: dict[str, Any] = {}
    for kind, (torch_cls, w_axis, o_axis) in _KINDS.items():
        for suffix, has_add, act in _VARIANTS:
            name = class_name(kind, suffix)
            cls = type(
                name,
                (QATConvBase, torch_cls),
                {
                    "float_conv": torch_cls,
                    "has_add": has_add,
                    "act": act,
                    "weight_axis": w_axis,
                    "out_axis": o_axis,
                    "grid_inputs": 2 if has_add else 1,
                    "__module__": __name__,
                    "__qualname__": name,
                    "__doc__": f"QAT {kind}{' + add' if has_add else ''}{' + ' + act if act else ''}.",
                },
            )
            QAT_CONV_CLASSES[(torch_cls, has_add, act)] = cls
            made[name] = cls
    return made


_GENERATED = _make()
globals().update(_GENERATED)
__all__ += sorted(_GENERATED)

Conv1d: type[QATConvBase]
Conv2d: type[QATConvBase]
Conv3d: type[QATConvBase]
ConvTranspose2d: type[QATConvBase]
Linear: type[QATConvBase]
ConvReLU1d: type[QATConvBase]
ConvReLU2d: type[QATConvBase]
ConvReLU3d: type[QATConvBase]
ConvReLU61d: type[QATConvBase]
ConvReLU62d: type[QATConvBase]
ConvReLU63d: type[QATConvBase]
ConvAdd1d: type[QATConvBase]
ConvAdd2d: type[QATConvBase]
ConvAdd3d: type[QATConvBase]
ConvAddReLU1d: type[QATConvBase]
ConvAddReLU2d: type[QATConvBase]
ConvAddReLU3d: type[QATConvBase]
ConvAddReLU61d: type[QATConvBase]
ConvAddReLU62d: type[QATConvBase]
ConvAddReLU63d: type[QATConvBase]
ConvTransposeReLU2d: type[QATConvBase]
ConvTransposeReLU62d: type[QATConvBase]
ConvTransposeAdd2d: type[QATConvBase]
ConvTransposeAddReLU2d: type[QATConvBase]
ConvTransposeAddReLU62d: type[QATConvBase]
LinearReLU: type[QATConvBase]
LinearReLU6: type[QATConvBase]
LinearAdd: type[QATConvBase]
LinearAddReLU: type[QATConvBase]
LinearAddReLU6: type[QATConvBase]
