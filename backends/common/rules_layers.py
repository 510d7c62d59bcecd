"""Op rules for the integer boundary stubs, scale-keeping layers, table lookups, pools,
resize and division (``qquant_stub`` ... ``qdiv``, qir/ir/ops/integer_*.py).

Each rule reads the op's attributes (scales, hyper-parameters, integer scalars) and its
state operands (tables, per-divisor multipliers / shifts: the tensors themselves) and emits
the kernels the module rules emitted before, instruction for instruction, so artifacts stay
bit-exact with the converted model. A march lists the ops it lowers with these rules in its
own ``rules.py`` (backends/bayes, backends/bernoulli2).

The nearest-resize helpers (:func:`nearest_maps`, :func:`emit_nearest`, :func:`size_operand`)
also serve the function rule of ``nearest_interpolate_codes`` in ``lower_rules``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from backends.common.integer_rules import avg_pool_params, bilinear_taps, resize_out_size
from backends.common.kernels.pool import adaptive_bounds
from backends.common.lower import LowerContext, LoweringError, Named, f32_scale, names_in, shape_call, tensor_ref
from backends.common.program import Instruction, ValueRef

__all__ = [
    "OP_RULES",
    "clamp_codes",
    "emit_nearest",
    "nearest_maps",
    "size_operand",
]


def _hint(node: Any) -> str:
    """The name instructions and constants are derived from: the layer's module path."""
    return str(node.scope or node.name)


def _plain(v: Any) -> Any:
    """Hyper-parameters as JSON-plain values (tuples -> lists)."""
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


def clamp_codes(ctx: LowerContext, node: Named, x: Any, lo: int | None, hi: int | None) -> ValueRef:
    return ValueRef(ctx.emit("clamp", [tensor_ref(x, node)], {"min": lo, "max": hi}, {}, node.name, "clamp"))


# ----------------------------------------------------------------------------- stubs


def lower_qquant_stub(ctx: LowerContext, node: Any, operands: list[Any]) -> ValueRef:
    op = node.op
    attrs = {"scale": f32_scale(op.out.scale[0]), "dtype": op.out.dtype.name}
    if isinstance(operands[0], torch.Tensor) and operands[0].is_floating_point():
        # a QuantStub of a parameter (``self.query_quant(self.query_embed.weight)``): its codes are
        # fixed, so quantize them now with the run-time rule and store them
        from backends.common.kernels.quant import quantize

        probe = Instruction("quantize", (), ("codes",), attrs, {}, node.name)
        (codes,) = quantize(probe, [operands[0].detach().to(torch.float32)], None)
        c = ctx.const(f"{_hint(node)}.codes", codes.contiguous())
        return ValueRef(ctx.emit("constant", [], {}, {"value": c}, node.name, _hint(node)))
    x = tensor_ref(operands[0], node)
    return ValueRef(ctx.emit("quantize", [x], attrs, {}, node.name, _hint(node)))


def lower_qdequant_stub(ctx: LowerContext, node: Any, operands: list[Any]) -> ValueRef:
    op = node.op
    x = tensor_ref(operands[0], node)
    c = ctx.const(f"{_hint(node)}.scale", torch.tensor(op.in_scales, dtype=torch.float32))
    return ValueRef(ctx.emit("dequantize", [x], {"axis": op.axis}, {"scale": c}, node.name, _hint(node)))


# ----------------------------------------------------------------------------- scale-keeping layers, tables


def lower_qrelu(ctx: LowerContext, node: Any, operands: list[Any]) -> ValueRef:
    return clamp_codes(ctx, node, operands[0], 0, None)


def lower_qrelu6(ctx: LowerContext, node: Any, operands: list[Any]) -> ValueRef:
    return clamp_codes(ctx, node, operands[0], 0, int(node.op.bound))


def lower_qidentity(ctx: LowerContext, node: Any, operands: list[Any]) -> Any:
    return operands[0]


def lower_qlut(ctx: LowerContext, node: Any, operands: list[Any]) -> ValueRef:
    """``lut`` (256 entries) for qint8 codes, ``lut16`` (the segmented table's knots and format version) for qint16."""
    op = node.op
    x = tensor_ref(operands[0], node)
    if ctx.values[x].dtype == torch.int8:
        c = ctx.const(f"{_hint(node)}.table", operands[1])
        return ValueRef(ctx.emit("lut", [x], {"what": op.function}, {"table": c}, node.name, _hint(node)))
    if ctx.values[x].dtype != torch.int16:
        raise LoweringError(
            f"node '{node.name}': qlut ({op.function}) takes qint8 or qint16 codes, got {ctx.values[x].dtype}"
        )
    if operands[2].numel() == 0:
        raise LoweringError(
            f"node '{node.name}': qlut ({op.function}) has no segmented table for qint16 input (the function is "
            "undefined on part of the qint16 range at its input scale); give its producer a qint8 qconfig"
        )
    c = ctx.const(f"{_hint(node)}.table16", operands[2].to(torch.int32))
    attrs = {"what": op.function, "out_dtype": op.out.dtype.name, "version": int(op.table16_version)}
    return ValueRef(ctx.emit("lut16", [x], attrs, {"table": c}, node.name, _hint(node)))


