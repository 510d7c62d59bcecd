"""``export_to_onnx``: float and QAT models to ONNX, fake quants as QuantizeLinear/DequantizeLinear.

The export goes through torch's ``torch.export``-based ONNX exporter (``dynamo=True``, which
needs onnxscript). Every qir :class:`~qir.quantization.fake_quantize.FakeQuantize` of a deep
copy of the model is switched to call the custom op ``qir::onnx_fake_quant``, which the
exporter translates to a ``QuantizeLinear -> DequantizeLinear`` pair with the fake quant's
scale, an int8/int16 zero point of 0 on the QuantizeLinear (the DequantizeLinear's default zero
point is that same 0) and, per channel, ``axis``. See docs/onnx.md.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO, Any

import torch
from torch import nn

from qir.ir.types import DType
from qir.quantization.fake_quantize import FakeQuantize, float_fake_quant
from qir.utils.onnx.model_copy import export_copy
from qir.utils.onnx.ort_layout import ort_fusable_layout

__all__ = ["DEFAULT_OPSET", "LAYOUTS", "MIN_OPSET", "export_to_onnx"]

#: ``qdq_layout`` values: "fake_quant" (default) writes one Q/DQ pair per fake quant, as the model
#: has them; "onnxruntime" rewrites them into what onnxruntime fuses into integer kernels.
LAYOUTS = ("fake_quant", "onnxruntime")

#: The lowest opset with int16 QuantizeLinear/DequantizeLinear (int8 alone works from MIN_OPSET).
DEFAULT_OPSET = 21
#: Below 18 torch's exporter builds at 18 and down-converts, which fails for common ops; checked after export.
MIN_OPSET = 13
_INT16_OPSET = 21

# -- the ONNX side --------------------------------------------------------------------------


def _require_onnx() -> None:
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise ImportError(f"export_to_onnx needs onnx and onnxscript: pip install 'qir[onnx]' ({e})") from e


def _max_opset() -> int:
    import onnx
    from onnxscript import onnx_opset

    have = [int(n[len("opset") :]) for n in dir(onnx_opset) if n.startswith("opset") and n[len("opset") :].isdigit()]
    return min(max(have), onnx.defs.onnx_opset_version())


def _translation(opset: int) -> Any:
    """The onnxscript translation of ``qir::onnx_fake_quant`` for a model exported at ``opset``."""
    from onnxscript import onnx_opset

    # torch builds the graph at max(opset, 18) and converts down afterwards, so the nodes must
    # come from the build opset.
    op = getattr(onnx_opset, f"opset{max(opset, 18)}")

    def onnx_fake_quant(x: Any, scale: Any, zero_point: Any, axis: int | None = None) -> Any:
        kw = {} if axis is None else {"axis": axis}
        q = op.QuantizeLinear(x, scale, zero_point, **kw)
        # The DequantizeLinear takes no zero point: its default is 0 of its input's type, which is
        # the same value. onnxruntime (1.31) fails to load, or mistypes, graphs where the pair
        # shares an int8 zero point and its QDQ propagation copies the DequantizeLinear past a
        # Reshape; the Q-only form loads at every optimization level (tests/onnx, docs/onnx.md).
        return op.DequantizeLinear(q, scale, **kw)

    return onnx_fake_quant


def _strip_default_attributes(model: Any) -> None:
    """Drop the default-valued attributes onnxscript writes on Q/DQ nodes (and ``axis`` per tensor)."""
    import onnx

    version = next((v for d, v in model.opset_imports.items() if d == ""), None)
    if version is None:
        return
    for node in model.graph.all_nodes():
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        schema = onnx.defs.get_schema(node.op_type, version)
        per_tensor = node.inputs[1] is not None and node.inputs[1].shape is not None and len(node.inputs[1].shape) == 0
        for name in list(node.attributes):
            spec = schema.attributes.get(name)
            if spec is None:
                continue
            attr = node.attributes[name]
            default = onnx.helper.get_attribute_value(spec.default_value) if spec.default_value.name else None
            if (name == "axis" and per_tensor) or (default is not None and attr.value == default):
                del node.attributes[name]


def _check_opset_args(opset_version: int | None, model: nn.Module) -> int:
    opset = DEFAULT_OPSET if opset_version is None else opset_version
    if not isinstance(opset, int) or isinstance(opset, bool):
        raise TypeError(f"opset_version must be an int, got {type(opset_version).__name__}")
    top = _max_opset()
    if not MIN_OPSET <= opset <= top:
        raise ValueError(f"opset_version {opset} is not supported: use {MIN_OPSET}..{top} (default {DEFAULT_OPSET})")
    if opset < _INT16_OPSET:
        int16 = [n for n, m in model.named_modules() if isinstance(m, FakeQuantize) and m.dtype is DType.qint16]
        if int16:
            raise ValueError(
                f"opset_version {opset} has no int16 QuantizeLinear; int16 fake quants ({', '.join(int16[:3])}) "
                f"need opset >= {_INT16_OPSET}"
            )
    return opset


def _check_mode_args(training: Any, operator_export_type: Any, custom_opsets: Mapping[str, int] | None) -> None:
    from torch.onnx import OperatorExportTypes, TrainingMode

    if training not in (None, False, TrainingMode.EVAL):
        raise NotImplementedError(
            f"training={training!r}: export_to_onnx exports the model in eval mode only "
            "(fake quants with frozen scales, batch norm with running statistics); pass None or TrainingMode.EVAL"
        )
    # Nothing falls through to ATen: every op becomes standard ONNX or the export fails, so the
    # plugin's default ONNX_FALLTHROUGH and plain ONNX mean the same here.
    if operator_export_type not in (None, OperatorExportTypes.ONNX, OperatorExportTypes.ONNX_FALLTHROUGH):
        raise NotImplementedError(
            f"operator_export_type={operator_export_type!r} is not supported: the exported graph holds "
            "standard ONNX ops only; pass None, OperatorExportTypes.ONNX or OperatorExportTypes.ONNX_FALLTHROUGH"
        )
    if custom_opsets:
        raise NotImplementedError(
            f"custom_opsets={dict(custom_opsets)!r}: the exported graph uses the standard ONNX domain only"
        )


def _split_args(args: Any) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """torch.onnx.export's convention: a tensor, or a tuple whose last element may be a kwargs dict."""
    if isinstance(args, torch.Tensor):
        return (args,), None
    if isinstance(args, list):
        args = tuple(args)
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tensor or a tuple of inputs, got {type(args).__name__}")
    if args and isinstance(args[-1], dict):
        return args[:-1], dict(args[-1])
    return args, None


