"""``convert_fx`` for the ops that run on codes (:data:`~qir.quantization.scale_ops.CODE_OPS`).

Two steps, both driven by the scales and dtypes :func:`qir.quantization.convert.input_scales`
propagates:

* :func:`classify` tells what a call returns on codes: codes at its input's scale (abs,
  clamp, pad, gather, whole-tensor max / min, max / min of two tensors on one scale),
  ``(values, indices)`` (max / min along a dim, top-k), or exact values without a scale
  (arg-reductions' indices, comparisons' booleans). Unsupported variants raise
  :class:`CodeOpError` naming the node and the fix.
* :func:`rewrite_code_ops` replaces the calls that are not exact on codes as written by
  their integer forms (:mod:`qir.quantization.code_ops`): ``abs`` -> ``abs_codes``,
  ``clamp`` -> ``clamp_codes`` with code bounds, a comparison with a number ->
  ``compare_codes``, a constant pad's value -> its code. Eager models (whose forward cannot
  be rewritten) get an error for the first three and for ``F.pad`` with a non-zero value.

The integer rules and why they equal the QAT results: docs/semantics.md, "Ops on codes".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from qir.ir.types import DType
from qir.quantization.code_ops import (
    COMPARISONS,
    abs_codes,
    clamp_codes,
    compare_codes,
    compare_range,
    constant_code,
    flipped,
    rounded_code,
)
from qir.quantization.scale_ops import BOOL, CODE_OPS, CODES, INDEX, PAIR, REDUCE, code_op

__all__ = [
    "CONVERTED_FORMS",
    "EXACT",
    "CodeOpError",
    "CodeResult",
    "classify",
    "compare_bounds",
    "number_comparison_error",
    "pad_code",
    "require_per_tensor",
    "rewrite_code_ops",
    "tensor_comparison_error",
]

Scale = torch.Tensor | None

_CONSTANT_PADS = (nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d)


#: IR op -> what a converted graph calls for it: ("function", callable) / ("method", name). The
#: lowering has a rule for each (docs/coverage.md reads this table). Eager graphs keep the
#: tensor-method spellings of the ops that need no rewrite.
CONVERTED_FORMS: dict[str, tuple[tuple[str, Any], ...]] = {
    "abs": (("function", abs_codes),),
    "clamp": (("function", clamp_codes),),
    "pad": (("function", F.pad),),
    "gather": (("function", torch.gather), ("method", "gather")),
    "max": (("function", torch.max), ("method", "max")),
    "min": (("function", torch.min), ("method", "min")),
    "topk": (("function", torch.topk), ("method", "topk")),
    "argmax": (("function", torch.argmax), ("method", "argmax")),
    "argmin": (("function", torch.argmin), ("method", "argmin")),
    # with a number: compare_codes; two tensors on one scale: the operator as written
    **{op: (("function", compare_codes), ("function", fn), ("method", op)) for op, fn in COMPARISONS.items()},
}


class CodeOpError(ValueError):
    """A call on codes has no exact integer form (the message names the node and the fix)."""


@dataclass(frozen=True)
class CodeResult:
    """What a call on codes returns: ``kind`` is ``codes``, ``pair`` (values, indices) or ``exact``
    (indices / booleans: no scale); ``scale`` / ``dtype`` are the codes' (the values' for a pair)."""

    kind: str
    scale: Scale = None
    dtype: DType | None = None


EXACT = "exact"


def _arg(n: torch.fx.Node, i: int, name: str, default: Any = None) -> Any:
    """Argument ``i`` (or keyword ``name``) of a call; a method's receiver is argument 0."""
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def _spelling(n: torch.fx.Node) -> str:
    if n.op == "call_method":
        return f"Tensor.{n.target}"
    return getattr(n.target, "__name__", str(n.target))


def require_per_tensor(s: torch.Tensor, where: str, what: str) -> None:
    """Raise naming ``where`` when ``s`` is per channel: a constant has no single code there."""
    if s.numel() != 1:
        raise CodeOpError(
            f"{where} {what} on a tensor with per-channel scales (a high-precision "
            "qint32 output); its constant has no single code: give the producer an output fake quant "
            "(a qconfig with an activation)"
        )


def _per_tensor(s: torch.Tensor, n: torch.fx.Node, what: str) -> None:
    require_per_tensor(s, f"{_spelling(n)} at node '{n.name}'", what)


