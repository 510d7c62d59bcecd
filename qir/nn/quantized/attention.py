"""Quantized MultiheadAttention: integer projections, per-head integer matmuls, qir's integer Softmax."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from backends.common import numerics
from backends.common.integer_rules import check_out_dtype, ratio_params
from passes.legality_facts import register_module_view
from qir.ir.types import DType
from qir.nn.qat.attention import MultiheadAttention as QATMultiheadAttention
from qir.nn.qat.attention import attention_masks, check_attention_call
from qir.nn.quantized._base import QuantizedModule, check_qat, march_name
from qir.nn.quantized._composed import fq_scale, integer_linear, linear_from_spec, product_params
from qir.nn.quantized.conv import QuantizedConvBase
from qir.nn.quantized.softmax import Softmax

__all__ = ["MultiheadAttention", "mask_codes"]


class MultiheadAttention(QuantizedModule):
    """Integer attention (docs/semantics.md "MultiheadAttention")::

        q, k, v = q_proj(query), k_proj(key), v_proj(value)         # integer Linear modules
        scores  = rq(q_h @ k_hᵀ)        # (M, k) for s_q · s_k / (√D · s_scores): the 1/√D folded in
        attn    = softmax(scores)       # qir's integer Softmax
        ctx     = rq(attn @ v_h)
        out     = out_proj(ctx)
        weights = rq(Σ_heads attn)       # (M, k) for s_attn / (H · s_weights); per head: rq(attn)

    Masks: excluded entries (bool True, ``-inf``) get weight 0 from a masked softmax; finite float
    entries are added to the scores as codes ``round(a / s_scores)``.

    ``rq`` is one requantization of an exact integer product (sum).
    """

    derived: ClassVar[tuple[str, ...]] = ("rq",)

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.MultiheadAttention
    num_inputs: ClassVar[int] = 3
    embed_dim: int
    num_heads: int
    batch_first: bool
    has_bias: bool
    march: str
    rq: dict[str, tuple[int, int]]
    dtypes: dict[str, DType]
    q_proj: QuantizedConvBase
    k_proj: QuantizedConvBase
    v_proj: QuantizedConvBase
    out_proj: QuantizedConvBase
    softmax: Softmax
    weights_scale: torch.Tensor

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> MultiheadAttention:
        check_qat(cls, qat, QATMultiheadAttention)
        assert isinstance(qat, QATMultiheadAttention)
        name = cls.__name__
        mname = march_name(march)
        new = cls()
        out_fq, w_fq = qat.output_fake_quants()
        new._set_scales(input_scales, out_fq.scale.detach(), out_fq.dtype)
        new.register_buffer("weights_scale", w_fq.scale.detach().to(torch.float32).reshape(1).clone())
        for fq_name in (
            "q_post_process",
            "k_post_process",
            "v_post_process",
            "context_post_process",
            "weights_post_process",
            "activation_post_process",
        ):
            check_out_dtype(mname, getattr(qat, fq_name).dtype, f"{name} {fq_name}")
        if DType(qat.scores_post_process.dtype) is not DType.qint8:
            raise ValueError(f"{name}: scores_post_process must be qint8 (the softmax's exp table reads it)")
        new.embed_dim, new.num_heads, new.batch_first = qat.embed_dim, qat.num_heads, bool(qat.batch_first)
        new.has_bias = qat.in_proj_bias is not None
        new.march = mname
        qc = qat.qconfig
        fqs = (
            (qat.wq_fake_quant, qat.q_post_process),
            (qat.wk_fake_quant, qat.k_post_process),
            (qat.wv_fake_quant, qat.v_post_process),
        )
        for i, (proj, (wfq, ofq)) in enumerate(zip(("q_proj", "k_proj", "v_proj"), fqs, strict=True)):
            w, b = qat.projection(i)
            setattr(new, proj, integer_linear(w, b, wfq, ofq, qc, new.per_tensor_input(i), mname))
        s_q, s_k, s_v = (fq_scale(f) for f in (qat.q_post_process, qat.k_post_process, qat.v_post_process))
        s_s, s_ctx = fq_scale(qat.scores_post_process), fq_scale(qat.context_post_process)
        d = qat.embed_dim // qat.num_heads
        new.softmax = Softmax.from_qat(qat.softmax, [s_s], mname)
        s_a = float(new.softmax.scale[0])
        new.rq, new.dtypes = {}, {}
        # 1/√D folded into the scores' requantization: the ratio s_q·s_k / (√D·s_s), one multiplier
        m, s = ratio_params(s_q * s_k / (math.sqrt(d) * s_s), mname)
        new.rq["scores"], new.dtypes["scores"] = (int(m), int(s)), DType.qint8
        new.rq["context"] = product_params(s_a, s_v, s_ctx, mname, DType(qat.context_post_process.dtype))
        new.dtypes["context"] = DType(qat.context_post_process.dtype)
        new.out_proj = integer_linear(
            qat.out_proj.weight, qat.out_proj.bias, qat.wo_fake_quant, qat.activation_post_process, qc, s_ctx, mname
        )
        s_w = fq_scale(w_fq)
        w_dt = DType(w_fq.dtype)
        m, s = ratio_params(s_a / (qat.num_heads * s_w), mname)
        new.rq["weights_mean"] = (int(m), int(s))
        new.rq["weights"] = numerics_requant(s_a, s_w, mname, w_dt)
        new.dtypes["weights_mean"] = new.dtypes["weights"] = w_dt
        return new

    def _rq(self, key: str, acc: torch.Tensor) -> torch.Tensor:
        m, s = self.rq[key]
        return numerics.requantize(acc, m, s, self.dtypes[key])

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_attention_call(type(self).__name__, is_causal)
        if query.is_floating_point() or query.dim() != 3:
            raise TypeError(
                f"MultiheadAttention takes 3-dimensional integer codes; got {query.dtype} of rank {query.dim()}"
            )
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        h = self.num_heads
        d = self.embed_dim // h
        heads = []
        for proj, t in ((self.q_proj, query), (self.k_proj, key), (self.v_proj, value)):
            y = proj(t)
            heads.append(y.reshape(y.shape[0], y.shape[1], h, d).transpose(1, 2).to(torch.int64))
        q, k, v = heads
        # exact: |products| < 2**31 summed over D < 2**22 terms stays below 2**53
        scores = self._rq(
            "scores", torch.matmul(q.to(torch.float64), k.transpose(-2, -1).to(torch.float64)).to(torch.int64)
        )
        masked, additive = attention_masks(attn_mask, key_padding_mask, q.shape[0], h, q.shape[2], k.shape[2])
        if additive is not None:
            scores = numerics.saturate(scores.to(torch.int64) + mask_codes(additive, self.scores_scale), DType.qint8)
        attn = self.softmax(scores) if masked is None else self._masked_softmax(scores, masked)
        ctx = self._rq("context", torch.matmul(attn.to(torch.float64), v.to(torch.float64)).to(torch.int64))
        ctx = ctx.transpose(1, 2).reshape(ctx.shape[0], ctx.shape[2], self.embed_dim)
        out = self.out_proj(ctx)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        if average_attn_weights:
            return out, self._rq("weights_mean", attn.to(torch.int64).sum(dim=1))
        return out, self._rq("weights", attn.to(torch.int64))

    @property
    def scores_scale(self) -> float:
        return self.softmax.per_tensor_input(0)

    def _masked_softmax(self, q: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """The Softmax rule with masked entries excluded: the row maximum over the kept codes, their
        table entries summed, masked outputs 0; a fully masked row is 0."""
        sm = self.softmax
        assert sm.dtype is not None
        x = q.to(torch.int64)
        keep = ~masked.expand(x.shape)
        mx = torch.where(keep, x, torch.full_like(x, -(2**15))).amax(dim=-1, keepdim=True)
        e = sm.table.to(torch.int64)[(x - mx + 255).clamp(0, 255)] * keep
        total = e.sum(dim=-1, keepdim=True)
        den = torch.where(total == 0, torch.ones_like(total), total) << int(sm.shift)
        out = torch.div(2 * e * int(sm.multiplier) + den, 2 * den, rounding_mode="floor")
        return numerics.saturate(torch.where(total == 0, torch.zeros_like(out), out), sm.dtype)

    def extra_repr(self) -> str:
        return f"{self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}, {super().extra_repr()}"


def mask_codes(additive: torch.Tensor, s_scores: float) -> torch.Tensor:
    """A finite additive mask as codes on the scores' grid: ``round_half_up(float64(a) / f32(s))``, clamped
    to ±512 (the sum with a qint8 code saturates beyond that anyway)."""
    s = float(torch.tensor(s_scores, dtype=torch.float32))
    return numerics.round_half_up(additive.to(torch.float64) / s).clamp(-512, 512).to(torch.int64)


def numerics_requant(s_in: float, s_out: float, march: str, dtype: DType) -> tuple[int, int]:
    m, s = numerics.requant_params(s_in, s_out, march, dtype)
    return int(m), int(s)


def _legality_view(m: nn.Module) -> nn.Module | None:
    """The float MultiheadAttention (on the meta device) the operator tables describe a quantized one as."""
    if not isinstance(m, MultiheadAttention):
        return None
    return nn.MultiheadAttention(m.embed_dim, m.num_heads, bias=m.has_bias, batch_first=m.batch_first, device="meta")


register_module_view(_legality_view)


# ----------------------------------------------------------------------------- the IR's qmultihead_attention op


def _from_qmultihead_attention(op: Any, tensors: dict[str, torch.Tensor]) -> MultiheadAttention:
    m = MultiheadAttention()
    m._set_scales(op.in_scales, torch.tensor(op.out.scale), op.out.dtype)
    m.register_buffer("weights_scale", torch.tensor(op.weights.scale, dtype=torch.float32))
    m.embed_dim, m.num_heads, m.batch_first = int(op.embed_dim), int(op.num_heads), bool(op.batch_first)
    m.has_bias, m.march = bool(op.has_bias), str(op.march)
    for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        setattr(m, proj, linear_from_spec(op.march, op.in_scales[i], op.proj_outs[i], tensors, proj))
    sm = Softmax()
    sm._set_scales(op.scores.scale, torch.tensor(op.softmax.scale), op.softmax.dtype)
    sm.dim, sm.multiplier, sm.shift = int(op.softmax_dim), int(op.softmax_multiplier), int(op.softmax_shift)
    sm.register_buffer("table", tensors["softmax.table"])
    m.softmax = sm
    m.rq = {k: (mult, shift) for k, (mult, shift, _) in op.requant_dict().items()}
    m.dtypes = {k: d for k, (_, _, d) in op.requant_dict().items()}
    m.out_proj = linear_from_spec(op.march, op.context.scale[0], op.out, tensors, "out_proj")
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_sequence import QMultiheadAttention

    register_integer_module(QMultiheadAttention, MultiheadAttention, _from_qmultihead_attention)


_register_ir()
