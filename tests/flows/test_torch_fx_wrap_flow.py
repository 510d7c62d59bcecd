"""A function registered with ``torch.fx.wrap`` (torchvision's Swin helpers) on quantized tensors runs in
float as a ``qir.utils.fx_helper.wrap``'ed one does: ``convert_fx`` passes it dequantized values. Where its
float result would reach a quantized module, ``prepare_qat_fx`` refuses the model at once, naming the
function and the fix (``hybrid=True`` puts the stubs around it)."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.prepare_checks import UnconvertibleModelError
from qir.utils.fx_helper import torch_fx_wrapped, wrap


def window_attention(x: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor, proj_w: torch.Tensor) -> torch.Tensor:
    """Swin's shape: the layer's float weights are arguments of a function fx does not look into."""
    b, n, c = x.shape
    qkv = F.linear(x, qkv_w, qkv_b).reshape(b, n, 3, 2, c // 2).permute(2, 0, 3, 1, 4)
    a = (qkv[0] @ qkv[1].transpose(-2, -1)).softmax(-1)
    return F.linear((a @ qkv[2]).transpose(1, 2).reshape(b, n, c), proj_w)


def top_scores(x: torch.Tensor) -> torch.Tensor:
    """Post-processing on the quantized output: float code at the end of the model."""
    return x.flatten(1).topk(3, dim=1).values * 2.0


torch.fx.wrap("window_attention")
torch.fx.wrap("top_scores")


class Attention(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return window_attention(x, self.qkv.weight, self.qkv.bias, self.proj.weight)


class SwinLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.attn = Attention()
        self.head = nn.Linear(8, 4)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.quant(x)).flatten(2).transpose(1, 2)
        x = x + self.attn(self.norm(x))
        return self.dequant(self.head(x.mean(1)))


class PostProcessed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return top_scores(self.conv(self.quant(x)))  # no DeQuantStub: the wrapped code receives the codes' values


def test_torch_fx_wrapped_is_the_registry_of_torch_fx_wrap() -> None:
    assert torch_fx_wrapped(window_attention) and torch_fx_wrapped(top_scores)
    assert not torch_fx_wrapped(F.linear) and not torch_fx_wrapped(len)

    def local(x: torch.Tensor) -> torch.Tensor:
        return x

    assert not torch_fx_wrapped(local)
    assert not torch_fx_wrapped(wrap(local))  # qir's own wrapper is recognised as such, not as torch.fx.wrap


def _flow(model: nn.Module, x: torch.Tensor, march: str, hybrid: bool = False) -> tuple[nn.Module, torch.Tensor]:
    with march_scope(march):
        calib = prepare_qat_fx(model, {"": get_default_calib_qconfig()}, (x,), hybrid=hybrid)
        calib.eval()
        calib(x)
        qat = prepare_qat_fx(calib, {"": get_default_qat_qconfig()}, hybrid=hybrid)
        qat.train()
        opt = torch.optim.SGD(qat.parameters(), lr=1e-3)
        qat(x).sum().backward()
        opt.step()
        set_fake_quantize(qat.eval(), "validation")
        with torch.no_grad():
            return convert_fx(qat), qat(x)


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_a_torch_fx_wrapped_post_process_receives_dequantized_values(march: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6)
    converted, val = _flow(PostProcessed().eval(), x, march)
    calls = [n for n in converted.graph.nodes if n.op == "call_function" and n.target is top_scores]
    assert len(calls) == 1
    (arg,) = calls[0].all_input_nodes
    assert arg.op == "call_module" and "dequant" in str(arg.target)  # a generated DeQuantStub feeds it
    with torch.no_grad():
        got = converted(x)
    assert got.dtype == torch.float32 and torch.equal(got, val)


def test_a_torch_fx_wrapped_result_reaching_a_quantized_module_is_refused_at_prepare() -> None:
    x = torch.randn(2, 3, 4, 4)
    with march_scope("bayes"), pytest.raises(UnconvertibleModelError) as e:
        prepare_qat_fx(SwinLike().eval(), {"": get_default_calib_qconfig()}, (x,))
    msg = str(e.value)
    assert f"{__name__}.window_attention, a function registered with torch.fx.wrap" in msg
    assert "module 'attn' (Attention)" in msg and "'_generated_add_0'" in msg
    assert "hybrid=True" in msg and "QuantStub" in msg


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_with_hybrid_the_torch_fx_wrapped_call_runs_between_generated_stubs(march: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 4)
    converted, val = _flow(SwinLike().eval(), x, march, hybrid=True)
    with torch.no_grad():
        assert torch.equal(converted(x), val)
