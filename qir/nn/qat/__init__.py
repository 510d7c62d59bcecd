"""QAT modules: float compute with fake-quantized weights and outputs (``qir.nn.qat``)."""

from qir.nn.qat._base import QATModule
from qir.nn.qat.activation import LUT_FLOAT_CLASSES, ReLU, ReLU6, UnaryLUT
from qir.nn.qat.anchor_generator import AnchorGenerator
from qir.nn.qat.attention import MultiheadAttention
from qir.nn.qat.conv import (
    QAT_CONV_CLASSES,
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
    QATConvBase,
)
from qir.nn.qat.conv_bn import QAT_CONV_BN_CLASSES, QATConvBNBase, fold_batch_norms, keep_batch_norms
from qir.nn.qat.functional import FloatFunctional
from qir.nn.qat.glu import GLU
from qir.nn.qat.grid_sample import GridSample
from qir.nn.qat.interpolate import Interpolate
from qir.nn.qat.lstm import LSTMCell
from qir.nn.qat.mapping import QAT_MODULE_MAP, get_qat_module_class
from qir.nn.qat.misc import Div, Dropout, Identity
from qir.nn.qat.multi_scale_roi_align import MultiScaleRoIAlign
from qir.nn.qat.normalization import LayerNorm
from qir.nn.qat.pool import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d
from qir.nn.qat.prelu import PReLU
from qir.nn.qat.roi_align import RoIAlign
from qir.nn.qat.softmax import Softmax
from qir.nn.qat.stubs import DeQuantStub, QuantStub

__all__ = [
    "LUT_FLOAT_CLASSES",
    "QAT_CONV_BN_CLASSES",
    "QAT_CONV_CLASSES",
    "QAT_MODULE_MAP",
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
    "Div",
    "Dropout",
    "FloatFunctional",
    "Identity",
    "Interpolate",
    "Linear",
    "LinearAdd",
    "LinearAddReLU",
    "LinearAddReLU6",
    "LinearReLU",
    "LinearReLU6",
    "MaxPool2d",
    "QATConvBNBase",
    "QATConvBase",
    "QATModule",
    "QuantStub",
    "ReLU",
    "ReLU6",
    "UnaryLUT",
    "fold_batch_norms",
    "get_qat_module_class",
    "keep_batch_norms",
]
__all__ += ["GLU", "LayerNorm", "PReLU", "Softmax"]
__all__ += ["LSTMCell", "MultiheadAttention"]
__all__ += ["AnchorGenerator", "GridSample", "MultiScaleRoIAlign", "RoIAlign"]

# registers the IR's QAT ops (qat_conv, qat_quant_stub, qat_dequant_stub) for these classes, and
# the insert-observers pass's rules (float layer -> QAT op)
from qir.nn.qat import ir_observe as _ir_observe  # noqa: E402, F401
from qir.nn.qat import ir_observe_functional as _ir_observe_functional  # noqa: E402, F401
from qir.nn.qat import ir_ops as _ir_ops  # noqa: E402, F401
from qir.nn.qat import ir_ops_activation as _ir_ops_activation  # noqa: E402, F401
from qir.nn.qat import ir_ops_conv_bn as _ir_ops_conv_bn  # noqa: E402, F401
from qir.nn.qat import ir_ops_functional as _ir_ops_functional  # noqa: E402, F401
from qir.nn.qat import ir_ops_math as _ir_ops_math  # noqa: E402, F401
from qir.nn.qat import ir_ops_pool as _ir_ops_pool  # noqa: E402, F401
from qir.nn.qat import ir_ops_resize as _ir_ops_resize  # noqa: E402, F401
from qir.nn.qat import ir_ops_sampling as _ir_ops_sampling  # noqa: E402, F401
from qir.nn.qat import ir_ops_sequence as _ir_ops_sequence  # noqa: E402, F401
