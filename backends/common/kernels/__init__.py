"""Integer kernels of the Program runtime, one family per file (see docs/backends.md)."""

# every family registers its kernels on import; importing them here keeps the registry complete
# for any user of kernels.base (importing it runs this file first)
from backends.common.kernels import (  # noqa: F401
    anchors,
    attention,
    codes,
    conv,
    elementwise,
    float_ops,
    layer_norm,
    matmul,
    pool,
    prelu,
    quant,
    resize,
    sampling,
    scalar,
    select,
    shape,
    softmax,
)
from backends.common.kernels.base import Kernel, get_kernel, kernel_names, register_kernel

__all__ = ["Kernel", "get_kernel", "kernel_names", "register_kernel"]
