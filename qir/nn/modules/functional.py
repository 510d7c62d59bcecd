"""``FloatFunctional``: tensor functions as a module, so each call site can carry its own quantization.

Users put one instance per call site in the float model (``self.add = FloatFunctional()``;
``self.add.add(x, y)``), like ``torch.ao.nn.quantized.FloatFunctional``. Every method
computes in float and passes its result through ``activation_post_process``: an
``Identity`` here, the output fake quant in :class:`qir.nn.qat.FloatFunctional`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from qir.nn.modules.traced_calls import record_method_calls

__all__ = [
    "FLOAT_FUNCTIONAL_METHODS",
    "SCALAR_FORMS",
    "FloatFunctional",
    "FunctionalBase",
    "number_operand_error",
    "scalar_call",
    "scalar_form",
]

Dims = int | Sequence[int] | None

#: The methods every functional class (float, QAT, quantized) provides.
FLOAT_FUNCTIONAL_METHODS = (
    "add",
    "add_relu",
    "add_scalar",
    "cat",
    "ceil",
    "concat",
    "concatenate",
    "div",
    "exp",
    "floor",
    "matmul",
    "maximum",
    "mean",
    "minimum",
    "mul",
    "mul_scalar",
    "stack",
    "sub",
    "sum",
)


#: A two-tensor method called with a number: the scalar method computing the same float result and
#: the sign the number takes. The BPU's add / mul take two tensors (the plugin's operator table:
#: "call add_scalar if one of the operands is a scalar"), so the QAT and quantized modules run
#: such a call as the scalar method: one integer form, trained and deployed alike.
SCALAR_FORMS: dict[str, tuple[str, float]] = {
    "add": ("add_scalar", 1.0),
    "sub": ("add_scalar", -1.0),
    "mul": ("mul_scalar", 1.0),
}


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def scalar_form(method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[str, Any, float] | None:
    """``(scalar method, x, y)`` when ``method(x, y)`` is add / sub / mul with a Python number
    operand (either side for the commutative add and mul), else None."""
    form = SCALAR_FORMS.get(method)
    if form is None or len(args) + len(kwargs) != 2:
        return None
    x = args[0] if args else kwargs.get("x")
    y = args[1] if len(args) > 1 else kwargs.get("y")
    if _is_number(x) and isinstance(y, torch.Tensor) and method != "sub":
        x, y = y, x
    if not isinstance(x, torch.Tensor) or not isinstance(y, int | float) or isinstance(y, bool):
        return None
    name, sign = form
    return name, x, sign * float(y)


#: the methods whose two operands must both be tensors on the BPU
_TWO_TENSORS = ("add", "add_relu", "sub", "mul", "div", "maximum", "minimum", "matmul")


def number_operand_error(method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """Why a QAT / quantized ``method(x, y)`` with a Python number operand cannot run (None when it
    can: both tensors, or a form :func:`scalar_form` runs as a scalar method)."""
    if method not in _TWO_TENSORS or scalar_form(method, args, kwargs) is not None:
        return None
    return _refusal(method, args, kwargs)


def scalar_call(method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[str, Any, float] | None:
    """What a QAT / quantized module runs for ``method(*args, **kwargs)``: its :func:`scalar_form`, or
    None for a call it runs as written; a number no scalar method fits raises the TypeError of
    :func:`number_operand_error`."""
    form = scalar_form(method, args, kwargs)
    if form is None and method in _TWO_TENSORS:
        refused = _refusal(method, args, kwargs)
        if refused is not None:
            raise TypeError(refused)
    return form


def _refusal(method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """:func:`number_operand_error` for a call :func:`scalar_form` does not take."""
    operands = {"x": args[0] if args else kwargs.get("x"), "y": args[1] if len(args) > 1 else kwargs.get("y")}
    numbers = [(k, v) for k, v in operands.items() if _is_number(v)]
    if not numbers:
        return None
    k, v = numbers[0]
    return (
        f"FloatFunctional.{method} got the number {v!r} as its operand {k}: on the BPU {method} takes two tensors "
        "and has no form with a constant operand. add / sub / mul of a tensor and a number run as add_scalar / "
        "mul_scalar; write anything else with those (e.g. 2.0 - y as add_scalar(mul_scalar(y, -1.0), 2.0), one "
        "FloatFunctional per call) or pass the number as a tensor the model quantizes"
    )


def _dims(dim: Dims) -> list[int] | None:
    if dim is None:
        return None
    return [int(dim)] if isinstance(dim, int) else [int(d) for d in dim]


class FunctionalBase(nn.Module):
    """Float implementations of the functional methods, each followed by ``activation_post_process``."""

    activation_post_process: Any

    def _post(self, y: torch.Tensor) -> torch.Tensor:
        app = self.activation_post_process
        out: torch.Tensor = y if app is None else app(y)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            f"{type(self).__name__} is not called directly; call one of its methods "
            f"({', '.join(FLOAT_FUNCTIONAL_METHODS)})"
        )

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._post(torch.add(x, y))

    def add_relu(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._post(torch.relu(torch.add(x, y)))

    def add_scalar(self, x: torch.Tensor, y: float) -> torch.Tensor:
        return self._post(torch.add(x, y))

    def sub(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._post(torch.sub(x, y))

    def mul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._post(torch.mul(x, y))

    def mul_scalar(self, x: torch.Tensor, y: float) -> torch.Tensor:
        return self._post(torch.mul(x, y))

    def div(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._post(torch.div(x, y))

    def cat(self, x: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return self._post(torch.cat(list(x), dim=dim))

    def concat(self, x: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return self.cat(x, dim)

    def concatenate(self, x: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return self.cat(x, dim)

    def stack(self, x: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return self._post(torch.stack(list(x), dim=dim))

    def matmul(self, x: torch.Tensor, y: torch.Tensor, x_trans: bool = False, y_trans: bool = False) -> torch.Tensor:
        """``x @ y``; ``x_trans`` / ``y_trans`` transpose the last two dims of an operand first (the plugin's form)."""
        return self._post(torch.matmul(x.transpose(-2, -1) if x_trans else x, y.transpose(-2, -1) if y_trans else y))

    def mean(self, x: torch.Tensor, dim: Dims = None, keepdim: bool = False) -> torch.Tensor:
        d = _dims(dim)
        return self._post(x.mean() if d is None else x.mean(dim=d, keepdim=keepdim))

    def sum(self, x: torch.Tensor, dim: Dims = None, keepdim: bool = False) -> torch.Tensor:
        d = _dims(dim)
        return self._post(x.sum() if d is None else x.sum(dim=d, keepdim=keepdim))

    def maximum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._post(torch.maximum(x, y))

    def minimum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._post(torch.minimum(x, y))

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return self._post(torch.exp(x))

    def ceil(self, x: torch.Tensor) -> torch.Tensor:
        return self._post(torch.ceil(x))

    def floor(self, x: torch.Tensor) -> torch.Tensor:
        return self._post(torch.floor(x))


class FloatFunctional(FunctionalBase):
    """The float functional wrapper (``qir.nn.quantized.FloatFunctional``); ``activation_post_process`` is Identity."""

    def __init__(self) -> None:
        super().__init__()
        self.activation_post_process = nn.Identity()


# fx re-tracing a graph (torch.load) keeps ``ff.add(x, y)`` one call (qir.nn.modules.traced_calls)
record_method_calls(FloatFunctional, FLOAT_FUNCTIONAL_METHODS)
