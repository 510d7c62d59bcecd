"""Integer-exact VALIDATION: a prepare_qat_fx model in validation state computes what convert_fx
and the compiled artifact compute, bit for bit."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qir.march import march_scope
from qir.quantization import (
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.convert import ConvertError
from qir.quantization.exact_validation import QATGraphModule, set_exact_validation
from qir.quantization.fake_quantize import float_fake_quant

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from bitexact_models import Stubbed, chain, digits_net, randomize_bn

_LAYER = st.tuples(
    st.sampled_from(["conv", "convbn", "convbnrelu", "convrelu", "residual", "maxpool", "avgpool"]),
    st.integers(2, 12),
    st.sampled_from([1, 3]),
    st.sampled_from([1, 2]),
)


def _trained(
    model: nn.Module, shape: tuple[int, ...], march: str = "bayes", seed: int = 0, steps: int = 3
) -> nn.Module:
    with march_scope(march):
        prepared = prepare_qat_fx(model, {"": get_default_qat_qconfig()})
    g = torch.Generator().manual_seed(seed)
    prepared.train()
    with torch.no_grad():
        for _ in range(steps):
            prepared(torch.randn(*shape, generator=g))
    set_fake_quantize(prepared, "validation")
    return prepared.eval()


@settings(max_examples=6, deadline=None)
@given(
    spec=st.lists(_LAYER, min_size=1, max_size=6),
    head=st.sampled_from(["linear", "conv"]),
    march=st.sampled_from(["bayes", "bernoulli2"]),
    seed=st.integers(0, 1000),
)
def test_validation_is_the_converted_model(spec: list, head: str, march: str, seed: int) -> None:
    if head == "linear" and march == "bernoulli2":
        head = "conv"  # no Linear on Bernoulli2
    torch.manual_seed(seed)
    shape = (3, 3, 12, 12)
    qat = _trained(randomize_bn(chain(spec, 3, head), seed), shape, march, seed)
    x = torch.randn(*shape)
    with march_scope(march):
        try:
            converted = convert_fx(qat)
        except ConvertError:  # e.g. a requantization ratio Bernoulli2 cannot express
            with pytest.warns(RuntimeWarning, match="convert_fx failed"):
                qat(x)  # validation says it fell back to the simulation
            return
    assert torch.equal(qat(x), converted(x))


def test_validation_is_the_artifact_and_the_float_simulation_is_not(tmp_path: Path) -> None:
    torch.manual_seed(0)  # on a small net the two can agree on some draws: fix the draw
    shape = (8, 1, 28, 28)
    qat = _trained(digits_net(), shape, steps=2)
    x = torch.randn(*shape)
    with march_scope("bayes"):
        compiled = compile_model(convert_fx(qat), [x], hbm=tmp_path / "m.hbm")
    got = qat(x)
    assert torch.equal(got, compiled(x))
    assert not got.requires_grad  # the deployed model: no autograd
    set_exact_validation(qat, False)
    simulated = qat(x)
    assert simulated.requires_grad and not torch.equal(simulated, got)
    assert (simulated - got).abs().max() < 0.5  # the float simulation is close, not equal
    set_exact_validation(qat, True)
    with float_fake_quant():
        assert torch.equal(qat(x), simulated)
    assert torch.equal(qat(x), got)


def test_the_twin_follows_edits_and_copies() -> None:
    shape = (2, 3, 12, 12)
    qat = _trained(randomize_bn(chain([("convbnrelu", 8, 3, 1), ("residual", 8, 3, 1)], 3, "linear")), shape)
    x = torch.randn(*shape)
    before = qat(x)
    dup = copy.deepcopy(qat)
    assert isinstance(dup, QATGraphModule) and torch.equal(dup(x), before)
    weight = next(p for n, p in qat.named_parameters() if n.endswith("weight"))
    with torch.no_grad():
        weight.mul_(1.5)  # an in-place edit, as an optimizer step makes
    after = qat(x)
    assert not torch.equal(after, before)
    with march_scope("bayes"):
        assert torch.equal(after, convert_fx(qat)(x))
    assert torch.equal(dup(x), before)  # the copy kept its own weights and twin
    with march_scope("bayes"):
        converted = convert_fx(qat)
    assert not isinstance(converted, QATGraphModule)


def test_other_states_run_the_fake_quant_graph() -> None:
    shape = (2, 3, 12, 12)
    qat = _trained(randomize_bn(chain([("convbnrelu", 4, 3, 1)], 3, "conv")), shape)
    x = torch.randn(*shape)
    set_fake_quantize(qat, "qat")
    qat.train()
    y = qat(x)
    assert y.requires_grad
    y.sum().backward()  # training still trains
    with march_scope("bayes"):
        calib = prepare_qat_fx(chain([("convbnrelu", 4, 3, 1)], 3, "conv"), {"": get_default_calib_qconfig()})
    calib.eval()
    calib(x)  # calibration observes through the float graph
    set_fake_quantize(calib, "validation")
    with march_scope("bayes"):
        assert torch.equal(calib(x), convert_fx(calib)(x))


def test_exactness_needs_a_prepared_model() -> None:
    with pytest.raises(TypeError, match="prepare_qat_fx"):
        set_exact_validation(Stubbed(nn.Conv2d(1, 1, 1)), False)


class _Unconvertible(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = chain([("convbnrelu", 4, 3, 1)], 3, "conv")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body.quant(x)
        y = torch.clamp(y, min=y.flip(1))  # a tensor bound: convert refuses it
        return self.body.dequant(y)


def test_a_model_convert_refuses_warns_and_keeps_the_simulation() -> None:
    shape = (2, 3, 4, 4)
    qat = _trained(_Unconvertible(), shape)
    x = torch.randn(*shape)
    with pytest.warns(RuntimeWarning, match=r"runs float fake quantization.*convert_fx failed"):
        y = qat(x)
    set_exact_validation(qat, False)
    assert torch.equal(y, qat(x))


def test_the_switches_are_public() -> None:
    import qir.quantization as q

    assert q.set_exact_validation is set_exact_validation and q.float_fake_quant is float_fake_quant
    assert q.QATGraphModule is QATGraphModule


def test_training_goes_on_when_the_march_cannot_requantize_a_pool_this_step() -> None:
    # found by the property test: the first steps' global pool output range is over 255x narrower
    # than its input's, a ratio Bernoulli2 cannot requantize; training must not stop on it
    spec = [("conv", 2, 1, 1), ("convrelu", 9, 1, 2), ("convbn", 8, 3, 1), ("convbnrelu", 7, 3, 2)]
    spec += [("convrelu", 2, 3, 2), ("maxpool", 2, 1, 2)]
    torch.manual_seed(0)
    shape = (3, 3, 12, 12)
    with pytest.warns(RuntimeWarning, match="cannot requantize on bernoulli2"):
        qat = _trained(randomize_bn(chain(spec, 3, "conv"), 0), shape, "bernoulli2", 0)
    # the pool's one-element windows have the largest ratio, s_in / s_out: convert refuses it,
    # naming the module, the bound and the fix, instead of the converted pool failing on its first run
    with (
        march_scope("bernoulli2"),
        pytest.raises(
            ConvertError,
            match=r"module '[\w.]+' \(AdaptiveAvgPool2d\).*must exceed in_scale / 255\.5.*fixed scale of at least",
        ),
    ):
        convert_fx(qat)
