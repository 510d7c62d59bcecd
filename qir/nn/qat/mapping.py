"""``QAT_MODULE_MAP``: float module class -> QAT class (what prepare swaps)."""

from __future__ import annotations

import importlib

from torch import nn

from qir.nn.modules.anchor_generator import AnchorGenerator as FloatAnchorGenerator
from qir.nn.modules.binary import Div as FloatDiv
from qir.nn.modules.functional import FloatFunctional as FloatFF
from qir.nn.modules.grid_sample import GridSample as FloatGridSample
from qir.nn.modules.interpolate import Interpolate as FloatInterpolate
from qir.nn.modules.multi_scale_roi_align import MultiScaleRoIAlign as FloatMultiScaleRoIAlign
from qir.nn.modules.roi_align import RoIAlign as FloatRoIAlign
from qir.nn.modules.unary import UNARY_MODULES
from qir.nn.qat.activation import LUT_FLOAT_CLASSES, ReLU, ReLU6, UnaryLUT
from qir.nn.qat.anchor_generator import AnchorGenerator
from qir.nn.qat.attention import MultiheadAttention
from qir.nn.qat.conv import QAT_CONV_CLASSES, fused_float_class
from qir.nn.qat.functional import FloatFunctional
from qir.nn.qat.glu import GLU
from qir.nn.qat.grid_sample import GridSample
from qir.nn.qat.interpolate import Interpolate
from qir.nn.qat.lstm import LSTMCell
from qir.nn.qat.misc import Div, Dropout, Identity
from qir.nn.qat.multi_scale_roi_align import MultiScaleRoIAlign
from qir.nn.qat.normalization import LayerNorm
from qir.nn.qat.pool import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d
from qir.nn.qat.prelu import PReLU
from qir.nn.qat.roi_align import RoIAlign
from qir.nn.qat.softmax import Softmax
from qir.nn.qat.stubs import DeQuantStub, QuantStub
from qir.quantization.stubs import DeQuantStub as FloatDeQuantStub
from qir.quantization.stubs import QuantStub as FloatQuantStub

__all__ = ["QAT_MODULE_MAP", "get_qat_module_class"]


def _torch_attr(module: str, name: str) -> type | None:
    try:
        obj = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return obj if isinstance(obj, type) else None


def _build() -> dict[type[nn.Module], type[nn.Module]]:
    m: dict[type[nn.Module], type[nn.Module]] = {}
    for conv_cls in QAT_CONV_CLASSES.values():
        m[fused_float_class(conv_cls)] = conv_cls
    m.update(
        {
            FloatQuantStub: QuantStub,
            FloatDeQuantStub: DeQuantStub,
            FloatFF: FloatFunctional,
            nn.ReLU: ReLU,
            nn.ReLU6: ReLU6,
            nn.MaxPool2d: MaxPool2d,
            nn.AvgPool2d: AvgPool2d,
            nn.AdaptiveAvgPool2d: AdaptiveAvgPool2d,
            FloatInterpolate: Interpolate,
            nn.Upsample: Interpolate,
            nn.Identity: Identity,
            nn.Dropout: Dropout,
            nn.Dropout1d: Dropout,
            nn.Dropout2d: Dropout,
            nn.Dropout3d: Dropout,
            FloatDiv: Div,
            nn.PReLU: PReLU,
            nn.GLU: GLU,
            nn.Softmax: Softmax,
            nn.LayerNorm: LayerNorm,
            nn.LSTMCell: LSTMCell,
            nn.MultiheadAttention: MultiheadAttention,
            FloatGridSample: GridSample,
            FloatRoIAlign: RoIAlign,
            FloatMultiScaleRoIAlign: MultiScaleRoIAlign,
            FloatAnchorGenerator: AnchorGenerator,
        }
    )
    for cls in (*UNARY_MODULES.values(), *LUT_FLOAT_CLASSES):
        m[cls] = UnaryLUT
    # torch's stubs and FloatFunctional, where users bring them.
    for mod, name, qat in (
        ("torch.ao.quantization", "QuantStub", QuantStub),
        ("torch.ao.quantization", "DeQuantStub", DeQuantStub),
        ("torch.ao.nn.quantized", "FloatFunctional", FloatFunctional),
    ):
        t = _torch_attr(mod, name)
        if t is not None:
            m[t] = qat
    return m


#: float module class -> QAT module class. Every QAT class has ``from_float(mod, qconfig=None)``.
QAT_MODULE_MAP: dict[type[nn.Module], type[nn.Module]] = _build()


def get_qat_module_class(float_cls: type[nn.Module]) -> type[nn.Module]:
    """The QAT class for ``float_cls`` (exact type match); raises naming the class when unmapped."""
    try:
        return QAT_MODULE_MAP[float_cls]
    except KeyError:
        raise KeyError(
            f"no QAT module for {float_cls.__module__}.{float_cls.__qualname__}; "
            "see qir.nn.qat.QAT_MODULE_MAP for the supported float modules"
        ) from None
