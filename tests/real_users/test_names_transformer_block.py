"""A BEV-style attention block on (N, C, H, W) features, as the plugin's toolkit writes it:
``LayerNorm([C, 1, 1], dim=1)`` (imported as LayerNorm2d), scores by
``FloatFunctional().matmul(q, k, x_trans=False, y_trans=True)``, a softmax, a qint16 score scale."""

import torch
from names_flow import fx_flow
from torch import nn

from qir.dtype import qint16
from qir.march import March, march_scope
from qir.nn import LayerNorm as LayerNorm2d
from qir.nn.quantized import FloatFunctional
from qir.quantization import DeQuantStub, QuantStub, get_default_calib_qconfig, get_default_qat_qconfig


class AttentionBlock(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.norm = LayerNorm2d([c, 1, 1], dim=1)
        self.q_proj, self.k_proj, self.v_proj = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1)
        self.scores = FloatFunctional()
        self.scale = FloatFunctional()
        self.softmax = nn.Softmax(dim=-1)
        self.context = FloatFunctional()
        self.residual = FloatFunctional()
        self.dequant = DeQuantStub()
        self.c = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        n, c, h, w = 1, self.c, 4, 4  # static sizes, as deployed configs fix them
        y = self.norm(x)
        q = self.q_proj(y).reshape(n, c, h * w).permute(0, 2, 1)  # (n, hw, c)
        k = self.k_proj(y).reshape(n, c, h * w).permute(0, 2, 1)
        v = self.v_proj(y).reshape(n, c, h * w).permute(0, 2, 1)
        s = self.scale.mul_scalar(self.scores.matmul(q, k, x_trans=False, y_trans=True), c**-0.5)
        out = self.context.matmul(self.softmax(s), v).permute(0, 2, 1).reshape(n, c, h, w)
        return self.dequant(self.residual.add(x, out))


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(1, 8, 4, 4),)


def test_attention_block_with_channel_layer_norm_runs_end_to_end() -> None:
    torch.manual_seed(0)
    int16_scores = {"scores": get_default_qat_qconfig(dtype=qint16)}
    with march_scope(March.BAYES):
        result = fx_flow(
            AttentionBlock(),
            _inputs,
            calib_dict={
                "": get_default_calib_qconfig(),
                "module_name": {"scores": get_default_calib_qconfig(dtype=qint16)},
            },
            qat_dict={"": get_default_qat_qconfig(), "module_name": int16_scores},
        )
    assert result.qat.scores.activation_post_process.dtype.name == "qint16"
    lsb = float(result.qat.residual.activation_post_process.scale)
    # the block's integer result stays within a few output LSB of the frozen QAT model
    assert result.max_error() <= 4 * lsb
