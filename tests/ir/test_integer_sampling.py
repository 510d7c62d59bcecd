"""Integer ops for GridSample, RoIAlign, MultiScaleRoIAlign and AnchorGenerator.

A converted model's quantized sampling layers trace to ``qgrid_sample`` / ``qroi_align`` /
``qmulti_scale_roi_align`` / ``qanchor_generator`` instead of opaque module calls; run_graph and
emit compute exactly what the converted model does with the same state-dict keys; the text form
round-trips; bad fields and operands are refused naming the op; the legality reports equal those
of the same model traced with the modules kept opaque; the compiled program equals the model.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qir.frontend import trace
from qir.ir import IRError, print_graph
from qir.ir.ops.integer import IntegerModuleOp
from qir.ir.ops.integer_sampling import QAnchorGenerator, QGridSample, QMultiScaleRoIAlign, QRoIAlign
from qir.ir.types import DType, QuantSpec, TensorType
from qir.march import march_scope
from qir.nn import AnchorGenerator, MultiScaleRoIAlign, RoIAlign
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
)
from tests.ir.integer_family import assert_check_model_unchanged, assert_round_trips, assert_runs_and_emits_as, same

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")

OPS = {
    "_generated_grid_sample_0": "qgrid_sample",
    "_generated_grid_sample_1": "qgrid_sample",
    "roi": "qroi_align",
    "roi_t": "qroi_align",
    "msr": "qmulti_scale_roi_align",
    "anchor": "qanchor_generator",
}
FAMILY = (QGridSample, QRoIAlign, QMultiScaleRoIAlign, QAnchorGenerator)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.grid_quant = QuantStub(), QuantStub()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.roi = RoIAlign((2, 3), 0.5, 2, True)
        self.roi_t = RoIAlign(2, 0.25, -1, False)
        self.msr = MultiScaleRoIAlign(["p2", "p3"], 2, -1, canonical_scale=32)
        self.anchor = AnchorGenerator(((16, 32), (64,)), ((0.5, 1.0), (1.0, 2.0)))
        self.dequant = DeQuantStub()

    def forward(
        self, x: torch.Tensor, grid: torch.Tensor, b0: torch.Tensor, b1: torch.Tensor, rois: torch.Tensor
    ) -> tuple[object, ...]:
        f1 = self.c1(self.quant(x))
        f2 = self.c2(f1)
        g = self.grid_quant(grid)
        s1 = F.grid_sample(f1, g, mode="bilinear", padding_mode="border", align_corners=False)
        s2 = F.grid_sample(f1, g, mode="nearest", padding_mode="zeros", align_corners=True)
        r = self.roi(f1, [b0, b1])
        rt = self.roi_t(f2, rois)
        m = self.msr({"p2": f1, "p3": f2}, [b0, b1], [(32, 40), (32, 40)])
        anchors = self.anchor(x, [f1, f2])
        return self.dequant(s1), self.dequant(s2), self.dequant(r), self.dequant(rt), self.dequant(m), anchors[1]


def _boxes(gen: torch.Generator, k: int) -> torch.Tensor:
    xy = torch.rand(k, 2, generator=gen) * torch.tensor([28.0, 22.0])
    wh = 2.0 + torch.rand(k, 2, generator=gen) * 12.0
    return torch.cat([xy, xy + wh], dim=1)


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 16, 20, generator=gen)
    grid = torch.rand(2, 5, 6, 2, generator=gen) * 2.4 - 1.2
    b0, b1 = _boxes(gen, 4), _boxes(gen, 3)
    return x, grid, b0, b1, torch.cat([torch.tensor([[0.0], [1.0], [1.0], [0.0]]), b0], dim=1)


def _converted(march: str) -> nn.Module:
    torch.manual_seed(0)
    qc = get_default_qat_qconfig()
    with march_scope(march):
        qat = prepare_qat_fx(Net(), {"": qc})
        for i in range(2):
            qat(*_inputs(i))
        return convert_fx(qat.eval())


@pytest.fixture(scope="module", params=["bayes", "bernoulli2"])
def converted(request: pytest.FixtureRequest) -> nn.Module:
    return _converted(request.param)


def test_layers_trace_to_integer_ops_that_run_exactly(converted: nn.Module) -> None:
    x = _inputs(5)
    g = trace(converted, x)
    by_scope = {n.scope: n for n in g.nodes if n.scope}
    assert {s: by_scope[s].op.name for s in OPS} == OPS
    assert not [n for n in g.nodes if n.op.name == "call"]
    for s in OPS:
        assert isinstance(by_scope[s].op, IntegerModuleOp)
    for s in ("_generated_grid_sample_0", "roi", "msr"):
        n = by_scope[s]
        assert n.type.quant == n.op.out and n.type.dtype is n.op.out.dtype
    assert by_scope["roi"].op.box_list and by_scope["roi"].op.num_boxes == 2 and not by_scope["roi_t"].op.box_list
    assert by_scope["msr"].op.feature_names == ("p2", "p3")
    assert by_scope["msr"].op.image_shapes == ((32, 40), (32, 40))
    assert by_scope["_generated_grid_sample_1"].op.out.scale == by_scope["_generated_grid_sample_1"].op.in_scales[:1]
    assert_runs_and_emits_as(g, converted, _inputs, x)


def test_text_form_round_trips(converted: nn.Module) -> None:
    x = _inputs(1)
    g = trace(converted, x)
    text = print_graph(g)
    assert "image_shapes=((32, 40), (32, 40))" in text and "sizes=((16, 32), (64,))" in text
    assert_round_trips(g, converted, x)


def test_compiled_program_equals_the_converted_model(converted: nn.Module) -> None:
    # Bernoulli2 has no grid sample in its tables; check=False compiles what its kernels can run
    compiled = compile_model(converted, list(_inputs(0)), opt=1, check=False)
    ops = {i.op for i in compiled.program.instructions}
    assert {"grid_sample", "roi_align", "roi_levels", "multi_scale_roi_align", "anchors"} <= ops
    with torch.no_grad():
        for seed in (7, 8):
            assert same(compiled(*_inputs(seed)), converted(*_inputs(seed)))


def test_verify_names_the_op_and_the_fault() -> None:
    out = QuantSpec((0.1,), DType.qint8)
    x = TensorType((2, 4, 8, 8), DType.qint8)
    grid = TensorType((2, 3, 3, 2), DType.qint16)
    gs = QGridSample(mode="bilinear", padding_mode="zeros", align_corners=False, out=out, in_scales=(0.1, 0.01))
    gs.verify_([x, grid])
    with pytest.raises(IRError, match="qgrid_sample: mode must be one of"):
        attrs.evolve(gs, mode="bicubic")
    with pytest.raises(IRError, match="qgrid_sample: padding_mode must be one of"):
        attrs.evolve(gs, padding_mode="reflection")
    with pytest.raises(IRError, match=r"qgrid_sample.*shift must be an integer in \[0, 32\]"):
        attrs.evolve(gs, shift=40)
    with pytest.raises(IRError, match="the grid must be qint8 / qint16 codes"):
        gs.verify_([x, TensorType((2, 3, 3, 2), DType.float32)])
    with pytest.raises(IRError, match=r"grid must be \(N=2, Ho, Wo, 2\)"):
        gs.verify_([x, TensorType((1, 3, 3, 2), DType.qint8)])
    with pytest.raises(IRError, match="nearest copies codes"):
        attrs.evolve(gs, mode="nearest", out=QuantSpec((0.2,), DType.qint8))
    with pytest.raises(IRError, match="bilinear requantizes to qint8 / qint16"):
        attrs.evolve(gs, out=QuantSpec((0.1,), DType.qint32)).verify_([x, grid])
    roi = QRoIAlign(out=out, in_scales=(0.1,), output_size=(2, 2), box_list=True, num_boxes=2)
    box4 = TensorType((3, 4), DType.float32)
    roi.verify_([x, box4, box4])
    with pytest.raises(IRError, match=r"boxes must be float \(K, 4\) tensors"):
        roi.verify_([x, box4, TensorType((3, 5), DType.float32)])
    with pytest.raises(IRError, match="takes 3 operands"):
        roi.verify_([x, box4])
    with pytest.raises(IRError, match=r"boxes as one .* is one operand"):
        attrs.evolve(roi, box_list=False)
    with pytest.raises(IRError, match="spatial_scale must be positive and finite"):
        attrs.evolve(roi, spatial_scale=float("nan"))
    with pytest.raises(IRError, match=r"qroi_align.*output_size must be two integers"):
        attrs.evolve(roi, output_size=(0, 2))
    with pytest.raises(IRError, match="the output is per-tensor qint8 / qint16"):
        attrs.evolve(roi, out=QuantSpec((0.1,), DType.qint32))
    msr = QMultiScaleRoIAlign(
        out=out,
        in_scales=(0.1, 0.2),
        feature_names=("p2", "p3"),
        featmap_names=("p2",),
        multipliers=(3, 4),
        shifts=(5, 6),
        image_shapes=((32, 32),),
    )
    msr.verify_([x, x, box4])
    with pytest.raises(IRError, match="one input scale, multiplier and shift per feature"):
        attrs.evolve(msr, shifts=(5,))
    with pytest.raises(IRError, match="image_shapes must list positive"):
        attrs.evolve(msr, image_shapes=())
    with pytest.raises(IRError, match="none of featmap_names"):
        attrs.evolve(msr, featmap_names=("p5",)).verify_([x, x, box4])
    with pytest.raises(IRError, match="takes integer codes"):
        msr.verify_([x, TensorType((2, 4, 4, 4), DType.float32), box4])
    anc = QAnchorGenerator(sizes=((16,), (32,)), aspect_ratios=((1.0,), (0.5, 2.0)), num_features=2)
    types = [TensorType((2, 3, 16, 16), DType.float32), x, TensorType((2, 4, 4, 4), DType.qint8)]
    anc.verify_(types)
    assert anc.infer_type(types).elements[0] == TensorType((8 * 8 * 1 + 4 * 4 * 2, 4), DType.float32)
    with pytest.raises(IRError, match="one feature map per anchor level"):
        attrs.evolve(anc, num_features=1)
    with pytest.raises(IRError, match="sizes and aspect ratios must be positive"):
        attrs.evolve(anc, sizes=((16,), (-1,)))
    with pytest.raises(IRError, match=r"images must be an \(N, C, H, W\) tensor"):
        anc.verify_([TensorType((3, 16, 16), DType.float32), x, x])


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_check_model_reports_what_the_opaque_calls_reported(march: str) -> None:
    conv = _converted(march)
    x = _inputs(2)
    assert_check_model_unchanged(conv, x, march, FAMILY, expect=set(OPS.values()), gone=set(OPS.values()))