@contextmanager
def _quiet_exporter(verbose: bool) -> Iterator[None]:
    # The exporter logs a warning per optional torchvision op it cannot register: noise for qir users.
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    old = logger.level
    if not verbose:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            # torch's exporter trips its own pytree deprecation; not actionable for the caller
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            yield
    finally:
        logger.setLevel(old)


def _save(program: Any, f: str | os.PathLike[str] | IO[bytes], export_params: bool, keep_inputs: bool) -> str | None:
    """Write the model; returns the path written when ``f`` is a path."""
    if isinstance(f, (str, os.PathLike)):
        path = os.fspath(f)
        program.save(path, include_initializers=export_params, keep_initializers_as_inputs=keep_inputs)
        return path
    if not (hasattr(f, "write") and callable(f.write)):
        raise TypeError(f"f must be a path or a binary file object, got {type(f).__name__}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        program.save(
            path, include_initializers=export_params, keep_initializers_as_inputs=keep_inputs, external_data=False
        )
        with open(path, "rb") as src:
            f.write(src.read())
    return None


def export_to_onnx(
    model: nn.Module,
    args: torch.Tensor | tuple[Any, ...],
    f: str | os.PathLike[str] | IO[bytes],
    export_params: bool = True,
    verbose: bool = False,
    training: Any = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    operator_export_type: Any = None,
    opset_version: int | None = None,
    do_constant_folding: bool = True,
    dynamic_axes: Mapping[str, Mapping[int, str]] | Mapping[str, Sequence[int]] | None = None,
    keep_initializers_as_inputs: bool | None = None,
    custom_opsets: Mapping[str, int] | None = None,
    enable_onnx_checker: bool = True,
    qdq_layout: str = "fake_quant",
) -> None:
    """Export a float, calibration or QAT ``model`` to ONNX at ``f`` (a path or a binary file object).

    Each enabled qir fake quant becomes ``QuantizeLinear -> DequantizeLinear`` (int8 or int16,
    zero point 0, ``axis`` when per channel); a disabled one exports as identity. The export runs
    on an eval-mode deep copy, so ``model`` (its training flags, scales and observers) is untouched.
    A weight fed straight to its ``weight_fake_quant`` is stored fake-quantized, so the exported
    weight codes equal qir's even where ONNX's half-to-even rounding would differ.

    The parameters mirror ``torch.onnx.export``'s. ``opset_version`` defaults to
    :data:`DEFAULT_OPSET` (21, the first with int16 Q/DQ). ``do_constant_folding`` runs
    onnxscript's graph optimizer (fake-quant pairs are kept). ``training`` must be None/EVAL,
    ``operator_export_type`` None/ONNX/ONNX_FALLTHROUGH, ``custom_opsets`` empty.
    ``enable_onnx_checker`` runs ``onnx.checker.check_model`` on the result.

    ``qdq_layout="fake_quant"`` (the default) writes each fake quant as its own Q/DQ pair.
    ``qdq_layout="onnxruntime"`` stores weights as int8 initializers and conv / linear biases as
    int32 at ``s_in * s_w`` (qir's integer bias), and places Q/DQ so onnxruntime fuses convs and
    adds into ``QLinearConv`` / ``QLinearAdd``. It computes what qir's converted model computes
    except at a fused conv + add, which gets one extra rounding (docs/onnx.md).
    """
    _require_onnx()
    import onnx

    if not isinstance(model, nn.Module):
        raise TypeError(f"export_to_onnx needs an nn.Module, got {type(model).__name__}")
    _check_mode_args(training, operator_export_type, custom_opsets)
    if qdq_layout not in LAYOUTS:
        raise ValueError(f"qdq_layout={qdq_layout!r} is not one of {', '.join(map(repr, LAYOUTS))}")
    opset = _check_opset_args(opset_version, model)
    pos, kwargs = _split_args(args)
    dup = export_copy(model, pos, kwargs)
    # float_fake_quant: export the fake-quant graph even when the model is in validation state
    with torch.no_grad(), _quiet_exporter(verbose), float_fake_quant():
        program = torch.onnx.export(
            dup,
            pos,
            None,
            kwargs=kwargs,
            verbose=verbose,
            input_names=input_names,
            output_names=output_names,
            opset_version=opset,
            dynamo=True,
            dynamic_axes=dynamic_axes,
            custom_translation_table={torch.ops.qir.onnx_fake_quant.default: _translation(opset)},
            optimize=do_constant_folding,
        )
    if program is None:  # dynamo=True returns the program; guard against a torch that does not
        raise RuntimeError("torch.onnx.export(dynamo=True) returned no ONNX program")
    got = next((v for d, v in program.model.opset_imports.items() if d == ""), None)
    if got != opset:
        raise RuntimeError(
            f"torch's ONNX exporter could not convert this model to opset {opset} (it stayed at {got}); "
            f"use opset_version >= 18"
        )
    if qdq_layout == "onnxruntime":
        ort_fusable_layout(program.model)
    _strip_default_attributes(program.model)
    path = _save(program, f, export_params, bool(keep_initializers_as_inputs))
    if enable_onnx_checker:
        # A saved path is checked from disk (this handles external data); otherwise the in-memory proto.
        target: Any = path if path is not None and export_params else program.model_proto
        onnx.checker.check_model(target, full_check=True)
