"""Quantized LayerNorm: exact integer mean and variance, integer square root, affine in the requantization."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from backends.common.math_rules import LayerNormParams, layer_norm_int, layer_norm_params
from passes.legality_facts import register_module_view
from qir.nn.qat.normalization import LayerNorm as QATLayerNorm
from qir.nn.quantized._base import QuantizedModule, check_qat, march_name, output_fq

__all__ = ["LayerNorm"]


class LayerNorm(QuantizedModule):
    """LayerNorm on codes over the trailing ``normalized_shape`` (docs/semantics.md, "LayerNorm").

    Buffers: ``multiplier`` / ``shift`` (signed 31-bit affine multipliers) and ``bias`` (int32
    at ``s_out / 2**8``), one per normalized element; ``eps_terms[in_dtype] = (f, E)`` with
    ``E = round(eps * N**2 * 4**f / s_in**2)``.
    """

    derived: ClassVar[tuple[str, ...]] = ("eps_terms",)

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.LayerNorm
    normalized_shape: tuple[int, ...]
    eps: float
    elementwise_affine: bool
    has_bias: bool
    eps_terms: dict[torch.dtype, tuple[int, int]]
    multiplier: torch.Tensor
    shift: torch.Tensor
    bias: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.dtype is not None
        k = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - k :]) != self.normalized_shape:
            raise ValueError(
                f"LayerNorm: input shape {tuple(x.shape)} does not end in normalized_shape {self.normalized_shape}"
            )
        p = LayerNormParams(self.eps_terms, self.multiplier, self.shift, self.bias)
        return layer_norm_int(x, k, p, self.dtype)

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> LayerNorm:
        check_qat(cls, qat, QATLayerNorm)
        assert isinstance(qat, QATLayerNorm)
        fq = output_fq(qat)
        assert fq is not None
        new = cls()
        new._set_scales(input_scales, fq.scale.detach(), fq.dtype)
        new.normalized_shape, new.eps = qat.normalized_shape, qat.eps
        new.elementwise_affine, new.has_bias = qat.weight is not None, qat.bias is not None
        p = layer_norm_params(
            new.per_tensor_input(0),
            float(new.scale[0]),
            qat.normalized_shape,
            qat.eps,
            qat.weight,
            qat.bias,
            march_name(march),
            fq.dtype,
        )
        new.eps_terms = p.eps_terms
        new.register_buffer("multiplier", p.multiplier)
        new.register_buffer("shift", p.shift)
        new.register_buffer("bias", p.bias)
        return new

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, {super().extra_repr()}"


def _legality_view(m: nn.Module) -> nn.Module | None:
    """The float LayerNorm (on the meta device) the operator tables describe a quantized one as."""
    if not isinstance(m, LayerNorm):
        return None
    return nn.LayerNorm(
        m.normalized_shape, eps=m.eps, elementwise_affine=m.elementwise_affine, bias=m.has_bias, device="meta"
    )


register_module_view(_legality_view)


# ----------------------------------------------------------------------------- IR ops


def _from_qlayer_norm(op: Any, tensors: dict[str, torch.Tensor]) -> LayerNorm:
    m = LayerNorm()
    m._set_scales(op.in_scales, op.out.scale[0], op.out.dtype)
    m.normalized_shape, m.eps = tuple(op.normalized_shape), float(op.eps)
    m.elementwise_affine, m.has_bias = bool(op.elementwise_affine), bool(op.has_bias)
    m.eps_terms = op.eps_term_dict()
    for role in ("multiplier", "shift", "bias"):
        m.register_buffer(role, tensors[role])
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_math import QLayerNorm

    register_integer_module(QLayerNorm, LayerNorm, _from_qlayer_norm)


_register_ir()
