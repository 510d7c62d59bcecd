"""Models for the ops on codes (abs, clamp, comparisons, pads, max / min, topk, gather, shuffles) and
the flow that runs one through QAT and convert_fx with the same op input on both sides."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backends.common import numerics
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)

Op = Callable[["CodeOpNet", torch.Tensor], Any]


class CodeOpNet(nn.Module):
    """QuantStub -> conv -> ``op(self, x)``. Channels 1 and 2 of the conv are equal, so the
    codes tie across channels (argmax / max / topk tie-breaking is exercised)."""

    def __init__(self, op: Op, channels: int = 4) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        with torch.no_grad():
            self.conv.weight[2] = self.conv.weight[1]
            self.conv.bias[2] = self.conv.bias[1]
        self.dq = DeQuantStub()
        self.dq2 = DeQuantStub()
        self.op = op
        g = torch.Generator().manual_seed(3)
        self.register_buffer("index", torch.randint(0, channels, (2, 2, 8, 8), generator=g))
        self.cpad = nn.ConstantPad2d((1, 0, 2, 1), 0.25)
        self.rpad = nn.ReplicationPad2d((1, 2, 0, 1))
        self.zpad = nn.ZeroPad2d(1)
        self.pixel_shuffle = nn.PixelShuffle(2)
        self.pixel_unshuffle = nn.PixelUnshuffle(2)
        self.channel_shuffle = nn.ChannelShuffle(2)

    def forward(self, x: torch.Tensor) -> Any:
        return self.op(self, self.conv(self.quant(x)))


#: name -> op; every op's outputs: dequantized codes, or exact indices / booleans
EXACT_OPS: dict[str, Op] = {
    "max_dim": lambda s, x: (s.dq(torch.max(x, 1)[0]), torch.max(x, 1)[1]),
    "min_dim_method_keepdim": lambda s, x: s.dq(x.min(dim=1, keepdim=True).values),
    "max_indices_attr": lambda s, x: x.max(dim=1).indices,
    "min_negative_items": lambda s, x: (s.dq(torch.min(x, 2, keepdim=True)[-2]), torch.min(x, 2)[-1]),
    "max_whole": lambda s, x: s.dq(torch.max(x)),
    "min_whole_method": lambda s, x: s.dq(x.min()),
    "argmax": lambda s, x: torch.argmax(x, 1),
    "argmin_keepdim": lambda s, x: x.argmin(dim=1, keepdim=True),
    "argmax_flat": lambda s, x: x.argmax(),
    "topk": lambda s, x: (s.dq(torch.topk(x, 2, dim=1)[0]), torch.topk(x, 2, dim=1).indices),
    "topk_smallest": lambda s, x: s.dq(x.topk(3, dim=1, largest=False).values),
    "gather_buffer": lambda s, x: s.dq(torch.gather(x, 1, s.index)),
    "gather_topk": lambda s, x: s.dq(x.gather(1, torch.topk(x, 2, dim=1)[1])),
    "gt": lambda s, x: x > 0.1,
    "ge_method": lambda s, x: x.ge(-0.25),
    "lt_reversed": lambda s, x: 0.1 < x,
    "le": lambda s, x: torch.le(x, 0.3),
    "eq_zero": lambda s, x: torch.eq(x, 0.0),
    "ne": lambda s, x: x != 0.0,
    "greater_equal": lambda s, x: torch.greater_equal(x, 0),
    "less": lambda s, x: torch.less(x, 0.05),
    "gt_two_tensors": lambda s, x: torch.gt(x, x.flip(1)),
    "le_two_tensors": lambda s, x: x <= torch.roll(x, 1, dims=2),
    "pad_zero": lambda s, x: s.dq(F.pad(x, (1, 1, 2, 0))),
    "pad_replicate": lambda s, x: s.dq(F.pad(x, (1, 1, 1, 1), mode="replicate")),
    "pad_reflect": lambda s, x: s.dq(F.pad(x, (1, 1, 1, 1), mode="reflect")),
    "pad_modules": lambda s, x: s.dq(s.rpad(s.zpad(x))),
    "pixel_shuffle": lambda s, x: s.dq(s.pixel_shuffle(s.pixel_unshuffle(s.channel_shuffle(x)))),
    "channel_shuffle_fn": lambda s, x: s.dq(F.channel_shuffle(x, 2)),
    "pixel_shuffle_fn": lambda s, x: s.dq(F.pixel_unshuffle(F.pixel_shuffle(x, 2), 2)),
}
#: ops whose integer result is the fake quant (at the input's scale) of the QAT result
ROUNDED_OPS: dict[str, Op] = {
    "abs": lambda s, x: s.dq(torch.abs(x)),
    "abs_method": lambda s, x: s.dq(x.abs()),
    "clamp": lambda s, x: s.dq(torch.clamp(x, -0.3, 0.5)),
    "clamp_min_method": lambda s, x: s.dq(x.clamp(min=0.1)),
    "clip_max": lambda s, x: s.dq(torch.clip(x, max=0.2)),
    "clamp_inverted": lambda s, x: s.dq(torch.clamp(x, 0.4, -0.4)),
    "clamp_wide": lambda s, x: s.dq(x.clip(-100.0, 100.0)),
    "pad_constant": lambda s, x: s.dq(F.pad(x, (1, 1, 1, 1), value=0.37)),
    "pad_constant_module": lambda s, x: s.dq(s.cpad(x)),
}
#: the two-tensor max / min get their own output scale (a generated FloatFunctional): within 1 LSB
REQUANTIZED_OPS: dict[str, Op] = {
    "max_two_tensors": lambda s, x: s.dq(torch.max(x, x.flip(1) * 0.5)),
    "min_two_tensors_method": lambda s, x: s.dq(x.min(torch.roll(x, 1, dims=3))),
}


def converted_pair(
    model: nn.Module, shape: tuple[int, ...] = (2, 3, 8, 8), batches: int = 2, seed: int = 0, dtype: str = "qint8"
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """prepare_qat_fx (activations of ``dtype``) -> QAT forward passes -> frozen fake quants (validation) ->
    convert_fx."""
    prepared = prepare_qat_fx(model, {"": get_default_qat_qconfig(dtype)})
    prepared.train()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(batches):
            prepared(torch.randn(*shape, generator=g) * 1.5)
    set_fake_quantize(prepared, "validation")
    prepared.eval()
    return prepared, convert_fx(prepared)


def run_both(prepared: nn.Module, converted: nn.Module, x: torch.Tensor) -> tuple[Any, Any, torch.Tensor]:
    """``(QAT output, converted output, conv scale)`` on ``x``, the QAT conv's output replaced by the
    integer conv's (dequantized: exactly a value of the QAT grid), so both sides give the op one input.

    The conv itself is within 1 LSB of QAT, not exact (requantization); the op is what is compared."""
    seen: dict[str, torch.Tensor] = {}
    h = converted.get_submodule("conv").register_forward_hook(lambda m, i, o: seen.__setitem__("conv", o))
    with torch.no_grad():
        got = converted(x)
    h.remove()
    s = converted.get_submodule("conv").scale
    h = prepared.get_submodule("conv").register_forward_hook(lambda m, i, o: numerics.dequantize(seen["conv"], s))
    with torch.no_grad():
        want = prepared(x)
    h.remove()
    return want, got, s


def as_tuple(v: Any) -> tuple[Any, ...]:
    return tuple(v) if isinstance(v, tuple) else (v,)


def fake_quant(v: torch.Tensor, s: torch.Tensor, dtype: str = "qint8") -> torch.Tensor:
    return numerics.dequantize(numerics.quantize(v, s, dtype), s)
