"""The QAT module ``insert-observers`` builds is the one emit installs, once, and only while the
node still has the op and the tensors it was built for (qir/ir/prebuilt.py)."""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn

import passes
import qir.nn.qat  # noqa: F401  (registers the observer rules)
from passes.insert_observers import InsertObservers, fake_quant_text
from qir.frontend import emit, trace
from qir.ir.ops.qat import QATConv
from qir.ir.prebuilt import PREBUILT_MODULE_KEY, PrebuiltModule
from qir.march import march_scope
from qir.nn.qat.conv import QATConvBase
from qir.quantization import DeQuantStub, QuantStub, get_default_qat_qconfig, prepare_qat_fx
from qir.quantization.fake_quant_ir import fake_quant_spec
from qir.quantization.prepare import PREPARE_BY_PASS, PREPARE_PATH_KEY


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc(self.relu(self.bn(self.conv(self.quant(x)))).mean((2, 3))))


def _observed() -> tuple[Any, torch.Tensor]:
    qc = get_default_qat_qconfig()
    texts = (fake_quant_text(fake_quant_spec(qc.activation(), "a")), fake_quant_text(fake_quant_spec(qc.weight(), "w")))
    x = torch.randn(1, 3, 6, 6)
    g = trace(nn.Sequential(nn.Conv2d(3, 4, 3)), (x,))
    return passes.run_pipeline(g, InsertObservers(fake_quants=texts, qconfigs=(("0", 0, 1),))).graph, x


def test_prepare_builds_each_qat_conv_once() -> None:
    """Counted where every construction passes: the QAT part of the constructor (from_float builds
    the rest from a prototype without running torch's constructor)."""
    built: list[type] = []
    init = QATConvBase._init_qat

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(type(self))
        init(self, *args, **kwargs)

    QATConvBase._init_qat = counting  # type: ignore[method-assign]
    try:
        with march_scope("bayes"):
            qat = prepare_qat_fx(Net(), {"": get_default_qat_qconfig()}, torch.randn(1, 3, 6, 6))
    finally:
        QATConvBase._init_qat = init  # type: ignore[method-assign]
    assert qat.meta[PREPARE_PATH_KEY] == PREPARE_BY_PASS
    assert sorted(t.__name__ for t in built) == ["ConvReLU2d", "Linear"]


def test_the_first_emit_takes_the_module_and_a_second_builds_its_own() -> None:
    g, x = _observed()
    (node,) = [n for n in g.nodes if isinstance(n.op, QATConv)]
    box = node.meta[PREBUILT_MODULE_KEY]
    assert isinstance(box, PrebuiltModule)
    copy = g.copy()  # shares the box: only one of the models gets the module
    first, second = emit(g), emit(copy)
    assert first.get_submodule(node.scope or "") is not second.get_submodule(node.scope or "")
    assert box.take(node.op, {}) is None
    with torch.no_grad():
        assert torch.equal(first(x), second(x))
    assert list(first.state_dict()) == list(second.state_dict())
    assert all(
        torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    )


def test_another_op_or_another_tensor_builds_from_the_op() -> None:
    g, _ = _observed()
    (node,) = [n for n in g.nodes if isinstance(n.op, QATConv)]
    box = node.meta[PREBUILT_MODULE_KEY]
    module = box._module
    roles = node.op.param_roles()
    tensors = {r: g.constants[v.op.key] for r, v in zip(roles, node.op.module_params(node.operands), strict=True)}
    other_op = attrs.evolve(node.op, act="relu")
    assert box.take(other_op, tensors) is None
    assert box.take(node.op, {**tensors, "weight": tensors["weight"].clone()}) is None
    module.weight = nn.Parameter(tensors["weight"].clone())  # the module no longer holds the node's weight
    assert box.take(node.op, tensors) is None
    module.weight = tensors["weight"]
    assert box.take(node.op, tensors) is module
    assert box.take(node.op, tensors) is None  # taken once


def test_prepare_builds_each_bound_layer_once() -> None:
    """A RoIAlign / MultiScaleRoIAlign / AnchorGenerator call binds its form (box list, level count)
    after the rule read the op: emit still installs the module the rule built."""
    from qir.nn.qat.anchor_generator import AnchorGenerator
    from qir.nn.qat.multi_scale_roi_align import MultiScaleRoIAlign
    from qir.nn.qat.roi_align import RoIAlign
    from tests.quantization.path_op_nets import Anchors, RoIPool

    built: list[str] = []
    inits = {cls: cls.__init__ for cls in (RoIAlign, MultiScaleRoIAlign, AnchorGenerator)}

    def counting(cls: type) -> Any:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            built.append(cls.__name__)
            inits[cls](self, *args, **kwargs)

        return init

    for cls in inits:
        cls.__init__ = counting(cls)  # type: ignore[method-assign]
    try:
        with march_scope("bayes"):
            for net in (RoIPool, Anchors):
                qat = prepare_qat_fx(net(), {"": get_default_qat_qconfig()}, torch.randn(2, 3, 16, 16))
                assert qat.meta[PREPARE_PATH_KEY] == PREPARE_BY_PASS
    finally:
        for cls, init in inits.items():
            cls.__init__ = init  # type: ignore[method-assign]
    assert sorted(built) == ["AnchorGenerator", "AnchorGenerator", "MultiScaleRoIAlign", "RoIAlign", "RoIAlign"]
