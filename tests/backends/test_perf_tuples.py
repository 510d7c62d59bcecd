"""perf_model counts every tensor of a tuple output (an LSTM cell's (h, c), split's pieces, topk's
values and indices) once, where the tuple is made; picking an item moves nothing."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from backends.common.perf import ValueInfo
from backends.common.visualize import format_value
from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_qat_qconfig,
    perf_model,
    prepare_qat_fx,
    set_fake_quantize,
)

N, IN, HID, K = 4, 6, 8, 3


class _Tuples(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = QuantStub()
        self.cell = nn.LSTMCell(IN, HID)
        self.d, self.d2 = DeQuantStub(), DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, c = self.cell(self.q(x))
        a, b = torch.split(h, HID // 2, dim=1)
        v, i = c.topk(K, dim=1)
        return self.d(a + b), self.d2(v), i


def test_tuple_outputs_count_every_tensor(tmp_path: Path) -> None:
    with march_scope("bayes"):
        p = prepare_qat_fx(_Tuples(), {"": get_default_qat_qconfig()})
        p(torch.randn(N, IN))
        p.eval()
        set_fake_quantize(p, "validation")
        prof = perf_model(convert_fx(p), [torch.randn(N, IN)], out_dir=tmp_path, layer_details=True)
    la = {x.name: x for x in prof.layers}
    width = {"qint8": 1, "qint16": 2, "int64": 8}
    h_bytes = N * HID * width[la["getitem"].output_dtype]
    c_bytes = N * HID * width[la["getitem_1"].output_dtype]
    assert la["cell"].output_bytes == h_bytes + c_bytes  # (h, c): both read by later layers
    split = la["split"]
    assert (split.input_bytes, split.output_bytes) == (h_bytes, h_bytes)  # both pieces
    assert split.output_shapes == [[N, HID // 2]] * 2 and split.output_shape is None
    topk = la["topk"]
    v_width = width[topk.output_dtype.split(",")[0]]
    assert topk.output_dtype.endswith(",int64")
    assert (topk.input_bytes, topk.output_bytes) == (c_bytes, N * K * v_width + N * K * 8)  # values + indices
    # picking an item of a tuple is counted where the tuple is made, not again
    for name in ("getitem", "getitem_1", "getitem_2", "getitem_3", "getitem_4", "getitem_5"):
        assert la[name].bytes_moved == 0, name
    assert la["add"].input_bytes == h_bytes  # its two halves, read from split's output
    data = json.loads((tmp_path / "perf.json").read_text())
    row = next(r for r in data["layers"] if r["name"] == "topk")
    assert row["output_shapes"] == [[N, K], [N, K]] and row["output_bytes"] == topk.output_bytes
    assert f"{N}x{K},{N}x{K}" in (tmp_path / "perf.txt").read_text()


def test_tuple_value_label() -> None:
    info = ValueInfo((), "tuple", 16 + 96, (ValueInfo((4, 4), "qint8", 16), ValueInfo((4, 3), "int64", 96)))
    assert [t.dtype for t in info.leaves()] == ["qint8", "int64"]
    assert format_value(info, 0.5) == "tuple(qint8 4x4 scale 0.5, int64 4x3)"


def test_float_topk_output_counted(tmp_path: Path) -> None:
    from pv_models import Stubbed, eager_converted

    class _ScoresTopk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Stubbed(nn.Conv2d(3, 4, 3, padding=1))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.sigmoid(self.net(x)).flatten(1).topk(5, dim=1)

    q = eager_converted(_ScoresTopk(), (2, 3, 8, 8), "bernoulli2")
    prof = perf_model(q, [torch.rand(2, 3, 8, 8)], out_dir=tmp_path, march="bernoulli2")
    topk = next(la for la in prof.layers if la.name == "topk")
    assert topk.unit == "CPU" and topk.output_bytes == 2 * 5 * 4 + 2 * 5 * 8  # float32 values, int64 indices
