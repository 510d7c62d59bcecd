"""Functions and methods wrapped with ``qir.utils.fx_helper.wrap`` (and functions registered with
``torch.fx.wrap``) are float calls for the ``quantize`` pass.

Module swapping passes a wrapped call ``codes * scale`` in float32 for each quantized argument
(a generated DeQuantStub in front of it: the QAT model's fake-quantized values) and runs it on
the CPU; the pass does the same (:func:`passes.quantize.register_float_call`).
"""

from __future__ import annotations

from passes.quantize import register_float_call
from qir.utils.fx_helper import torch_fx_wrapped, wrapped_original

__all__: list[str] = []

register_float_call(lambda fn: wrapped_original(fn) is not None or torch_fx_wrapped(fn))
