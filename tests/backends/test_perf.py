"""perf_model: hand-computed MACs / bytes / parameters of single convs, totals, the files, fused
layers counted once, the roofline estimate, jit.trace input, and seed 002's final calls."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from pv_models import ConvBNReLU, Seed002Net, Stubbed, eager_converted
from torch import nn

import qir
from backends.common.roofline import ROOFLINES, get_roofline
from qir.march import march_scope
from qir.quantization import perf_model

pytestmark = [
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning"),
]


@pytest.mark.parametrize(
    ("cin", "cout", "k", "stride", "pad", "groups", "march"),
    [
        (3, 8, 3, 2, 1, 1, "bayes"),
        (4, 8, 3, 1, 0, 2, "bernoulli2"),
    ],
)
def test_single_conv_by_hand(
    tmp_path: Path, cin: int, cout: int, k: int, stride: int, pad: int, groups: int, march: str
) -> None:
    n, h, w = 2, 12, 10
    q = eager_converted(
        Stubbed(nn.Conv2d(cin, cout, k, stride=stride, padding=pad, groups=groups)), (n, cin, h, w), march
    )
    prof = perf_model(q, [torch.randn(n, cin, h, w)], out_dir=tmp_path, march=march)
    ho, wo = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    assert [la.kernels for la in prof.layers] == [["quantize"], ["conv2d"], ["dequantize"]]
    quant, conv, deq = prof.layers
    assert conv.macs == n * cout * ho * wo * cin * k * k // groups
    assert conv.module == "body.0" and conv.output_shape == [n, cout, ho, wo] and conv.output_dtype == "qint8"
    weight, bias = cout * (cin // groups) * k * k, 4 * cout  # int8 weights, int32 bias
    assert conv.param_bytes == weight + bias
    assert (conv.input_bytes, conv.output_bytes) == (n * cin * h * w, n * cout * ho * wo)
    assert (quant.input_bytes, quant.output_bytes, quant.macs) == (4 * n * cin * h * w, n * cin * h * w, 0)
    assert (deq.input_bytes, deq.output_bytes) == (n * cout * ho * wo, 4 * n * cout * ho * wo)
    r = get_roofline(march)
    expect = max(conv.macs / r.peak_int8_macs_per_s, conv.bytes_moved / r.dram_bytes_per_s)
    assert conv.est_time_s == pytest.approx(expect)
    assert prof.param_bytes == weight + bias and prof.batch == n


def test_totals_add_up_and_files(tmp_path: Path) -> None:
    q = eager_converted(
        Stubbed(ConvBNReLU(3, 8, 3), nn.MaxPool2d(2), nn.Conv2d(8, 4, 1)),
        (1, 3, 16, 16),
        "bayes",
        fuse=[["body.0.0", "body.0.1", "body.0.2"]],
    )
    out = tmp_path / "perf"
    prof = perf_model(q, [torch.randn(1, 3, 16, 16)], out_dir=out, opt=1, layer_details=True)
    assert prof.total_macs == sum(la.macs for la in prof.layers) > 0
    assert prof.bytes_moved == sum(la.bytes_moved for la in prof.layers)
    assert prof.est_time_s == pytest.approx(sum(la.est_time_s for la in prof.layers))
    assert prof.est_fps == pytest.approx(1 / prof.est_time_s)
    assert prof.gops == pytest.approx(2 * prof.total_macs / 1e9)
    assert prof.param_bytes == sum(la.param_bytes for la in prof.layers)  # nothing shared here
    data = json.loads((out / "perf.json").read_text())
    assert data["totals"]["macs"] == prof.total_macs and len(data["layers"]) == len(prof.layers)
    assert data["opt"] == 1 and data["input_source"] == ["ddr"] and "ESTIMATE" in data["note"]
    assert data["roofline"]["sources"] == list(ROOFLINES["bayes"].sources)
    text = (out / "perf.txt").read_text()
    assert "ESTIMATE" in text and "layers (estimated times)" in text and "body.0.0" in text
    prof2 = perf_model(q, [torch.randn(1, 3, 16, 16)], out_dir=out, opt=1)
    assert "layers (estimated times)" not in (out / "perf.txt").read_text()
    assert prof2.total_macs == prof.total_macs


def test_fused_layers_counted_once(tmp_path: Path) -> None:
    q = eager_converted(
        Stubbed(ConvBNReLU(3, 8, 3)), (1, 3, 10, 10), "bayes", fuse=[["body.0.0", "body.0.1", "body.0.2"]]
    )
    prof = perf_model(q, [torch.randn(1, 3, 10, 10)], out_dir=tmp_path)
    convs = [la for la in prof.layers if "conv2d" in la.kernels]
    assert len(convs) == 1 and convs[0].kernels == ["conv2d"]
    assert convs[0].macs == prof.total_macs == 8 * 8 * 8 * 3 * 9
    assert len(prof.layers) == 3  # quant, the fused conv-bn-relu, dequant: the Identity leftovers add nothing


def test_input_source_and_trace(tmp_path: Path) -> None:
    q = eager_converted(Stubbed(nn.Conv2d(1, 4, 3)), (1, 1, 8, 8), "bayes")
    x = torch.randn(1, 1, 8, 8)
    before = {k: v.clone() for k, v in q.state_dict().items()}
    ddr = perf_model(q, [x], out_dir=tmp_path / "a")
    pyr = perf_model(torch.jit.trace(q, x), [x], out_dir=tmp_path / "b", input_source=["pyramid"])
    assert ddr.layers[0].input_bytes == 4 * 64 and pyr.layers[0].input_bytes == 64
    assert pyr.input_source == ["pyramid"] and pyr.total_macs == ddr.total_macs
    assert all(torch.equal(before[k], v) for k, v in q.state_dict().items())
    with pytest.raises(ValueError, match="input_source"):
        perf_model(q, [x], out_dir=tmp_path / "c", input_source=["camera"])


def test_int8_macs_unweighted() -> None:
    from backends.common.perf import profile_program, value_infos
    from qir.quantization.perf import lower_for_analysis

    q = eager_converted(Stubbed(nn.Conv2d(1, 4, 3)), (1, 1, 8, 8), "bayes")
    low = lower_for_analysis(q, [torch.randn(1, 1, 8, 8)], opt=1)
    r = get_roofline("bayes")
    prof = profile_program(low.program, value_infos(low.program, list(low.inputs)), r)
    conv = prof.layers[1]
    assert conv.weighted_macs == conv.macs > 0  # int8 activations and weights: one slot per MAC


def test_unknown_march_roofline() -> None:
    with pytest.raises(ValueError, match="no roofline parameters for march 'x9'"):
        get_roofline("x9")


def test_seed_002_final_calls(tmp_path: Path) -> None:
    """Seed 002's eager flow (short calibration instead of MNIST training), then its last four calls."""
    horizon = qir
    with march_scope("bayes"):
        qat_model = Seed002Net()
        qat_model.fuse_model()
        qat_model.qconfig = horizon.quantization.get_default_qat_qconfig()
        qat_model.classifier.qconfig = horizon.quantization.get_default_qat_out_qconfig()
        horizon.quantization.prepare_qat(qat_model, inplace=True)
        with torch.no_grad():
            for _ in range(2):
                qat_model(torch.rand(16, 1, 28, 28) * 2 - 1)
        quantized_model = horizon.quantization.convert(qat_model.eval(), inplace=False)
        example_input = torch.ones(size=(1, 1, 28, 28))
        traced_model = torch.jit.trace(quantized_model, example_input)
        horizon.quantization.check_model(quantized_model, example_input, advice=1)
        hbdk_dir = str(tmp_path / "hbdk_model")
        if not os.path.exists(hbdk_dir):
            os.mkdir(hbdk_dir)
        horizon.quantization.compile_model(traced_model, [example_input], opt=2, hbm=hbdk_dir + "/model.hbm")
        horizon.quantization.perf_model(
            traced_model, [example_input], opt=2, input_source=["pyramid"], layer_details=True, out_dir=hbdk_dir
        )
        horizon.quantization.visualize_model(
            traced_model, [example_input], save_path=hbdk_dir + "/model.svg", show=False
        )
    files = {p.name for p in Path(hbdk_dir).iterdir()}
    assert {"model.hbm", "perf.json", "perf.txt", "model.svg"} <= files
    data = json.loads((Path(hbdk_dir) / "perf.json").read_text())
    assert [la["module"] for la in data["layers"]] == [
        "quant",
        "conv0.0",
        "max_pool",
        "conv1.0",
        "avg_pool",
        "classifier",
        "dequant",
    ]
    # conv0 24x24x10 outputs of 25 MACs, conv1 8x8x20 of 250, classifier 10 of 20
    assert data["totals"]["macs"] == 24 * 24 * 10 * 25 + 8 * 8 * 20 * 250 + 10 * 20
    assert data["input_source"] == ["pyramid"] and data["layers"][0]["input_bytes"] == 28 * 28
    assert data["totals"]["param_bytes"] == 5610  # int8 weights + int32 biases: 290 + 5080 + 240 (docs quote it)
    assert {la["bound"] for la in data["layers"]} == {"memory"}
    svg = (Path(hbdk_dir) / "model.svg").read_text()
    assert svg.count('class="fused') == 2


