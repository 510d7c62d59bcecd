"""Integer kernels of the Program runtime, one family per file (see docs/backends.md)."""

from backends.common.kernels.base import Kernel, get_kernel, kernel_names, register_kernel

__all__ = ["Kernel", "get_kernel", "kernel_names", "register_kernel"]
