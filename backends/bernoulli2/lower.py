"""Bernoulli2 lowering choices: int8 code tensors only (qint32 for high-precision outputs).

Bernoulli2 has no int16 activation paths (docs/semantics.md), so a qint16 tensor reaching
the lowering is an error naming the node; int8 convs prefer the int8 matmul engine.
"""

from __future__ import annotations

from backends.common.lower import KernelPolicy, register_kernel_policy

MARCH = "bernoulli2"

POLICY = KernelPolicy(
    conv2d=("dw", "int_mm", "int_mm_t", "f32", "f32_chunked", "f64"),
    linear=("f32", "int_mm", "f64"),
    code_dtypes=("qint8", "qint32"),
)

register_kernel_policy(MARCH, POLICY)
