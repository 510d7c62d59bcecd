"""QAT MultiheadAttention: ``nn.MultiheadAttention`` with a fake quant at every point its integer form quantizes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from qir.nn.qat._base import QATModule, make_weight_fq, resolve_qconfig
from qir.nn.qat.softmax import Softmax
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.qconfig import QConfig

__all__ = ["MHA_FQ_DTYPES", "MultiheadAttention", "attention_masks", "check_attention_call"]

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


def check_attention_call(what: str, is_causal: bool) -> None:
    """Refuse the configurations the integer form does not implement, naming them."""
    if is_causal:
        raise NotImplementedError(
            f"{what}: is_causal is not implemented; pass the causal mask itself as attn_mask (a bool mask, True = "
            "masked, or a float mask with -inf)"
        )


def attention_masks(
    attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, n: int, h: int, lq: int, lk: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(masked, additive)`` shaped (N, H, L, S) (broadcastable): ``masked`` is bool (True = excluded:
    True in a bool mask, ``-inf`` in a float one); ``additive`` the finite float entries (0 where masked)."""
    masked: torch.Tensor | None = None
    additive: torch.Tensor | None = None
    for mask, shape in ((attn_mask, None), (key_padding_mask, (n, 1, 1, lk))):
        if mask is None:
            continue
        if shape is None:
            shape = (1, 1, lq, lk) if mask.dim() == 2 else (n, h, lq, lk)
        mask = mask.reshape(shape)
        if mask.dtype == torch.bool:
            hard, soft = mask, None
        else:
            hard = torch.isneginf(mask)
            soft = torch.where(hard, torch.zeros_like(mask), mask)
        masked = hard if masked is None else masked | hard
        if soft is not None:
            additive = soft if additive is None else additive + soft
    return masked, additive


class MultiheadAttention(QATModule, nn.MultiheadAttention):
    """Attention composed of the pieces the integer form computes (``E`` embed dim, ``H`` heads, ``D = E/H``)::

        q, k, v = fq_q(linear(query, fq_wq(W_q), b_q)), fq_k(...), fq_v(...)      # W_q = in_proj_weight[:E], ...
        scores  = fq_s(q_h @ k_hᵀ / √D)              # per head; the 1/√D folds into the requantization
        attn    = softmax(scores)                    # qir's QAT Softmax (exp table, exact division)
        ctx     = fq_ctx(attn @ v_h)                 # heads merged back to (N, L, E)
        out     = fq_out(linear(ctx, fq_wo(out_proj.weight), out_proj.bias))
        weights = fq_w(mean over heads of attn)      # need_weights; fq_w(attn) with average_attn_weights=False

    Parameters and state-dict keys are ``nn.MultiheadAttention``'s (``in_proj_weight``,
    ``in_proj_bias``, ``out_proj.*``). Masks (bool, or float with ``-inf``) exclude entries from
    the softmax; finite float mask entries are added to the scores on their grid. Not implemented:
    ``is_causal``, ``add_bias_kv``, ``add_zero_attn``, ``kdim`` / ``vdim`` different from
    ``embed_dim`` (the Bayes table refuses the last three as well).
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.MultiheadAttention
    #: query, key and value are grid inputs (qir.quantization.integer_grid binds them to their fake quants)
    grid_inputs: ClassVar[int] = 3
    #: ``(applies, forward)`` of the integer-grid forward, set by qir.nn.quantized.attention_grid (it
    #: builds the converted module, which this layer cannot import). ``applies`` is checked before the
    #: float forward; ``forward`` gets its result and whether the grid applies, and counts the call as
    #: on the grid or fallen back (qir.quantization.integer_grid.grid_step)
    grid_hooks: ClassVar[tuple[Callable[..., bool], Callable[..., Any]] | None] = None
    #: positions of the arguments that stay float / bool (key_padding_mask, attn_mask): convert takes them as they are
    float_inputs: ClassVar[tuple[int, ...]] = (3, 5)
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
        device: Any = None,
    ) -> None:
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, batch_first=batch_first, device=device)
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
        options: dict[str, Any] = {
            "key_padding_mask": key_padding_mask,
            "need_weights": need_weights,
            "attn_mask": attn_mask,
            "average_attn_weights": average_attn_weights,
            "is_causal": is_causal,
        }
        hooks = type(self).grid_hooks
        on_grid = hooks is not None and hooks[0](self, (query, key, value))
        floats = self._float_forward(query, key, value, **options)
        if hooks is None:
            return floats
        out: tuple[torch.Tensor, torch.Tensor | None] = hooks[1](self, (query, key, value), floats, options, on_grid)
        return out

    def _float_forward(
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
        masked, additive = attention_masks(attn_mask, key_padding_mask, q.shape[0], h, q.shape[2], k.shape[2])
        if additive is not None:  # added on the scores' grid: the integer form adds the mask's codes
            scores = self.scores_post_process(scores + additive)
        attn = self.softmax(scores) if masked is None else self._masked_softmax(scores, masked)
        attn_d = F.dropout(attn, self.dropout, self.training) if self.dropout > 0 else attn
        ctx = self.context_post_process(torch.matmul(attn_d, v))
        ctx = ctx.transpose(1, 2).reshape(ctx.shape[0], ctx.shape[2], e)
        out = self.activation_post_process(F.linear(ctx, self.wo_fake_quant(self.out_proj.weight), self.out_proj.bias))
        if not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        # torch returns the weights after dropout (training only; identical in eval)
        weights = self.weights_post_process(attn_d.mean(dim=1) if average_attn_weights else attn_d)
        return out, weights

    def _masked_softmax(self, x: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """qir's QAT Softmax (its fake quants) with the masked entries excluded; a fully masked row is 0."""
        sm = self.softmax
        keep = ~masked
        mx = x.masked_fill(masked, float("-inf")).amax(dim=-1, keepdim=True).detach()
        e = sm.exp_post_process(torch.exp(torch.where(keep, x - mx, torch.zeros_like(x))))
        e = e * keep
        out_fq = sm.activation_post_process
        assert out_fq is not None
        return out_fq(e / e.sum(dim=-1, keepdim=True).clamp_min(1e-30))

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