def classify(n: torch.fx.Node, op: str, scales: Mapping[str, Scale], dtypes: Mapping[str, DType | None]) -> CodeResult:
    """What the :data:`CODE_OPS` call ``n`` (IR op ``op``) returns when its inputs are codes."""
    kind = CODE_OPS[op]
    if kind == BOOL:
        return _classify_compare(n, op, scales, dtypes)
    data = _arg(n, 0, "input")
    if not isinstance(data, torch.fx.Node) or scales.get(data.name) is None:
        raise CodeOpError(
            f"{_spelling(n)} at node '{n.name}': its data input is not quantized but another input is; "
            "put a QuantStub in front of the data, or a DeQuantStub before the other input"
        )
    s, dt = scales[data.name], dtypes.get(data.name)
    if op == "clamp":
        for bound in ("min", "max"):
            v = _arg(n, 1 if bound == "min" else 2, bound)
            if isinstance(v, torch.fx.Node):
                raise CodeOpError(
                    f"{_spelling(n)} at node '{n.name}' has a tensor {bound} bound; only numbers (or None) are "
                    f"supported on quantized tensors: use torch.{'maximum' if bound == 'min' else 'minimum'}"
                    "(x, bound), which prepare_qat_fx turns into a FloatFunctional with its own output scale"
                )
        _per_tensor(s, n, "clamps")  # type: ignore[arg-type]
    elif kind == REDUCE:
        other = _arg(n, 1, "other")
        if isinstance(other, torch.fx.Node):
            return _classify_two_tensor_max(n, op, data, other, scales, dtypes)
        dim = _arg(n, 1, "dim")
        return CodeResult(PAIR if dim is not None else CODES, s, dt)
    if kind == PAIR:
        return CodeResult(PAIR, s, dt)
    if kind == INDEX:
        return CodeResult(EXACT)
    return CodeResult(CODES, s, dt)


def _same_scale(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.numel() == 1
        and b.numel() == 1
        and bool(torch.equal(a.reshape(()).to(torch.float32), b.reshape(()).to(torch.float32)))
    )


def _classify_two_tensor_max(
    n: torch.fx.Node,
    op: str,
    x: torch.fx.Node,
    y: torch.fx.Node,
    scales: Mapping[str, Scale],
    dtypes: Mapping[str, DType | None],
) -> CodeResult:
    sx, sy = scales.get(x.name), scales.get(y.name)
    if sx is None or sy is None or not _same_scale(sx, sy):
        fn = "maximum" if op == "max" else "minimum"
        raise CodeOpError(
            f"{_spelling(n)} of two tensors at node '{n.name}': the operands have different scales "
            f"({_show(sx)} vs {_show(sy)}), so the result needs its own output scale: call torch.{fn}(x, y) "
            f"through prepare_qat_fx (it generates a FloatFunctional.{fn}) or use a FloatFunctional in the model"
        )
    return CodeResult(CODES, sx, dtypes.get(x.name))


def _show(s: Scale) -> str:
    if s is None:
        return "float"
    return f"{float(s.reshape(-1)[0]):.6g}" if s.numel() == 1 else f"{s.numel()} per-channel scales"


def _operands(n: torch.fx.Node) -> tuple[Any, Any]:
    return _arg(n, 0, "input"), _arg(n, 1, "other")


def tensor_comparison_error(operands: Sequence[tuple[str, Scale, DType | None]]) -> str | None:
    """Why a comparison of two tensors, given as ``(name, scale, code dtype)`` (scale None: a float
    tensor), cannot run on codes, or None: both quantized, on one per-tensor scale, qint8 / qint16.
    The message follows the comparison's name (``x > y at node 'gt'`` / ``gt``). Both conversions
    (``convert_fx``'s module swapping and the ``quantize`` pass's code rule) ask it."""
    (na, sa, da), (nb, sb, db) = operands
    if sa is None or sb is None:
        return (
            "compares a quantized tensor with a float one; compare two quantized tensors on one scale, "
            "or a quantized tensor with a Python number"
        )
    if not _same_scale(sa, sb):
        return (
            f"compares tensors at different scales ({_show(sa)} vs {_show(sb)}); integer codes compare exactly "
            "only on one scale: give both operands one scale (produce them with one module, or fixed-scale "
            "QuantStubs), or compare their difference with a number ((x - y) > 0: the subtraction gets its own "
            "output scale)"
        )
    for name, dt in ((na, da), (nb, db)):
        if dt not in (DType.qint8, DType.qint16):
            return (
                f"operand '{name}' is {getattr(dt, 'name', 'unknown')}; tensor comparisons on codes are exact "
                "for qint8 / qint16 only (float32 cannot tell qint32 neighbours apart)"
            )
    return None


