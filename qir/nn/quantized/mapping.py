"""``QUANTIZED_MODULE_MAP``: QAT class -> quantized class (what convert swaps)."""

from __future__ import annotations

from torch import nn

from qir.nn import qat
from qir.nn.quantized.activation import ReLU, ReLU6, UnaryLUT
from qir.nn.quantized.anchor_generator import AnchorGenerator
from qir.nn.quantized.attention import MultiheadAttention
from qir.nn.quantized.conv import QUANTIZED_CONV_CLASSES
from qir.nn.quantized.functional import QFunctional
from qir.nn.quantized.glu import GLU
from qir.nn.quantized.grid_sample import GridSample
from qir.nn.quantized.interpolate import Interpolate
from qir.nn.quantized.lstm import LSTMCell
from qir.nn.quantized.misc import Div, Identity
from qir.nn.quantized.multi_scale_roi_align import MultiScaleRoIAlign
from qir.nn.quantized.normalization import LayerNorm
from qir.nn.quantized.pool import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d
from qir.nn.quantized.prelu import PReLU
from qir.nn.quantized.roi_align import RoIAlign
from qir.nn.quantized.softmax import Softmax
from qir.nn.quantized.stubs import DeQuantStub, QuantStub

__all__ = ["QUANTIZED_MODULE_MAP", "get_quantized_module_class"]

#: QAT module class -> quantized class; each has ``from_qat(qat_module, input_scales, march)``.
QUANTIZED_MODULE_MAP: dict[type[nn.Module], type[nn.Module]] = {
    **{k: v for k, v in QUANTIZED_CONV_CLASSES.items()},
    qat.QuantStub: QuantStub,
    qat.DeQuantStub: DeQuantStub,
    qat.FloatFunctional: QFunctional,
    qat.ReLU: ReLU,
    qat.ReLU6: ReLU6,
    qat.UnaryLUT: UnaryLUT,
    qat.MaxPool2d: MaxPool2d,
    qat.AvgPool2d: AvgPool2d,
    qat.AdaptiveAvgPool2d: AdaptiveAvgPool2d,
    qat.Interpolate: Interpolate,
    qat.Identity: Identity,
    qat.Dropout: Identity,
    qat.Div: Div,
    qat.PReLU: PReLU,
    qat.GLU: GLU,
    qat.Softmax: Softmax,
    qat.LayerNorm: LayerNorm,
    qat.LSTMCell: LSTMCell,
    qat.MultiheadAttention: MultiheadAttention,
    qat.GridSample: GridSample,
    qat.RoIAlign: RoIAlign,
    qat.MultiScaleRoIAlign: MultiScaleRoIAlign,
    qat.AnchorGenerator: AnchorGenerator,
}


def get_quantized_module_class(qat_cls: type[nn.Module]) -> type[nn.Module]:
    """The quantized class for ``qat_cls``; raises naming the class when unmapped."""
    try:
        return QUANTIZED_MODULE_MAP[qat_cls]
    except KeyError:
        raise KeyError(
            f"no quantized module for {qat_cls.__module__}.{qat_cls.__qualname__}; "
            "see qir.nn.quantized.QUANTIZED_MODULE_MAP"
        ) from None
