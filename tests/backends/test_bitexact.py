"""The compiled artifact equals the converted model bit for bit (torch.equal), on >= 100 inputs
per model: random conv/bn/relu/add/pool/linear chains (hypothesis), DigitsNet on both
marches, and seed 002's eager flow compiled from its torch.jit.trace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bitexact_models import chain, digits_net, fx_converted, randomize_bn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.ao.quantization import DeQuantStub

import qir
from qir.march import march_scope
from qir.quantization import (
    QuantStub,
    compile_model,
    convert,
    fuse_known_modules,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat,
)

N_INPUTS = 100


def _assert_bitexact(
    converted: nn.Module, path: Path, shape: tuple[int, ...], seed: int = 1, scale: float = 1.5
) -> int:
    run = qir.load_compiled(path)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_INPUTS, *shape[1:], generator=g) * scale
    with torch.no_grad():
        want = converted(x)
    got = run(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), f"max diff {(got.double() - want.double()).abs().max()}"
    return N_INPUTS


_LAYER = st.tuples(
    st.sampled_from(["conv", "convbn", "convbnrelu", "convrelu", "residual", "maxpool", "avgpool"]),
    st.integers(2, 12),
    st.sampled_from([1, 3]),
    st.sampled_from([1, 2]),
)


@settings(max_examples=5, deadline=None)
@given(
    spec=st.lists(_LAYER, min_size=1, max_size=5),
    head=st.sampled_from(["linear", "conv"]),
    cin=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_random_chains_bitexact(
    tmp_path_factory: pytest.TempPathFactory, spec: list, head: str, cin: int, seed: int
) -> None:
    torch.manual_seed(seed)
    shape = (4, cin, 12, 12)
    converted = fx_converted(randomize_bn(chain(spec, cin, head), seed), shape, "bayes", seed=seed)
    path = tmp_path_factory.mktemp("chain") / "m.hbm"
    compile_model(converted, [torch.randn(*shape)], hbm=path, march="bayes", opt=1, check=False)
    _assert_bitexact(converted, path, shape, seed)


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_digits_net_bitexact(tmp_path: Path, march: str) -> None:
    shape = (8, 1, 28, 28)
    converted = fx_converted(digits_net(), shape, march, batches=2)
    compile_model(converted, [torch.randn(*shape)], hbm=tmp_path / "d.hbm", opt=2 if march == "bayes" else 1)
    _assert_bitexact(converted, tmp_path / "d.hbm", shape)


def test_digits_net_high_precision_output_bitexact(tmp_path: Path) -> None:
    # the classifier emits qint32 with a per-channel dequant scale
    shape = (8, 1, 28, 28)
    qd = {"": get_default_qat_qconfig(), "module_name": {"body.classifier": get_default_qat_out_qconfig()}}
    converted = fx_converted(digits_net(width=4), shape, "bayes", batches=2, qconfig_dict=qd)
    compile_model(converted, [torch.randn(*shape)], hbm=tmp_path / "d.hbm", opt=1)
    _assert_bitexact(converted, tmp_path / "d.hbm", shape)


class _ConvBNReLU(nn.Sequential):
    def __init__(self, cin: int, cout: int, k: int) -> None:
        super().__init__(nn.Conv2d(cin, cout, k), nn.BatchNorm2d(cout), nn.ReLU())


class _Seed002Net(nn.Module):
    """Seed 002's eager-mode network."""

    def __init__(self) -> None:
        super().__init__()
        self.conv0 = _ConvBNReLU(1, 10, 5)
        self.max_pool = nn.MaxPool2d(kernel_size=2)
        self.conv1 = _ConvBNReLU(10, 20, 5)
        self.avg_pool = nn.AvgPool2d(kernel_size=8)
        self.classifier = nn.Conv2d(20, 10, 1)
        self.quant = QuantStub(scale=1 / 128)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avg_pool(self.conv1(self.max_pool(self.conv0(self.quant(x)))))
        return self.dequant(self.classifier(x))


def test_seed_002_eager_flow_traced_bitexact(tmp_path: Path) -> None:
    with march_scope("bayes"):
        model = randomize_bn(_Seed002Net())
        for m in (model.conv0, model.conv1):
            torch.ao.quantization.fuse_modules(m, ["0", "1", "2"], inplace=True, fuser_func=fuse_known_modules)
        model.qconfig = get_default_qat_qconfig()
        model.classifier.qconfig = get_default_qat_out_qconfig()
        prepare_qat(model, inplace=True)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _ in range(3):
                model(torch.rand(16, 1, 28, 28, generator=g) * 2 - 1)
        quantized_model = convert(model.eval(), inplace=False)
        example_input = torch.ones(1, 1, 28, 28)
        traced_model = torch.jit.trace(quantized_model, example_input)
        compile_model(traced_model, [example_input], opt=2, hbm=tmp_path / "model.hbm")
    _assert_bitexact(quantized_model, tmp_path / "model.hbm", (1, 1, 28, 28), scale=0.6)
    run = qir.load_compiled(tmp_path / "model.hbm")
    x = torch.rand(N_INPUTS, 1, 28, 28) * 2 - 1
    assert torch.equal(run(x), traced_model(x))
