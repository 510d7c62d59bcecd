"""Fused float modules: a conv / linear with a fused add and/or activation.

These are what ``fuse_fx`` and ``fuse_known_modules`` produce and what ``prepare_qat``
swaps for QAT modules. BN is absorbed into the conv before fusion, so no BN variants.
"""

from qir.nn.intrinsic.fused import (
    FUSED_CLASSES,
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
    ConvTransposeAdd2d,
    ConvTransposeAddReLU2d,
    ConvTransposeAddReLU62d,
    ConvTransposeReLU2d,
    ConvTransposeReLU62d,
    FusedModule,
    LinearAdd,
    LinearAddReLU,
    LinearAddReLU6,
    LinearReLU,
    LinearReLU6,
    fused_class,
)

__all__ = [
    "FUSED_CLASSES", "ConvAdd1d", "ConvAdd2d", "ConvAdd3d", "ConvAddReLU1d", "ConvAddReLU2d", "ConvAddReLU3d",
    "ConvAddReLU61d", "ConvAddReLU62d", "ConvAddReLU63d", "ConvReLU1d", "ConvReLU2d", "ConvReLU3d", "ConvReLU61d",
    "ConvReLU62d", "ConvReLU63d", "ConvTransposeAdd2d", "ConvTransposeAddReLU2d", "ConvTransposeAddReLU62d",
    "ConvTransposeReLU2d", "ConvTransposeReLU62d", "FusedModule", "LinearAdd", "LinearAddReLU", "LinearAddReLU6",
    "LinearReLU", "LinearReLU6", "fused_class",
]
