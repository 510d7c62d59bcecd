"""Float unary modules for the eager replacements of elementwise nonlinear ops (``qir.nn.Exp`` ...).

Each is a real named class generated from :data:`UNARY_FUNCTIONS`, one entry per op. The
function in the table is what the float, QAT and quantized modules all compute: the
quantized module evaluates it in float64 to build its lookup table
(``numerics.lut_int8``), so it must return a finite-or-infinite value, never NaN, on every
input. Functions with a restricted domain therefore clamp their input into the domain
first (docs/modules.md, "LUT ops").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = ["UNARY_FUNCTIONS", "UNARY_MODULES", "Pow", "UnaryModule"]

#: Smallest |input| of Reciprocal and smallest input of HardLog (keeps results finite).
TINY = 1e-6
#: atanh's input stays this far inside (-1, 1), so the result is finite.
_ATANH_EDGE = 2.0**-24


def _recip(x: torch.Tensor) -> torch.Tensor:
    mag = x.abs().clamp(min=TINY)
    return torch.where(x < 0, -mag, mag).reciprocal()


#: name -> elementwise function (float32 and float64 inputs)
UNARY_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Acos": lambda x: torch.acos(x.clamp(-1.0, 1.0)),
    "Acosh": lambda x: torch.acosh(x.clamp(min=1.0)),
    "Asin": lambda x: torch.asin(x.clamp(-1.0, 1.0)),
    "Asinh": torch.asinh,
    "Atan": torch.atan,
    "Atanh": lambda x: torch.atanh(x.clamp(-1.0 + _ATANH_EDGE, 1.0 - _ATANH_EDGE)),
    "Ceil": torch.ceil,
    "Cos": torch.cos,
    "Cosh": torch.cosh,
    "Erf": torch.erf,
    "Exp": torch.exp,
    "Floor": torch.floor,
    "HardLog": lambda x: torch.log(x.clamp(min=TINY)),
    "Reciprocal": _recip,
    "Selu": torch.nn.functional.selu,
    "Sin": torch.sin,
    "Sinh": torch.sinh,
    "Sqrt": lambda x: torch.sqrt(x.clamp(min=0.0)),
    "Tan": torch.tan,
}


class UnaryModule(nn.Module):
    """Base of the generated unary modules: ``forward(x) = fn(x)``."""

    op_name: ClassVar[str] = ""

    def function(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The elementwise function this module computes (also used to build LUTs)."""
        return UNARY_FUNCTIONS[self.op_name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function()(x)


class Pow(UnaryModule):
    """``x ** exponent`` with a constant exponent (a LUT op); non-integer exponents clamp ``x >= 0``."""

    op_name: ClassVar[str] = "Pow"

    def __init__(self, exponent: float = 2.0) -> None:
        super().__init__()
        e = float(exponent)
        if e != e or e in (float("inf"), float("-inf")):
            raise ValueError(f"Pow exponent must be finite, got {exponent}")
        self.exponent = e

    def function(self) -> Callable[[torch.Tensor], torch.Tensor]:
        e = self.exponent
        if e == int(e):
            return lambda x: torch.pow(x, e)
        return lambda x: torch.pow(x.clamp(min=0.0), e)

    def forward(self, x: torch.Tensor, exponent: float | None = None) -> torch.Tensor:
        if exponent is not None and float(exponent) != self.exponent:
            raise ValueError(
                f"Pow was built with exponent {self.exponent}, got {exponent}: the exponent is a constant of "
                "the module (its table is built at conversion); construct Pow(exponent=...) instead"
            )
        return self.function()(x)

    def extra_repr(self) -> str:
        return f"exponent={self.exponent}"


def _make() -> dict[str, Any]:
    made: dict[str, Any] = {}
    for name in UNARY_FUNCTIONS:
        made[name] = type(
            name,
            (UnaryModule,),
            {
                "op_name": name,
                "__module__": __name__,
                "__qualname__": name,
                "__doc__": f"``{name.lower()}(x)`` as a module (a table-lookup op when quantized).",
            },
        )
    return made


_GENERATED = _make()
globals().update(_GENERATED)
#: name -> module class, including Pow
UNARY_MODULES: dict[str, type[UnaryModule]] = {**_GENERATED, "Pow": Pow}
__all__ += sorted(_GENERATED)

Acos: type[UnaryModule]
Acosh: type[UnaryModule]
Asin: type[UnaryModule]
Asinh: type[UnaryModule]
Atan: type[UnaryModule]
Atanh: type[UnaryModule]
Ceil: type[UnaryModule]
Cos: type[UnaryModule]
Cosh: type[UnaryModule]
Erf: type[UnaryModule]
Exp: type[UnaryModule]
Floor: type[UnaryModule]
HardLog: type[UnaryModule]
Reciprocal: type[UnaryModule]
Selu: type[UnaryModule]
Sin: type[UnaryModule]
Sinh: type[UnaryModule]
Sqrt: type[UnaryModule]
Tan: type[UnaryModule]
