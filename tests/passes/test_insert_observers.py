"""The ``insert-observers`` pass on its own: options as text, which layers it converts, refusals.

How ``prepare_qat_fx`` drives it and that the result equals module swapping:
tests/quantization/test_prepare_paths.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import passes
import qir.nn.qat  # noqa: F401  (registers the observer rules)
from passes.insert_observers import InsertObservers, InsertObserversError, fake_quant_text, uncovered
from qir.frontend import trace
from qir.ir.ops.qat import QATConv
from qir.quantization import get_default_qat_qconfig
from qir.quantization.fake_quant_ir import fake_quant_spec


def _float_graph() -> tuple[Any, torch.Tensor]:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.conv(x).mean((2, 3)))

    x = torch.randn(1, 3, 6, 6)
    return trace(Net(), (x,)), x


def _options() -> InsertObservers:
    qc = get_default_qat_qconfig()
    texts = (fake_quant_text(fake_quant_spec(qc.activation(), "a")), fake_quant_text(fake_quant_spec(qc.weight(), "w")))
    return InsertObservers(fake_quants=texts, qconfigs=(("conv", 0, 1),))


def test_the_pass_prints_parses_back_and_converts_only_the_listed_layers() -> None:
    g, _ = _float_graph()
    p = _options()
    assert passes.Pipeline.parse(str(passes.Pipeline((p,)))) == passes.Pipeline((p,))
    out = passes.run_pipeline(g, p).graph
    ops = {n.scope: n.op for n in out.nodes if n.scope in ("conv", "fc")}
    assert isinstance(ops["conv"], QATConv) and ops["conv"].out_fq is not None
    assert ops["fc"].name == "linear"  # not listed: stays float
    assert "conv.weight_fake_quant.scale" in out.constants and "conv.weight" in out.constants


def test_the_pass_names_a_layer_it_cannot_convert() -> None:
    g, _ = _float_graph()
    p = InsertObservers(fake_quants=_options().fake_quants, qconfigs=(("conv", 0, 1), ("nowhere", 0, None)))
    assert uncovered(g, {"conv", "nowhere"}) == [
        ("nowhere", "module 'nowhere' is not called in the graph as a layer of its own")
    ]
    with pytest.raises(passes.PassFailure) as e:
        passes.run_pipeline(g, p)
    assert isinstance(e.value.__cause__, InsertObserversError) and "'nowhere'" in str(e.value.__cause__)
    bad = InsertObservers(fake_quants=_options().fake_quants, qconfigs=(("conv", 0, 7),))
    with pytest.raises(passes.PassFailure, match="weight 7 is not an index of fake_quants"):
        passes.run_pipeline(g, bad)


def test_each_call_site_gets_its_own_output_observer_and_shares_the_weight() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(self.conv(x))

    g = trace(Twice(), (torch.randn(1, 4, 5, 5),))
    p = InsertObservers(
        fake_quants=_options().fake_quants, qconfigs=(("conv", 0, 1),), call_sites=(("conv", ("conv_call1",)),)
    )
    out = passes.run_pipeline(g, p).graph
    first, second = (n for n in out.nodes if isinstance(n.op, QATConv))
    assert (first.scope, second.scope) == ("conv", "conv_call1")
    roles = first.op.param_roles()
    own = {r for r in roles if r.startswith("activation_post_process")}
    for role, a, b in zip(
        roles, first.op.module_params(first.operands), second.op.module_params(second.operands), strict=True
    ):
        assert (a is b) == (role not in own), role  # one weight and weight fake quant, an output observer each
    assert "conv_call1.activation_post_process.scale" in out.constants and "conv_call1.weight" not in out.constants
    missing = InsertObservers(fake_quants=_options().fake_quants, qconfigs=(("conv", 0, 1),))
    with pytest.raises(passes.PassFailure, match="call_sites names no scope for this call"):
        passes.run_pipeline(g, missing)