def number_comparison_error(number: Any) -> str | None:
    """Why a comparison of codes with ``number`` cannot run on codes (not a Python number), or None."""
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        return (
            f"compares a quantized tensor with {type(number).__name__} {number!r:.40}; compare with a Python "
            "number or with a quantized tensor on the same scale"
        )
    return None


def compare_bounds(cmp: str, value: float, scale: torch.Tensor, dtype: DType | None) -> tuple[int | None, int | None]:
    """:func:`compare_range` of codes of ``dtype`` (None: unknown), a bound at or beyond the dtype's ends
    dropped (it tests nothing): the constants of the ``compare_codes`` call both conversions write."""
    lo, hi = compare_range(cmp, value, scale)
    if dtype is not None:
        qmin, qmax = dtype.qrange
        lo = None if lo is not None and lo <= qmin else lo
        hi = None if hi is not None and hi >= qmax else hi
    return lo, hi


def _classify_compare(
    n: torch.fx.Node, op: str, scales: Mapping[str, Scale], dtypes: Mapping[str, DType | None]
) -> CodeResult:
    a, b = _operands(n)
    tensors = [v for v in (a, b) if isinstance(v, torch.fx.Node)]
    quantized = [v for v in tensors if scales.get(v.name) is not None]
    if len(tensors) == 2:
        why = tensor_comparison_error([(v.name, scales.get(v.name), dtypes.get(v.name)) for v in tensors])
    else:
        why = number_comparison_error(b if isinstance(a, torch.fx.Node) else a)
    if why is not None:
        sep = ":" if why.startswith("operand") else ""
        raise CodeOpError(f"{_spelling(n)} at node '{n.name}'{sep} {why}")
    if len(tensors) != 2:
        _per_tensor(scales[quantized[0].name], n, "compares")  # type: ignore[arg-type]
    return CodeResult(EXACT)


# ---------------------------------------------------------------------------------------------
# rewriting


Change = Callable[[], None]


def _replace(g: torch.fx.Graph, n: torch.fx.Node, fn: Callable[..., Any], data: int, consts: tuple[Any, ...]) -> Change:
    """Replace ``n`` by ``fn(<n's argument data>, *consts)``; the data argument is read when the change
    applies, so an earlier change to its producer (abs before clamp) is seen."""

    def apply() -> None:
        x = _arg(n, data, "input" if data == 0 else "other")
        with g.inserting_after(n):
            new = g.call_function(fn, (x, *consts))
        n.replace_all_uses_with(new)
        g.erase_node(n)

    return apply


def _dtype(dtypes: Mapping[str, DType | None], x: torch.fx.Node, n: torch.fx.Node) -> DType:
    dt = dtypes.get(x.name)
    if dt is None:
        raise CodeOpError(f"{_spelling(n)} at node '{n.name}': the code dtype of its input '{x.name}' is unknown")
    return dt


def _eager_error(n: torch.fx.Node, why: str) -> CodeOpError:
    return CodeOpError(
        f"the forward calls {_spelling(n)} on a quantized tensor (node '{n.name}'); {why}, and eager convert cannot "
        "rewrite a forward: convert with prepare_qat_fx / convert_fx, which rewrites the call onto codes"
    )


def _clamp_change(n: torch.fx.Node, g: torch.fx.Graph, s: torch.Tensor, dt: DType) -> Change:
    lo, hi = (_arg(n, i, k) for i, k in ((1, "min"), (2, "max")))
    codes = [None if v is None else constant_code(float(v), s, dt) for v in (lo, hi)]
    return _replace(g, n, clamp_codes, 0, (codes[0], codes[1]))


def _compare_change(
    n: torch.fx.Node, op: str, g: torch.fx.Graph, scales: Mapping[str, Scale], dtypes: Mapping[str, DType | None]
) -> Change | None:
    a, b = _operands(n)
    if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node):
        return None  # one scale (classify checked): codes compare as the values do
    x, value, cmp = (a, b, op) if isinstance(a, torch.fx.Node) else (b, a, flipped(op))
    try:
        lo, hi = compare_bounds(cmp, value, scales[x.name], dtypes.get(x.name))  # type: ignore[arg-type]
    except (ValueError, TypeError) as e:
        raise CodeOpError(f"{_spelling(n)} at node '{n.name}': {e}") from e
    return _replace(g, n, compare_codes, 0 if x is a else 1, (cmp, value, lo, hi))


def _pad_code(n: torch.fx.Node, value: float, s: torch.Tensor, dt: DType, where: str) -> int:
    return pad_code(value, s, dt, f"{where} at node '{n.name}'")


