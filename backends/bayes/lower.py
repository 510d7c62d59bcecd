"""Bayes lowering choices: qint8 / qint16 code tensors, every conv engine, measured per layer.

Bayes runs int16 activations (the BPU's int16 conv paths), so qint16 inputs are lowered
on the float engines (``torch._int_mm`` is int8-only); the common rules cover every
quantized module, so Bayes registers only its kernel policy.
"""

from __future__ import annotations

from backends.common.lower import KernelPolicy, register_kernel_policy

MARCH = "bayes"

POLICY = KernelPolicy(
    conv2d=("dw", "int_mm", "int_mm_t", "f32", "f32_chunked", "f64"),
    linear=("f32", "int_mm", "f64"),
    code_dtypes=("qint8", "qint16", "qint32"),
)

register_kernel_policy(MARCH, POLICY)
