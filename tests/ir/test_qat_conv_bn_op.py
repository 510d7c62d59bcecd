"""``qat_conv_bn``: with-BN QAT convs (the ``with_bn`` QAT mode) are typed ops in the IR.

The batch norm's running statistics are constants the rebuilt module updates in training, so
``run_graph`` is the prepared model; the ``quantize`` pass folds the batch norm and gives what
``convert_fx`` gives (it folds before tracing).
"""

from __future__ import annotations

import pytest
import torch

import passes
import qir
from passes.quantize import Quantize
from qir.examples import DeployableDigitsNet
from qir.frontend import emit
from qir.ir import IRError
from qir.ir.ops.qat import FakeQuantSpec
from qir.ir.ops.qat_conv_bn import QATConvBN
from qir.ir.ops.quant import ObserverSpec
from qir.qat_mode import qat_mode_scope
from qir.quantization import convert_fx, get_default_qat_out_qconfig, get_default_qat_qconfig, prepare_qat_fx
from tests.ir.qat_family import assert_qat_contract

QAT_DICT = {"": get_default_qat_qconfig(), "module_name": {"classifier": get_default_qat_out_qconfig()}}


def _batch() -> torch.Tensor:
    return torch.rand(8, 1, 8, 8) * 2 - 1


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_with_bn_convs_are_qat_conv_bn_ops_keeping_the_contract(march: str) -> None:
    torch.manual_seed(0)
    qir.set_march(march)
    x = _batch()
    with qat_mode_scope("with_bn"):
        qat = prepare_qat_fx(DeployableDigitsNet(), QAT_DICT, x)
    qat(_batch())
    before = qat.conv0.bn.running_mean.clone()
    g = assert_qat_contract(qat, x, _batch)  # trains two steps: the running statistics move
    assert not torch.equal(qat.conv0.bn.running_mean, before)
    convs = {n.scope: n.op for n in g.nodes if isinstance(n.op, QATConvBN)}
    assert set(convs) == {"conv0", "add", "conv2"} and convs["add"].add and convs["conv0"].act == "relu"
    assert convs["conv0"].param_roles()[-5:] == (
        "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked",
    )  # fmt: skip
    converted = passes.run_pipeline(g, Quantize(march=march)).graph
    assert torch.equal(emit(converted)(x), convert_fx(qat)(x))


def _op(**kw: object) -> QATConvBN:
    spec = FakeQuantSpec(ObserverSpec("moving_average_per_channel_minmax", axis=0))
    fields = {
        "kind": "conv2d",
        "in_channels": 3,
        "out_channels": 8,
        "weight_fq": spec,
        "out_fq": FakeQuantSpec(ObserverSpec()),
        "kernel_size": (3, 3),
        "stride": (1, 1),
        "padding": (1, 1),
        "dilation": (1, 1),
    }
    fields.update(kw)
    return QATConvBN(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"bn_class": "GroupNorm"}, "bn_class must be one of"),
        ({"bn_eps": 0}, r"bn_eps must be a number in \(0, 1\)"),
        ({"bn_momentum": 2.0}, r"bn_momentum must be None or in \[0, 1\]"),
        ({"bn_affine": 1}, "bn_affine must be a boolean"),
        ({"act": "gelu"}, "act must be one of"),  # the conv's own checks still hold
    ],
)
def test_bad_fields_are_refused_naming_them(fields: dict[str, object], message: str) -> None:
    with pytest.raises(IRError, match=message):
        _op(**fields)