def lower_qdiv(ctx: LowerContext, node: Any, operands: list[Any]) -> ValueRef:
    op = node.op
    ins = [tensor_ref(operands[0], node), tensor_ref(operands[1], node)]
    attrs = {"multiplier": int(op.multiplier), "shift": int(op.shift), "out_dtype": op.out.dtype.name}
    return ValueRef(ctx.emit("div", ins, attrs, {}, node.name, _hint(node)))


# ----------------------------------------------------------------------------- pools


def _emit_maxpool(ctx: LowerContext, node: Any, operands: list[Any]) -> ValueRef:
    """The ``maxpool2d`` kernel for a max pool op (codes keep their scale: one kernel for both ops)."""
    op = node.op
    x = tensor_ref(operands[0], node)
    stride = op.stride if op.stride is not None else op.kernel_size
    attrs = {
        "kernel_size": _plain(op.kernel_size),
        "stride": _plain(stride),
        "padding": _plain(op.padding),
        "dilation": _plain(op.dilation),
        "ceil_mode": bool(op.ceil_mode),
    }
    return ValueRef(ctx.emit("maxpool2d", [x], attrs, {}, node.name, _hint(node)))


def lower_qmax_pool2d(ctx: LowerContext, node: Any, operands: list[Any]) -> ValueRef:
    return _emit_maxpool(ctx, node, operands)


def lower_max_pool2d_codes(ctx: LowerContext, node: Any, operands: list[Any]) -> ValueRef:
    """A torch ``nn.MaxPool2d`` left in a converted model (eager flows) pools codes: the same kernel."""
    op = node.op
    if op.return_indices:
        raise LoweringError(f"node '{node.name}': max_pool2d with return_indices=True has no compiled form")
    return _emit_maxpool(ctx, node, operands)


def lower_qavg_pool2d(ctx: LowerContext, node: Any, operands: list[Any]) -> ValueRef:
    op = node.op
    x = tensor_ref(operands[0], node)
    attrs = {
        "kernel_size": list(op.kernel_size),
        "stride": list(op.stride),
        "padding": list(op.padding),
        "ceil_mode": bool(op.ceil_mode),
        "count_include_pad": bool(op.count_include_pad),
        "divisor_override": op.divisor_override,
        "out_dtype": op.out.dtype.name,
    }
    consts = {
        "multipliers": ctx.const(f"{_hint(node)}.multipliers", operands[1]),
        "shifts": ctx.const(f"{_hint(node)}.shifts", operands[2]),
    }
    return ValueRef(ctx.emit("avgpool2d", [x], attrs, consts, node.name, _hint(node)))


def lower_qadaptive_avg_pool2d(ctx: LowerContext, node: Any, operands: list[Any]) -> ValueRef:
    op = node.op
    x = tensor_ref(operands[0], node)
    h, w = (int(d) for d in ctx.values[x].shape[-2:])
    o = op.output_size
    oh, ow = (o, o) if isinstance(o, int) else (o[0], o[1])
    hs, he = adaptive_bounds(h, h if oh is None else int(oh))
    ws, we = adaptive_bounds(w, w if ow is None else int(ow))
    top = int((he - hs).max()) * int((we - ws).max())
    mult, sh = avg_pool_params(op.in_scales[0], op.out.scale[0], top, op.march)
    consts = {
        "multipliers": ctx.const(f"{_hint(node)}.multipliers", mult),
        "shifts": ctx.const(f"{_hint(node)}.shifts", sh),
    }
    attrs = {"output_size": [oh, ow], "out_dtype": op.out.dtype.name}
    return ValueRef(ctx.emit("adaptive_avgpool2d", [x], attrs, consts, node.name, _hint(node)))


# ----------------------------------------------------------------------------- resize


