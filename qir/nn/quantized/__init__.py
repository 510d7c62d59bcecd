"""Quantized modules (integer codes in, integer codes out) and the float FloatFunctional wrapper.

``qir.nn.quantized.FloatFunctional`` is the FLOAT wrapper users put in float models (as in
torch's layout); :class:`QFunctional` is its integer counterpart.
"""

from qir.nn.modules.functional import FloatFunctional
from qir.nn.quantized._base import QuantizedModule
from qir.nn.quantized.activation import ReLU, ReLU6, UnaryLUT
from qir.nn.quantized.anchor_generator import AnchorGenerator
from qir.nn.quantized.attention import MultiheadAttention
from qir.nn.quantized.conv import (
    QUANTIZED_CONV_CLASSES,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvAdd1d,
    ConvAdd2d,
    ConvAdd3d,
    ConvAddReLU1d,
    ConvAddReLU2d,
    ConvAddReLU3d,
    ConvAddReLU61d,
    ConvAddReLU62d,
    ConvAddReLU63d,
    ConvReLU1d,
    ConvReLU2d,
    ConvReLU3d,
    ConvReLU61d,
    ConvReLU62d,
    ConvReLU63d,
    ConvTranspose2d,
    ConvTransposeAdd2d,
    ConvTransposeAddReLU2d,
    ConvTransposeAddReLU62d,
    ConvTransposeReLU2d,
    ConvTransposeReLU62d,
    Linear,
    LinearAdd,
    LinearAddReLU,
    LinearAddReLU6,
    LinearReLU,
    LinearReLU6,
    QuantizedConvBase,
)
from qir.nn.quantized.functional import QFunctional
from qir.nn.quantized.glu import GLU
from qir.nn.quantized.grid_sample import GridSample
from qir.nn.quantized.interpolate import Interpolate
from qir.nn.quantized.lstm import LSTMCell
from qir.nn.quantized.mapping import QUANTIZED_MODULE_MAP, get_quantized_module_class
from qir.nn.quantized.misc import Div, Identity
from qir.nn.quantized.multi_scale_roi_align import MultiScaleRoIAlign
from qir.nn.quantized.normalization import LayerNorm
from qir.nn.quantized.pool import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d
from qir.nn.quantized.prelu import PReLU
from qir.nn.quantized.roi_align import RoIAlign
from qir.nn.quantized.scale_tags import install_scale_tags
from qir.nn.quantized.softmax import Softmax
from qir.nn.quantized.stubs import DeQuantStub, PerCallDeQuantStub, QuantStub

__all__ = [
    "AdaptiveAvgPool2d",
    "AvgPool2d",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvAdd1d",
    "ConvAdd2d",
    "ConvAdd3d",
    "ConvAddReLU1d",
    "ConvAddReLU2d",
    "ConvAddReLU3d",
    "ConvAddReLU61d",
    "ConvAddReLU62d",
    "ConvAddReLU63d",
    "ConvReLU1d",
    "ConvReLU2d",
    "ConvReLU3d",
    "ConvReLU61d",
    "ConvReLU62d",
    "ConvReLU63d",
    "ConvTranspose2d",
    "ConvTransposeAdd2d",
    "ConvTransposeAddReLU2d",
    "ConvTransposeAddReLU62d",
    "ConvTransposeReLU2d",
    "ConvTransposeReLU62d",
    "DeQuantStub",
    "PerCallDeQuantStub",
    "install_scale_tags",
    "Div",
    "FloatFunctional",
    "GridSample",
    "AnchorGenerator",
    "MultiScaleRoIAlign",
    "RoIAlign",
    "Identity",
    "Interpolate",
    "Linear",
    "LinearAdd",
    "LinearAddReLU",
    "LinearAddReLU6",
    "LinearReLU",
    "LinearReLU6",
    "MaxPool2d",
    "QFunctional",
    "QUANTIZED_CONV_CLASSES",
    "QUANTIZED_MODULE_MAP",
    "QuantStub",
    "QuantizedConvBase",
    "QuantizedModule",
    "ReLU",
    "ReLU6",
    "UnaryLUT",
    "get_quantized_module_class",
]
__all__ += ["GLU", "LayerNorm", "PReLU", "Softmax"]
__all__ += ["LSTMCell", "MultiheadAttention"]

# the QAT attention's and LSTM cell's integer-grid hooks (they build this package's modules)
from qir.nn.quantized import attention_grid as _attention_grid  # noqa: E402, F401
from qir.nn.quantized import lstm_grid as _lstm_grid  # noqa: E402, F401

# registers the quantize pass's rules for the IR's QAT ops
from qir.nn.quantized import quantize_rules as _quantize_rules  # noqa: E402, F401
from qir.nn.quantized import quantize_rules_codes as _quantize_rules_codes  # noqa: E402, F401
from qir.nn.quantized import quantize_rules_functional as _quantize_rules_functional  # noqa: E402, F401
from qir.nn.quantized import quantize_rules_layers as _quantize_rules_layers  # noqa: E402, F401
from qir.nn.quantized import quantize_rules_sequence as _quantize_rules_sequence  # noqa: E402, F401
from qir.nn.quantized import quantize_rules_wrapped as _quantize_rules_wrapped  # noqa: E402, F401