def test_docs_state_the_roofline_numbers() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "perf-and-visualize.md").read_text()
    for r in ROOFLINES.values():
        row = next(line for line in doc.splitlines() if line.startswith(f"| {r.march} |"))
        cells = [c.strip() for c in row.split("|")]
        assert (float(cells[3]), float(cells[4])) == (r.peak_int8_macs_per_s, r.dram_bytes_per_s), row


class _ScoresTopk(nn.Module):
    """A quantized conv, then a float tail after the DeQuantStub: sigmoid scores and a top-5 per image."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Stubbed(nn.Conv2d(3, 4, 3, padding=1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.net(x)).flatten(1)
        return scores.topk(5, dim=1)


def test_float_steps_are_cpu_work_estimated_apart(tmp_path: Path) -> None:
    q = eager_converted(_ScoresTopk(), (2, 3, 8, 8), "bernoulli2")
    prof = perf_model(q, [torch.rand(2, 3, 8, 8)], out_dir=tmp_path, march="bernoulli2", layer_details=True)
    units = {la.name: la.unit for la in prof.layers}
    assert [units[k] for k in ("net_quant", "net_body_0", "net_dequant")] == ["BPU"] * 3
    sig, flat, topk = (next(la for la in prof.layers if la.name == k) for k in ("sigmoid", "flatten", "topk"))
    assert (sig.unit, flat.unit, topk.unit) == ("CPU", "CPU", "CPU")
    r = get_roofline("bernoulli2")
    n = 2 * 4 * 8 * 8
    # sigmoid: one op an element, float32 in and out; the flatten is a view (nothing); topk sorts rows of 256
    assert (sig.float_ops, sig.input_bytes, sig.output_bytes) == (n, 4 * n, 4 * n)
    assert sig.est_time_s == pytest.approx(max(n / r.cpu_float_ops_per_s, 8 * n / r.dram_bytes_per_s))
    assert (flat.float_ops, flat.est_time_s) == (0, 0.0)
    assert topk.float_ops == n * 8 and topk.est_time_s == pytest.approx(n * 8 / r.cpu_float_ops_per_s)
    conv = next(la for la in prof.layers if la.name == "net_body_0")
    assert conv.float_ops == 0 and conv.est_time_s == pytest.approx(
        max(conv.macs / r.peak_int8_macs_per_s, conv.bytes_moved / r.dram_bytes_per_s)
    )
    assert prof.est_cpu_time_s == pytest.approx(sum(la.est_time_s for la in prof.layers if la.unit == "CPU"))
    assert prof.est_bpu_time_s + prof.est_cpu_time_s == pytest.approx(prof.est_time_s) and prof.est_cpu_time_s > 0
    data = json.loads((tmp_path / "perf.json").read_text())
    assert data["totals"]["est_cpu_time_s"] == pytest.approx(prof.est_cpu_time_s)
    assert data["roofline"]["cpu_float_ops_per_s"] == r.cpu_float_ops_per_s
    text = (tmp_path / "perf.txt").read_text()
    assert f"CPU float part {prof.est_cpu_time_s * 1e3:.4f} ms" in text and "one Cortex-A53 core" in text


def test_docs_state_the_cpu_numbers() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "perf-and-visualize.md").read_text()
    for r in ROOFLINES.values():
        row = next(line for line in doc.splitlines() if line.startswith(f"| {r.march} CPU |"))
        cells = [c.strip() for c in row.split("|")]
        assert (cells[2], float(cells[3])) == (r.cpu_device, r.cpu_float_ops_per_s), row


class _CpuConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(3, 8, 3, padding=1)
        self.cpu_conv = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.conv1 = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv1(self.cpu_conv(self.conv0(x)))


def test_a_hybrid_models_float_conv_is_cpu_work_counted_by_its_macs(tmp_path: Path) -> None:
    from qir.quantization import convert_fx, get_default_qat_qconfig, prepare_qat_fx, set_fake_quantize

    with march_scope("bayes"):
        qat = prepare_qat_fx(
            _CpuConv(), {"": get_default_qat_qconfig()}, hybrid=True, hybrid_dict={"module_name": ["cpu_conv"]}
        )
        qat(torch.rand(2, 3, 8, 8))
        qat.eval()
        set_fake_quantize(qat, "validation")
        prof = perf_model(convert_fx(qat), [torch.rand(2, 3, 8, 8)], out_dir=tmp_path)
    conv = next(la for la in prof.layers if la.name == "cpu_conv")
    macs = 2 * 8 * 8 * 8 * (8 // 2) * 3 * 3  # output elements x weight elements per output channel
    assert (conv.unit, conv.kernels, conv.macs, conv.float_ops) == (
        "CPU",
        ["constant", "constant", "float_fn"],
        macs,
        2 * macs,
    )
    r = get_roofline("bayes")
    assert conv.est_time_s == pytest.approx(
        max(2 * macs / r.cpu_float_ops_per_s, conv.bytes_moved / r.dram_bytes_per_s)
    )
    assert {la.unit for la in prof.layers if la.name in ("conv0", "conv1")} == {"BPU"}
    assert conv.param_bytes == 4 * (8 * 4 * 3 * 3 + 8)  # float32 weights and bias, program constants