def pad_code(value: float, s: torch.Tensor, dt: DType, where: str) -> int:
    """The code a constant pad's ``value`` becomes at scale ``s`` (``where`` names the call in errors)."""
    qmin, qmax = dt.qrange
    try:
        raw = rounded_code(value, s)
    except ValueError as e:
        raise CodeOpError(f"{where}: pad value {value}: {e}") from e
    if not qmin <= raw <= qmax:
        s_f = float(s.reshape(-1)[0])
        raise CodeOpError(
            f"{where} pads with {value}, which is code {raw:.0f} at the input's scale {s_f:.6g}, "
            f"outside {dt.name}'s range [{qmin}, {qmax}]; pad with a value within [{qmin * s_f:.6g}, "
            f"{qmax * s_f:.6g}] (for a following max pool: {qmin * s_f:.6g}, the smallest value the codes hold)"
        )
    return int(raw)


def _fpad_change(n: torch.fx.Node, s: torch.Tensor, dt: DType, eager: bool) -> Change | None:
    mode = _arg(n, 2, "mode", "constant")
    value = _arg(n, 3, "value")
    if mode != "constant" or value is None or float(value) == 0.0:
        return None  # data movement, or zeros: exact on codes as written
    if eager:
        raise _eager_error(n, "its pad value must become a code")
    _per_tensor(s, n, "pads a constant")
    code = _pad_code(n, float(value), s, dt, "F.pad")

    def apply() -> None:
        pad = _arg(n, 1, "pad")
        n.args = (n.args[0], pad)
        n.kwargs = {"mode": "constant", "value": float(code)}

    return apply


def rewrite_code_ops(
    root: nn.Module,
    gm: torch.fx.GraphModule,
    scales: Mapping[str, Scale],
    dtypes: Mapping[str, DType | None],
    eager: bool = False,
) -> None:
    """Rewrite ``gm``'s calls on codes into their integer forms (module swaps also in ``root``).

    Every call is checked before anything changes: an error leaves the model whole."""
    g = gm.graph
    changes: list[Change] = []
    pad_codes: dict[str, tuple[nn.Module, float]] = {}
    for n in g.nodes:
        if n.op == "call_module":
            x = n.args[0] if n.args else None
            m = gm.get_submodule(str(n.target))
            if (
                isinstance(m, _CONSTANT_PADS)
                and isinstance(x, torch.fx.Node)
                and scales.get(x.name) is not None
                and float(m.value) != 0.0
            ):
                s = scales[x.name]
                _per_tensor(s, n, "pads a constant")  # type: ignore[arg-type]
                code = float(_pad_code(n, float(m.value), s, _dtype(dtypes, x, n), type(m).__name__))  # type: ignore[arg-type]
                prior = pad_codes.get(str(n.target))
                if prior is not None and prior[1] != code:
                    raise CodeOpError(
                        f"module '{n.target}' ({type(m).__name__}) pads inputs at different scales (codes "
                        f"{prior[1]:.0f} and {code:.0f}); use one module instance per call site"
                    )
                pad_cls: Any = type(m)  # ConstantPad1d / 2d / 3d: each takes its own padding tuple
                pad_codes[str(n.target)] = (pad_cls(m.padding, code), code)
            continue
        if n.op not in ("call_function", "call_method"):
            continue
        op = code_op(n)
        if op is None:
            continue
        data = _arg(n, 0, "input")
        if op in COMPARISONS:
            a, b = _operands(n)
            quantized = any(isinstance(v, torch.fx.Node) and scales.get(v.name) is not None for v in (a, b))
            if not quantized:
                continue
            if eager and not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
                raise _eager_error(n, "its constant must become a code threshold")
            change = _compare_change(n, op, g, scales, dtypes)
        elif not isinstance(data, torch.fx.Node) or scales.get(data.name) is None:
            continue
        elif op == "abs":
            if eager:
                raise _eager_error(n, "|q| must saturate (|-128| is 127 for qint8)")
            change = _replace(g, n, abs_codes, 0, ())
        elif op == "clamp":
            if eager:
                raise _eager_error(n, "its bounds must become codes")
            change = _clamp_change(n, g, scales[data.name], _dtype(dtypes, data, n))  # type: ignore[arg-type]
        elif op == "pad":
            change = _fpad_change(n, scales[data.name], _dtype(dtypes, data, n), eager)  # type: ignore[arg-type]
        else:
            change = None
        if change is not None:
            changes.append(change)
    for apply in changes:
        apply()
    from qir.quantization.prepare import set_submodule

    for path, (module, _) in pad_codes.items():
        module.train(False)
        set_submodule(root, path, module)
        if root is not gm:
            set_submodule(gm, path, module)
    if changes:
        gm.recompile()
