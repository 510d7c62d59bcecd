"""The ``quantize`` pass's conversion rules for qir's QAT ops.

``qat_conv`` converts from the op's attributes and state tensors directly: a weight fake quant built
once per FakeQuantSpec holds the layer's observer state and observes the weight on clones of it,
and :func:`~qir.nn.quantized.conv.integer_conv_state` computes the integer state, the same
function ``from_qat`` calls (both observe and quantize the weight with
:func:`~qir.nn.quantized.conv_weight.weight_codes`), so the pass and module-swapping ``convert_fx`` run one arithmetic
(tests/quantization/test_convert_paths.py). No QAT or integer module is built per layer, and no
state tensor is written. The stubs (two per model) and the layers of
``quantize_rules_layers`` rebuild their QAT module and call ``from_qat`` (:func:`swapped_rule`).
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from passes.quantize import QuantizeRule, register_quantize_rule
from qir.ir.op import ModuleOp
from qir.ir.ops.integer import QConv
from qir.ir.ops.integer_stubs import QDequantStub, QQuantStub
from qir.ir.ops.qat import FakeQuantSpec
from qir.ir.types import DType
from qir.nn.quantized._base import as_scale_tensor, march_name
from qir.nn.quantized.conv import (
    CONV_CLASS_OF,
    MODULE_KIND,
    conv_hyper_parameters,
    integer_conv_state,
)
from qir.nn.quantized.conv_weight import weight_codes
from qir.nn.quantized.mapping import QUANTIZED_MODULE_MAP
from qir.quantization.fake_quant_ir import bind_fake_quant, build_fake_quant
from qir.quantization.fake_quantize import FakeQuantize

__all__ = ["swapped_rule"]


def swapped_rule(integer_op: type[ModuleOp]) -> QuantizeRule:
    """The rule of a layer converted as module swapping converts it: rebuild the QAT module from the
    op (sharing its state tensors), ``from_qat`` with the quantized class of ``QUANTIZED_MODULE_MAP``,
    and read ``integer_op`` and its integer state off the converted module."""

    def rule(op: Any, tensors: dict[str, torch.Tensor], scales: Sequence[torch.Tensor], march: str) -> Any:
        qat = op.to_module(tensors)
        q = QUANTIZED_MODULE_MAP[type(qat)].from_qat(qat, list(scales), march)  # type: ignore[attr-defined]
        new = integer_op.from_module(q)
        return new, {role: getattr(q, role) for role in new.param_roles()}

    return rule


@functools.lru_cache(maxsize=1024)
def _hyper_parameters(
    kind: str,
    cin: int,
    cout: int,
    kernel: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
    output_padding: Any,
    padding_mode: str,
) -> dict[str, Any]:
    """The ``hp`` a converted module of these attributes keeps, as torch's module derives it (one
    meta-device module per distinct set: a network has a few dozen at most)."""
    if kind == "linear":
        return conv_hyper_parameters(None)
    kw: dict[str, Any] = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    if kind == "conv_transpose2d":
        kw["output_padding"] = output_padding
    else:
        kw["padding_mode"] = padding_mode
    return conv_hyper_parameters(getattr(nn, MODULE_KIND[kind])(cin, cout, kernel, bias=False, device="meta", **kw))


#: per thread, the weight fake quant built for each FakeQuantSpec (a network's layers share a few)
_FAKE_QUANTS = threading.local()


def _weight_codes(
    spec: FakeQuantSpec, tensors: dict[str, torch.Tensor], weight: torch.Tensor, owner: str, axis: int
) -> tuple[torch.Tensor, DType, torch.Tensor]:
    """:func:`~qir.nn.quantized.conv_weight.weight_codes` of the layer's weight fake quant: one module per
    spec (building one costs more than observing a weight) holds the layer's observer state while it
    observes the weight, without writing it (on clones of that state where torch observes, as
    ``from_qat`` does), so the layer's tensors are not written."""
    cache: dict[FakeQuantSpec, FakeQuantize] = _FAKE_QUANTS.__dict__.setdefault("by_spec", {})
    fq = cache.get(spec)
    prefix = "weight_fake_quant"
    if fq is None:
        if len(cache) >= 64:
            cache.clear()
        fq = cache[spec] = build_fake_quant(spec, tensors, prefix)
    else:
        bind_fake_quant(fq, spec, tensors, prefix)
    return weight_codes(fq, weight, owner, axis)


def _conv(op: Any, tensors: dict[str, torch.Tensor], scales: Sequence[torch.Tensor], march: str) -> Any:
    cls = CONV_CLASS_OF[(MODULE_KIND[op.kind], op.add, op.act)]
    name = cls.__name__
    march = march_name(march)
    ins = [as_scale_tensor(s, f"{name} input {i}") for i, s in enumerate(scales)]
    weight = tensors["weight"].detach()
    s_w, w_dtype, codes = _weight_codes(
        op.weight_fq, tensors, weight, cls.qat_class.__name__, cls.qat_class.weight_axis
    )
    out = None
    if op.out_fq is not None:
        out = (tensors["activation_post_process.scale"].detach(), op.out_fq.observer.dtype)
    bias = tensors["bias"].detach() if op.bias else None
    st = integer_conv_state(cls, weight, bias, op.out_channels, (s_w, w_dtype), ins, out, march, codes)
    hp = _hyper_parameters(
        op.kind,
        op.in_channels,
        op.out_channels,
        op.kernel_size,
        op.stride,
        op.padding,
        op.dilation,
        op.groups,
        op.output_padding,
        op.padding_mode,
    )
    # QConv.from_module reads these attributes off a converted module: the op is the one from_qat's module gives
    view = types.SimpleNamespace(
        hp=hp,
        dtype=st.dtype,
        scale=st.scale,
        out_axis=cls.out_axis,
        input_scales=ins,
        march=march,
        kind=cls.kind,
        has_add=op.add,
        act=op.act,
        add_multiplier=st.add_multiplier,
        add_shift=st.add_shift,
        extra_bits=st.extra_bits,
    )
    new = QConv.from_module(view)
    return new, {role: getattr(st, role) for role in new.param_roles()}


register_quantize_rule("qat_conv", _conv)
register_quantize_rule("qat_quant_stub", swapped_rule(QQuantStub))  # a quant stub reads no codes: no scales
register_quantize_rule("qat_dequant_stub", swapped_rule(QDequantStub))