def nearest_maps(h: int, w: int, call: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Source row / column of every output pixel: torch's nearest resize applied to an index image."""
    idx = torch.arange(h * w, dtype=torch.float64).reshape(1, 1, h, w)
    out = call(idx)[0, 0].to(torch.int64)
    return (out[:, 0] // w).contiguous(), (out[0, :] % w).contiguous()


def size_operand(ctx: LowerContext, node: Named, size: Any) -> tuple[Any, str | None]:
    """A resize's run-time ``size`` argument (``size=lateral.shape[2:]``): its example value, for
    the tables, and a value name the kernel reads to check that the size it was compiled for is
    the size asked at run time (None when the size is a literal or absent)."""
    if size is None:
        return None, None
    ex = ctx.example(size)
    if not names_in(size):
        return ex, None
    ref = size.name if isinstance(size, ValueRef) else shape_call(ctx, node, "identity", [size]).name
    return ex, ref


def emit_nearest(
    ctx: LowerContext,
    node: Named,
    x: str,
    call: Callable[[torch.Tensor], torch.Tensor],
    size_ref: str | None = None,
) -> ValueRef:
    h, w = (int(d) for d in ctx.values[x].shape[-2:])
    rows, cols = nearest_maps(h, w, call)
    consts = {"rows": ctx.const(f"{node.name}.rows", rows), "cols": ctx.const(f"{node.name}.cols", cols)}
    attrs: dict[str, Any] = {"in_size": [h, w]}
    if size_ref is not None:  # tables hold the compiled output size: the kernel checks the run-time one
        attrs["out_size"] = [len(rows), len(cols)]
    ins = [x] if size_ref is None else [x, size_ref]
    return ValueRef(ctx.emit("resize_nearest", ins, attrs, consts, node.name, "resize"))


def lower_qinterpolate(ctx: LowerContext, node: Any, operands: list[Any]) -> ValueRef:
    op = node.op
    x = tensor_ref(operands[0], node)
    size, size_ref = size_operand(ctx, node, operands[1] if op.run_time_size else None)
    if op.mode == "nearest":
        return emit_nearest(
            ctx,
            node,
            x,
            lambda t: F.interpolate(
                t,
                size=op.size if size is None else size,
                scale_factor=op.scale_factor if size is None else None,
                mode="nearest",
                recompute_scale_factor=op.recompute_scale_factor if size is None else None,
            ),
            size_ref,
        )
    if op.mode != "bilinear":
        raise LoweringError(f"node '{node.name}': qinterpolate mode '{op.mode}' has no integer kernel")
    h, w = (int(d) for d in ctx.values[x].shape[-2:])
    oh, ow, fh, fw = resize_out_size(
        h, w, op.size if size is None else size, op.scale_factor, op.recompute_scale_factor
    )
    ac = bool(op.align_corners)
    consts: dict[str, str] = {}
    attrs: dict[str, Any] = {"in_size": [h, w], "out_dtype": op.out.dtype.name}
    if size_ref is not None:
        attrs["out_size"] = [oh, ow]
    # Taps for both input widths: B = 12 fraction bits for int8 codes, 15 for int16 (module rule).
    for bits in (12, 15):
        hi0, hi1, hw0, hw1 = bilinear_taps(h, oh, fh, ac, bits)
        wi0, wi1, ww0, ww1 = bilinear_taps(w, ow, fw, ac, bits)
        for k, t in (("hi0", hi0), ("hi1", hi1), ("wi0", wi0), ("wi1", wi1)):
            consts[k] = ctx.const(f"{node.name}.{k}", t)
        for k, t in ((f"hw0_{bits}", hw0), (f"hw1_{bits}", hw1), (f"ww0_{bits}", ww0), (f"ww1_{bits}", ww1)):
            consts[k] = ctx.const(f"{node.name}.{k}", t)
        # The weights' 2**-2B folds into the shift (docs/modules.md, bilinear resize).
        attrs[f"multiplier{bits}"] = int(op.multiplier)
        attrs[f"shift{bits}"] = int(op.shift) + 2 * bits
    ins = [x] if size_ref is None else [x, size_ref]
    return ValueRef(ctx.emit("resize_bilinear", ins, attrs, consts, node.name, _hint(node)))


#: IR op name -> the shared rule; each march's rules.py registers the ones it lowers
OP_RULES: dict[str, Callable[[LowerContext, Any, list[Any]], Any]] = {
    "qquant_stub": lower_qquant_stub,
    "qdequant_stub": lower_qdequant_stub,
    "qrelu": lower_qrelu,
    "qrelu6": lower_qrelu6,
    "qidentity": lower_qidentity,
    "qlut": lower_qlut,
    "qdiv": lower_qdiv,
    "qmax_pool2d": lower_qmax_pool2d,
    "max_pool2d": lower_max_pool2d_codes,
    "qavg_pool2d": lower_qavg_pool2d,
    "qadaptive_avg_pool2d": lower_qadaptive_avg_pool2d,
    "qinterpolate": lower_qinterpolate,
}
