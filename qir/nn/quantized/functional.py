"""``QFunctional``: the integer FloatFunctional, plus the float ``FloatFunctional`` re-exported here.

``from_qat(qat_ff, input_scales, march)`` takes the scales of the call site's tensor inputs
in order (``cat`` / ``stack``: one per list element). Integer parameters are derived from
those fixed scales on the first call of a method and cached. Rules (docs/modules.md
"FloatFunctional"): add / sub via ``add_params`` + ``add_int``; mul / matmul via the exact
product and ``conv_requant_params``; cat / stack / maximum / minimum requantize each input
to the output scale (a copy when the scales are equal); sum / mean sum exactly in int64 and
requantize (mean folds ``1 / n`` into the multiplier); div via ``div_int``; exp, ceil and floor
via a LUT; matmul's ``x_trans`` / ``y_trans`` transpose the codes first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from backends.common import numerics
from backends.common.integer_rules import (
    add_scalar_int,
    check_out_dtype,
    div_int,
    div_params,
    f32,
    mul_scalar_int,
    ratio_params,
)
from backends.common.lut_segmented import lut_int16_apply, method_table16
from qir.ir.table16 import LATEST
from qir.ir.types import DType
from qir.nn.modules.functional import FLOAT_FUNCTIONAL_METHODS, Dims, FloatFunctional, _dims, scalar_call
from qir.nn.modules.traced_calls import record_method_calls
from qir.nn.qat.functional import FloatFunctional as QATFloatFunctional
from qir.nn.quantized._base import QuantizedModule, check_qat, march_name, output_fq, untraced
from qir.nn.quantized.stubs import SCALE_TAG

__all__ = ["TAG_OUTPUTS", "FloatFunctional", "QFunctional"]

#: instance flag: the methods tag their results with ``(scale, None)`` (``SCALE_TAG``): set by eager
#: convert on a model whose DeQuantStub is shared by outputs of different scales (eager_scale_tags.py)
TAG_OUTPUTS = "_qir_tag_outputs"


def _tags_output(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``method`` that also tags its result with the output scale when the instance asks for it."""

    @functools.wraps(method)
    def run(self: QFunctional, *args: Any, **kwargs: Any) -> torch.Tensor:
        scalar = scalar_call(method.__name__, args, kwargs)
        if scalar is not None:  # add(x, 2.0) is add_scalar(x, 2.0), as in the QAT model
            return getattr(self, scalar[0])(scalar[1], scalar[2])  # type: ignore[no-any-return]
        out = method(self, *args, **kwargs)
        if self.__dict__.get(TAG_OUTPUTS) and isinstance(out, torch.Tensor):
            out.__dict__[SCALE_TAG] = (self.scale, None)
        return out

    return run


