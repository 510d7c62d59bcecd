"""visualize_model: well-formed SVG of the lowered Program, one group per fused layer, illegal
layers marked with the rule, edge labels with dtype / shape / scale, jit.trace input, ``show``."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from pv_models import ConvBNReLU, Seed002Net, Stubbed, eager_converted
from torch import nn
from torch.ao.quantization import DeQuantStub

from backends.common.perf import ValueInfo
from backends.common.visualize import RED, format_value
from qir.quantization import QuantStub, visualize_model

pytestmark = [
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning"),
]
SVG = "{http://www.w3.org/2000/svg}"


def _groups(root: ET.Element, cls: str) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if cls in (g.get("class") or "").split()]


def _texts(root: ET.Element, cls: str) -> list[str]:
    return [t.text or "" for t in root.iter(f"{SVG}text") if t.get("class") == cls]


def _boxes_overlap(root: ET.Element) -> bool:
    rects = []
    for g in root.iter(f"{SVG}g"):
        if {"kernel", "fused", "io"} & set((g.get("class") or "").split()):
            r = g.find(f"{SVG}rect")
            assert r is not None
            rects.append(tuple(float(r.get(k, "0")) for k in ("x", "y", "width", "height")))
    for i, (x, y, w, h) in enumerate(rects):
        for x2, y2, w2, h2 in rects[i + 1 :]:
            if x < x2 + w2 and x2 < x + w and y < y2 + h2 and y2 < y + h:
                return True
    return False


def test_seed_model_svg(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = Seed002Net()
    model.fuse_model()
    q = eager_converted(model, (4, 1, 28, 28), "bayes", out_qconfig="classifier")
    x = torch.ones(1, 1, 28, 28)
    path = visualize_model(torch.jit.trace(q, x), [x], save_path=tmp_path / "sub" / "model.svg", show=True)
    assert capsys.readouterr().out.strip() == f"visualize_model: wrote {path}"
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    fused = _groups(root, "fused")
    assert len(fused) == 2  # conv0 and conv1 (conv + bn + relu), each one group holding its parts
    for g in fused:
        parts = [t.text for p in _groups(g, "part") for t in p.iter(f"{SVG}text")]
        assert parts == ["conv2d", "relu"]
    assert len(_groups(root, "kernel")) + len(fused) == 7  # every kernel call is one box
    sources = " ".join(t.text or "" for t in root.iter(f"{SVG}text") if t.get("class") == "source")
    assert all(m in sources for m in ("quant", "conv0.0", "max_pool", "conv1.0", "avg_pool", "classifier"))
    labels = _texts(root, "edge-label")
    assert "qint8 1x1x28x28 scale 0.0078125" in labels  # the QuantStub's fixed 1/128
    assert any(lab.startswith("qint32 1x10x1x1 scale per-channel(10)") for lab in labels)  # high-precision output
    assert "float32 1x10x1x1" in labels
    assert all(("scale" in lab) == lab.startswith("qint") for lab in labels)
    assert len(_groups(root, "edge")) == 8 and not _groups(root, "illegal")
    assert not _boxes_overlap(root)


def test_illegal_layer_marked(tmp_path: Path) -> None:
    q = eager_converted(Stubbed(nn.Conv2d(3, 4, 3), nn.Flatten(1), nn.Linear(4 * 6 * 6, 5)), (2, 3, 8, 8), "bernoulli2")
    path = visualize_model(q, [torch.randn(1, 3, 8, 8)], save_path=tmp_path / "m.svg", march="bernoulli2")
    root = ET.parse(path).getroot()
    bad = _groups(root, "illegal")
    assert len(bad) == 1
    rect = bad[0].find(f"{SVG}rect")
    title = bad[0].find(f"{SVG}title")
    assert rect is not None and rect.get("stroke") == RED
    assert title is not None and "NOT LEGAL on bernoulli2" in (title.text or "") and "Linear" in (title.text or "")
    assert "body.2" in " ".join(t.text or "" for t in bad[0].iter(f"{SVG}text"))
    assert any((t.text or "").startswith("not legal:") for t in bad[0].iter(f"{SVG}text"))


def test_legal_on_bayes_and_module_untouched(tmp_path: Path) -> None:
    q = eager_converted(
        Stubbed(ConvBNReLU(3, 4, 3), nn.MaxPool2d(2)),
        (1, 3, 10, 10),
        "bayes",
        fuse=[["body.0.0", "body.0.1", "body.0.2"]],
    )
    before = {k: v.clone() for k, v in q.state_dict().items()}
    path = visualize_model(q, [torch.randn(1, 3, 10, 10)], save_path=tmp_path / "m.svg", march="bayes")
    text = path.read_text()
    assert "every layer passes check_model on bayes" in text
    assert all(torch.equal(before[k], v) for k, v in q.state_dict().items())


def test_value_labels() -> None:
    info = ValueInfo((1, 8, 4, 4), "qint8", 128)
    assert format_value(info, None) == "qint8 1x8x4x4 scale ?"
    assert format_value(info, 0.5) == "qint8 1x8x4x4 scale 0.5"
    assert format_value(info, [0.5, 0.25]) == "qint8 1x8x4x4 scale per-channel(2)"
    assert format_value(ValueInfo((2,), "float32", 8), None) == "float32 2"
    assert format_value(None, None) == "python value"


def test_fx_residual_group(tmp_path: Path) -> None:
    from bitexact_models import chain, fx_converted

    q = fx_converted(chain([("convbnrelu", 4, 3, 1), ("residual", 4, 3, 1)], 3, "conv"), (2, 3, 8, 8), "bayes")
    path = visualize_model(q, [torch.randn(1, 3, 8, 8)], save_path=tmp_path / "r.svg")
    root = ET.parse(path).getroot()
    groups = {
        tuple(t.text for p in _groups(g, "part") for t in p.iter(f"{SVG}text")): g for g in _groups(root, "fused")
    }
    assert ("conv2d", "add", "relu") in groups
    title = groups[("conv2d", "add", "relu")].find(f"{SVG}title")
    assert title is not None and "fused from" in (title.text or "") and "bn" in (title.text or "")
    assert not _boxes_overlap(root)


class _SizeHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.quant(x))
        return self.dequant(y.reshape(y.size(0), -1))


def test_shape_arithmetic_folded(tmp_path: Path) -> None:
    from bitexact_models import fx_converted

    q = fx_converted(_SizeHead(), (2, 3, 8, 8), "bayes")
    x = torch.randn(1, 3, 8, 8)
    root = ET.parse(visualize_model(q, [x], save_path=tmp_path / "a.svg")).getroot()
    names = _texts(root, "kernel-name")
    assert "size" not in names and "reshape" in names
    assert "1 shape-arithmetic call(s) (size, indexing a shape, int math) not drawn" in _texts(root, "header")
    assert "qint8 1x144 scale" in " ".join(_texts(root, "edge-label"))  # reshape keeps the conv's scale
    full = ET.parse(visualize_model(q, [x], save_path=tmp_path / "b.svg", shape_ops=True)).getroot()
    assert "size" in _texts(full, "kernel-name")
