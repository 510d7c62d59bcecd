"""Float-side modules of qir.nn: the eager replacements for functional ops."""

from torch.nn import Identity

from qir.nn.modules.anchor_generator import AnchorGenerator
from qir.nn.modules.binary import Div
from qir.nn.modules.functional import FLOAT_FUNCTIONAL_METHODS, FloatFunctional, FunctionalBase
from qir.nn.modules.grid_sample import GridSample
from qir.nn.modules.interpolate import Interpolate
from qir.nn.modules.layer_norm import LayerNorm
from qir.nn.modules.multi_scale_roi_align import MultiScaleRoIAlign
from qir.nn.modules.roi_align import RoIAlign
from qir.nn.modules.unary import (
    UNARY_FUNCTIONS,
    UNARY_MODULES,
    Acos,
    Acosh,
    Asin,
    Asinh,
    Atan,
    Atanh,
    Ceil,
    Cos,
    Cosh,
    Erf,
    Exp,
    Floor,
    HardLog,
    Pow,
    Reciprocal,
    Selu,
    Sin,
    Sinh,
    Sqrt,
    Tan,
    UnaryModule,
)

__all__ = [
    "FLOAT_FUNCTIONAL_METHODS",
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
    "FloatFunctional",
    "Floor",
    "FunctionalBase",
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
]
__all__ += ["AnchorGenerator", "GridSample", "LayerNorm", "MultiScaleRoIAlign", "RoIAlign"]
