"""QAT MultiheadAttention: ``nn.MultiheadAttention`` with a fake quant at every point its integer form quantizes."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from qir.nn.qat._base import QATModule, make_weight_fq, resolve_qconfig
from qir.nn.qat.softmax import Softmax
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.qconfig import QConfig

__all__ = ["MHA_FQ_DTYPES", "MultiheadAttention", "check_attention_call"]

#: Fake quant name -> dtype (``None``: the qconfig's activation dtype). The scores are qint8:
#: the integer softmax's exp table takes 256 codes.
MHA_FQ_DTYPES: dict[str, str | None] = {
    "q_post_process": None,
    "k_post_process": None,
    "v_post_process": None,
    "scores_post_process": "qint8",
    "context_post_process": None,
    "weights_post_process": None,
    "activation_post_process": None,
}


def check_attention_call(what: str, key_padding_mask: Any, attn_mask: Any, is_causal: bool) -> None:
    """Refuse the configurations the integer form does not implement, naming them."""
    if key_padding_mask is not None or attn_mask is not None or is_causal:
        raise NotImplementedError(
            f"{what}: attn_mask, key_padding_mask and is_causal are not implemented (the integer softmax has no "
            "masked form yet); call it without masks, or keep the attention in float (DeQuantStub before it)"
        )


class MultiheadAttention(QATModule, nn.MultiheadAttention):
    """Attention composed of the pieces the integer form computes (``E`` embed dim, ``H`` heads, ``D = E/H``)::

        q, k, v = fq_q(linear(query, fq_wq(W_q), b_q)), fq_k(...), fq_v(...)      # W_q = in_proj_weight[:E], ...
        scores  = fq_s(q_h @ k_hᵀ / √D)              # per head; the 1/√D folds into the requantization
        attn    = softmax(scores)                    # qir's QAT Softmax (exp table, exact division)
        ctx     = fq_ctx(attn @ v_h)                 # heads merged back to (N, L, E)
        out     = fq_out(linear(ctx, fq_wo(out_proj.weight), out_proj.bias))
        weights = fq_w(mean over heads of attn)      # need_weights; fq_w(attn) with average_attn_weights=False

    Parameters and state-dict keys are ``nn.MultiheadAttention``'s (``in_proj_weight``,
    ``in_proj_bias``, ``out_proj.*``). Not implemented: masks, ``is_causal``, ``add_bias_kv``,
    ``add_zero_attn``, ``kdim`` / ``vdim`` different from ``embed_dim`` (the Bayes table refuses
    the last three as well).
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.MultiheadAttention
    wq_fake_quant: FakeQuantize
    wk_fake_quant: FakeQuantize
    wv_fake_quant: FakeQuantize
    wo_fake_quant: FakeQuantize
    q_post_process: FakeQuantize
    k_post_process: FakeQuantize
    v_post_process: FakeQuantize
    scores_post_process: FakeQuantize
    context_post_process: FakeQuantize
    weights_post_process: FakeQuantize
    activation_post_process: FakeQuantize
    softmax: Softmax

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        batch_first: bool = False,
        *,
        qconfig: QConfig,
    ) -> None:
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, batch_first=batch_first)
        name = type(self).__name__
        self.qconfig = qconfig
        for w in ("wq", "wk", "wv", "wo"):
            setattr(self, f"{w}_fake_quant", make_weight_fq(qconfig, name, 0))
        if qconfig.activation is None:
            raise ValueError(f"{name} needs qconfig.activation (its projections and scores are quantized); got None")
        for fq_name, dtype in MHA_FQ_DTYPES.items():
            fq = qconfig.activation() if dtype is None else qconfig.activation(dtype=dtype)
            if not isinstance(fq, FakeQuantize):
                raise TypeError(f"{name}: qconfig.activation must build a qir FakeQuantize, got {type(fq).__name__}")
            setattr(self, fq_name, fq)
        self.softmax = Softmax.from_float(nn.Softmax(-1), qconfig)

    def output_fake_quants(self) -> tuple[FakeQuantize, FakeQuantize]:
        """The fake quants of the two outputs ``(attn_output, attn_weights)``."""
        return self.activation_post_process, self.weights_post_process

    def projection(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias of the input projection ``i`` (0 q, 1 k, 2 v): rows of the packed parameters."""
        e = self.embed_dim
        w = self.in_proj_weight[i * e : (i + 1) * e]
        b = None if self.in_proj_bias is None else self.in_proj_bias[i * e : (i + 1) * e]
        return w, b

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
        check_attention_call(type(self).__name__, key_padding_mask, attn_mask, is_causal)
        if query.dim() != 3:
            raise NotImplementedError(f"{type(self).__name__}: only batched (3-dimensional) inputs are implemented")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        h, e = self.num_heads, self.embed_dim
        d = e // h
        proj = []
        for i, (t, wfq, ofq) in enumerate(
            (
                (query, self.wq_fake_quant, self.q_post_process),
                (key, self.wk_fake_quant, self.k_post_process),
                (value, self.wv_fake_quant, self.v_post_process),
            )
        ):
            w, b = self.projection(i)
            y = ofq(F.linear(t, wfq(w), b))
            proj.append(y.reshape(y.shape[0], y.shape[1], h, d).transpose(1, 2))  # (N, H, L, D)
        q, k, v = proj
        scores = self.scores_post_process(torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d)))
        attn = self.softmax(scores)
        attn_d = F.dropout(attn, self.dropout, self.training) if self.dropout > 0 else attn
        ctx = self.context_post_process(torch.matmul(attn_d, v))
        ctx = ctx.transpose(1, 2).reshape(ctx.shape[0], ctx.shape[2], e)
        out = self.activation_post_process(F.linear(ctx, self.wo_fake_quant(self.out_proj.weight), self.out_proj.bias))
        if not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        weights = self.weights_post_process(attn.mean(dim=1) if average_attn_weights else attn)
        return out, weights

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> MultiheadAttention:
        if type(mod) is not nn.MultiheadAttention:
            raise TypeError(f"MultiheadAttention.from_float takes nn.MultiheadAttention, got {type(mod).__name__}")
        assert isinstance(mod, nn.MultiheadAttention)
        if mod.bias_k is not None or mod.add_zero_attn or not mod._qkv_same_embed_dim:
            raise NotImplementedError(
                "MultiheadAttention: add_bias_kv, add_zero_attn and kdim / vdim different from embed_dim are not "
                "implemented (the Bayes table does not support them either); use the default configuration"
            )
        qc = resolve_qconfig(mod, qconfig, cls.__name__)
        new = cls(mod.embed_dim, mod.num_heads, mod.dropout, mod.in_proj_bias is not None, mod.batch_first, qconfig=qc)
        new.to(device=mod.in_proj_weight.device)
        _, unexpected = new.load_state_dict(mod.state_dict(), strict=False)
        assert not unexpected, unexpected
        for pname, p in mod.named_parameters():
            new.get_parameter(pname).requires_grad_(p.requires_grad)
        new.train(mod.training)
        return new