class QFunctional(QuantizedModule):
    """Integer implementations of the FloatFunctional methods (codes in, codes out)."""

    num_inputs = -1  # any number: one per tensor input of the call site
    march: str
    #: the format of ``exp``'s qint16 segmented table (:mod:`qir.ir.table16`): conversion builds the
    #: latest; the class default is the format of modules pickled before the version existed
    table16_version: int = 1

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> QFunctional:
        check_qat(cls, qat, QATFloatFunctional)
        fq = output_fq(qat)
        new = cls()
        new.march = march_name(march)
        new.table16_version = LATEST
        if fq is None:  # high-precision matmul: int32 product at s_x * s_y
            if len(input_scales) != 2:
                raise ValueError(
                    "QFunctional without an output fake quant is a high-precision matmul: give 2 input scales"
                )
            new._set_scales(input_scales, None, DType.qint32)
            acc = numerics.accumulator_scale(new.per_tensor_input(0), new.per_tensor_input(1))
            new.register_buffer("scale", acc.to(torch.float32).reshape(1))
        else:
            new._set_scales(input_scales, fq.scale.detach(), fq.dtype)
            check_out_dtype(new.march, fq.dtype, cls.__name__)
        return new

    # -- helpers -----------------------------------------------------------------------------

    def _cached(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        cache: dict[tuple[Any, ...], Any] = self.__dict__.setdefault("_param_cache", {})
        if key not in cache:
            cache[key] = untraced(make)
        return cache[key]

    def _in(self, i: int) -> float:
        if i >= self.num_input_scales:
            raise ValueError(
                f"QFunctional was converted with {self.num_input_scales} input scale(s) but the call uses input {i}; "
                "from_qat needs one scale per tensor input of the call site"
            )
        return self.per_tensor_input(i)

    @property
    def _out(self) -> float:
        return float(self.scale.reshape(-1)[0])

    def _qdtype(self, method: str) -> DType:
        if self.dtype is None or self.dtype is DType.qint32:
            raise ValueError(f"QFunctional.{method} needs an output fake quant; only matmul has a qint32 output")
        return self.dtype

    def _to_out(self, x: torch.Tensor, i: int, method: str) -> torch.Tensor:
        """Input ``i`` requantized to the output scale and dtype (an exact copy when the scales match)."""
        dt = self._qdtype(method)
        if f32(self._in(i)) == f32(self._out):
            return numerics.saturate(x.to(torch.int64), dt)
        m, s = self._cached(("to_out", i), lambda: numerics.requant_params(self._in(i), self._out, self.march, dt))
        return numerics.requantize(x, m, s, dt)

    def _add(self, x: torch.Tensor, y: torch.Tensor, sy: float, key: str) -> torch.Tensor:
        dt = self._qdtype(key)
        p = self._cached((key,), lambda: numerics.add_params(self._in(0), sy, self._out, self.march, dt))
        return numerics.add_int(x, y, p, dt)

    def _product(self, acc: torch.Tensor, s_a: float, s_b: float, key: str) -> torch.Tensor:
        if self.dtype is DType.qint32:
            return numerics.saturate(acc, DType.qint32)
        dt = self._qdtype(key)
        m, s = self._cached((key,), lambda: numerics.conv_requant_params(s_a, s_b, self._out, self.march, dt))
        return numerics.requantize(acc, m.reshape(()), s.reshape(()), dt)

    # -- methods -----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("QFunctional is not called directly; call one of its methods (add, cat, ...)")

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._add(x, y, self._in(1), "add")

    def add_relu(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.clamp(self._add(x, y, self._in(1), "add"), min=0)

    def sub(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._add(x, y.to(torch.int64).neg(), self._in(1), "sub")

    def add_scalar(self, x: torch.Tensor, y: float) -> torch.Tensor:
        # ``y`` may be computed at run time (``x + w / 4`` with ``w`` from a shape): the rule
        # derives its parameters from it on each call, as the compiled kernel does
        return add_scalar_int(x, y, self._in(0), self._out, self.march, self._qdtype("add_scalar"))

    def mul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._product(x.to(torch.int64) * y.to(torch.int64), self._in(0), self._in(1), "mul")

    def mul_scalar(self, x: torch.Tensor, y: float) -> torch.Tensor:
        # ``y`` may be computed at run time (``x * (1.0 / w)``): see add_scalar
        return mul_scalar_int(x, y, self._in(0), self._out, self.march, self._qdtype("mul_scalar"))

    def div(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dt = self._qdtype("div")
        m, s = self._cached(("div",), lambda: div_params(self._in(0), self._in(1), self._out, self.march))
        return div_int(x, y, m, s, dt)

    def cat(self, x: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return torch.cat([self._to_out(t, i, "cat") for i, t in enumerate(x)], dim=dim)

    def concat(self, x: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return self.cat(x, dim)

    def concatenate(self, x: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return self.cat(x, dim)

    def stack(self, x: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return torch.stack([self._to_out(t, i, "stack") for i, t in enumerate(x)], dim=dim)

    def matmul(self, x: torch.Tensor, y: torch.Tensor, x_trans: bool = False, y_trans: bool = False) -> torch.Tensor:
        xs = x.transpose(-2, -1) if x_trans else x  # moving codes is exact
        ys = y.transpose(-2, -1) if y_trans else y
        acc = torch.matmul(xs.to(torch.float64), ys.to(torch.float64)).to(torch.int64)  # exact below 2**53
        return self._product(acc, self._in(0), self._in(1), "matmul")

    def sum(self, x: torch.Tensor, dim: Dims = None, keepdim: bool = False) -> torch.Tensor:
        d = _dims(dim)
        acc = x.to(torch.int64).sum() if d is None else x.to(torch.int64).sum(dim=d, keepdim=keepdim)
        dt = self._qdtype("sum")
        m, s = self._cached(("sum",), lambda: numerics.requant_params(self._in(0), self._out, self.march, dt))
        return numerics.requantize(acc, m, s, dt)

    def mean(self, x: torch.Tensor, dim: Dims = None, keepdim: bool = False) -> torch.Tensor:
        d = _dims(dim)
        acc = x.to(torch.int64).sum() if d is None else x.to(torch.int64).sum(dim=d, keepdim=keepdim)
        n = x.numel() // max(acc.numel(), 1)
        dt = self._qdtype("mean")
        m, s = self._cached(("mean", n), lambda: ratio_params(f32(self._in(0)) / (n * f32(self._out)), self.march))
        return numerics.requantize(acc, m, s, dt)

    def maximum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.maximum(self._to_out(x, 0, "maximum"), self._to_out(y, 1, "maximum"))

    def minimum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.minimum(self._to_out(x, 0, "minimum"), self._to_out(y, 1, "minimum"))

    def _lut(self, x: torch.Tensor, method: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        dt = self._qdtype(method)
        v = self.table16_version
        if x.dtype == torch.int16:
            knots = self._cached(
                (method, "qint16", v), lambda: method_table16(method, fn, self._in(0), self._out, dt, v)
            )
            if knots is not None:
                return lut_int16_apply(knots, x, dt, v)
        if x.dtype != torch.int8:
            raise NotImplementedError(
                f"QFunctional.{method}: {x.dtype} input has no table; {method} takes qint8 codes"
                + (" (or qint16 codes)" if method == "exp" else "")
                + (" (a module converted before the table16 format version 2: convert it again)" if v == 1 else "")
            )
        table = self._cached((method,), lambda: numerics.lut_int8(fn, self._in(0), self._out, dt))
        return numerics.lut_apply(table, x)

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return self._lut(x, "exp", torch.exp)

    def ceil(self, x: torch.Tensor) -> torch.Tensor:
        return self._lut(x, "ceil", torch.ceil)

    def floor(self, x: torch.Tensor) -> torch.Tensor:
        return self._lut(x, "floor", torch.floor)


# the public methods return codes at the output scale (a qint32 matmul at its accumulator scale)
for _name in (
    "add add_relu sub add_scalar mul mul_scalar div cat concat concatenate stack matmul sum mean maximum minimum "
    "exp ceil floor"
).split():
    setattr(QFunctional, _name, _tags_output(getattr(QFunctional, _name)))
# fx re-tracing a converted graph (torch.load) keeps ``ff.mean(x)`` one call: the integer methods cannot
# run on proxies (qir.nn.modules.traced_calls)
record_method_calls(QFunctional, FLOAT_FUNCTIONAL_METHODS)


# ----------------------------------------------------------------------------- the IR's method ops


def _from_functional_op(op: Any, tensors: dict[str, torch.Tensor]) -> QFunctional:
    """The QFunctional a ``qadd`` / ``qcat`` / ... op's call site holds (emit and evaluation)."""
    m = QFunctional()
    m.march = op.march
    m.table16_version = int(getattr(op, "table16_version", LATEST))
    m._set_scales(op.in_scales, torch.tensor(op.out.scale, dtype=torch.float32), op.out.dtype)
    return m


def _register_ir() -> None:
    from qir.ir.ops import integer_functional as ops
    from qir.ir.ops.integer import register_integer_method

    for cls in (
        ops.QAdd,
        ops.QAddScalar,
        ops.QMul,
        ops.QMulScalar,
        ops.QMatmul,
        ops.QTensorDiv,
        ops.QCat,
        ops.QMinMax,
        ops.QReduce,
        ops.QLutMethod,
    ):
        register_integer_method(cls, QFunctional, _from_functional_op)


_register_ir()
