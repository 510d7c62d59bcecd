"""qir's module library: float eager replacements, fused modules, QAT and quantized modules.

``qir.nn.Exp()``, ``qir.nn.Interpolate(...)``, ``qir.nn.quantized.FloatFunctional()`` are
the float modules users put in their models; ``qir.nn.intrinsic`` holds the fused modules;
``qir.nn.qat`` / ``qir.nn.quantized`` the QAT and integer modules with the maps
``QAT_MODULE_MAP`` and ``QUANTIZED_MODULE_MAP`` (docs/modules.md).
"""

from qir.nn import functional, intrinsic, qat, quantized
from qir.nn.modules import (
    UNARY_FUNCTIONS,
    UNARY_MODULES,
    Acos,
    Acosh,
    AnchorGenerator,
    Asin,
    Asinh,
    Atan,
    Atanh,
    Ceil,
    Cos,
    Cosh,
    Div,
    Erf,
    Exp,
    Floor,
    GridSample,
    HardLog,
    Identity,
    Interpolate,
    LayerNorm,
    MultiScaleRoIAlign,
    Pow,
    Reciprocal,
    RoIAlign,
    Selu,
    Sin,
    Sinh,
    Sqrt,
    Tan,
    UnaryModule,
)
from qir.nn.qat.mapping import QAT_MODULE_MAP
from qir.nn.quantized.mapping import QUANTIZED_MODULE_MAP

__all__ = [
    "QAT_MODULE_MAP",
    "QUANTIZED_MODULE_MAP",
    "UNARY_FUNCTIONS",
    "UNARY_MODULES",
    "Acos",
    "Acosh",
    "Asin",
    "Asinh",
    "Atan",
    "Atanh",
    "Ceil",
    "Cos",
    "Cosh",
    "Div",
    "Erf",
    "Exp",
    "Floor",
    "HardLog",
    "Identity",
    "Interpolate",
    "Pow",
    "Reciprocal",
    "Selu",
    "Sin",
    "Sinh",
    "Sqrt",
    "Tan",
    "UnaryModule",
    "functional",
    "intrinsic",
    "qat",
    "quantized",
]
__all__ += ["AnchorGenerator", "GridSample", "LayerNorm", "MultiScaleRoIAlign", "RoIAlign"]
