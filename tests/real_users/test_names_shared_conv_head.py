"""An FCOS-style head whose conv is shared by every FPN level, each level with its own batch norm:
the plugin's ``fuse_conv_shared_modules(m, [["1", "2", "3"]], inplace=True)`` in each level's
Sequential, then eager QAT, convert, check, compile."""

import torch
from names_flow import finish
from torch import nn

import qir
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert,
    fuse_conv_shared_modules,
    get_default_qat_qconfig,
    prepare_qat,
    set_fake_quantize,
)


class SharedHead(nn.Module):
    def __init__(self, c: int = 8, levels: int = 3) -> None:
        super().__init__()
        self.quants = nn.ModuleList(QuantStub() for _ in range(levels))
        shared = nn.Conv2d(c, c, 3, padding=1)
        # level i: (0) its own input conv, (1) the shared conv, (2) its batch norm, (3) ReLU
        self.cls_convs = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, c, 1), shared, nn.BatchNorm2d(c), nn.ReLU()) for _ in range(levels)
        )
        self.dequants = nn.ModuleList(DeQuantStub() for _ in range(levels))
        self.levels = levels

    def forward(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.dequants[i](self.cls_convs[i](self.quants[i](feats[i]))) for i in range(self.levels)]

    def fuse_model(self) -> None:
        for m in self.cls_convs:
            qir.quantization.fuse_conv_shared_modules(m, [["1", "2", "3"]], inplace=True)


def _feats() -> list[torch.Tensor]:
    return [torch.randn(1, 8, s, s) for s in (8, 4, 2)]


def test_shared_conv_fuses_per_level_and_keeps_the_shared_conv() -> None:
    torch.manual_seed(0)
    head = SharedHead().eval()
    for m in head.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 2.0)
    shared = head.cls_convs[0][1]
    feats = _feats()
    with torch.no_grad():
        want = head(feats)
    fused = fuse_conv_shared_modules(head.cls_convs[0], [["1", "2", "3"]])  # a copy by default
    assert isinstance(fused[1], nn.Identity) and isinstance(head.cls_convs[0][1], nn.Conv2d)
    head.fuse_model()
    for level in head.cls_convs:
        assert isinstance(level[1], nn.Identity) and isinstance(level[2], nn.Identity)
        assert type(level[3]).__name__ == "ConvReLU2d"
    assert not any(p is shared.weight for level in head.cls_convs for p in level[3].parameters())
    with torch.no_grad():
        got = head(feats)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=1e-5)


def test_shared_conv_head_trains_converts_and_compiles() -> None:
    torch.manual_seed(1)
    head = SharedHead().eval()
    head.fuse_model()
    head.qconfig = get_default_qat_qconfig()
    with qir.march.march_scope("bayes"):
        qat = prepare_qat(head)
        qat.train()
        for _ in range(3):
            qat(_feats())
        qat.eval()
        set_fake_quantize(qat, "validation")
        converted = convert(qat)
        feats = _feats()
        with torch.no_grad():
            got, ref = converted(feats), qat(feats)
        for level, (g, r) in enumerate(zip(got, ref, strict=True)):
            lsb = float(qat.cls_convs[level][3].activation_post_process.scale)
            assert (g - r).abs().max() <= lsb
        # the artifact of one level (compile takes tensors): the level's Sequential between its stubs
        one = nn.Sequential(converted.quants[0], converted.cls_convs[0], converted.dequants[0])
        one_qat = nn.Sequential(qat.quants[0], qat.cls_convs[0], qat.dequants[0])
        finish(one_qat, one, (feats[0],))
