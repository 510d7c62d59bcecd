"""torchvision classification models: module -> IR -> text -> IR -> GraphModule, outputs and
state-dict keys unchanged.

Runs only when selected: ``python -m pytest -m torchvision tests/real_models -q``.
``QIR_TV_ALL=1`` adds every other classification model torchvision lists; the results
table is written to ``$QIR_TV_REPORT`` (default: ``torchvision_roundtrip.md`` in the
pytest temporary base directory) and printed with ``-s``.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from qir.frontend import emit, trace
from qir.ir import verify

pytestmark = pytest.mark.torchvision

REQUIRED = [
    "resnet18",
    "resnet50",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "mobilenet_v3_large",
    "efficientnet_b0",
    "regnet_y_400mf",
    "shufflenet_v2_x1_0",
    "squeezenet1_0",
    "vgg11",
    "densenet121",
    "vit_b_16",
    "swin_t",
]


def _all_models() -> list[str]:
    try:
        tv = importlib.import_module("torchvision")
    except ImportError:
        return []
    return [m for m in tv.models.list_models(module=tv.models) if m not in REQUIRED]


MODELS = REQUIRED + (_all_models() if os.environ.get("QIR_TV_ALL") == "1" else [])
ROWS: list[dict[str, Any]] = []


@pytest.fixture(autouse=True)
def _only_when_selected(request: pytest.FixtureRequest) -> None:
    if "torchvision" not in (request.config.getoption("markexpr", "") or ""):
        pytest.skip("real-model test: select it with -m torchvision")


@pytest.fixture(scope="module", autouse=True)
def _report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    yield
    if not ROWS:
        return
    lines = [
        "| model | nodes | opaque | opaque targets | max abs diff | keys equal | text | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        targets = ", ".join(f"{t} x{c}" for t, c in r["opaque"].items()) or "-"
        lines.append(
            f"| {r['model']} | {r['nodes']} | {sum(r['opaque'].values())} | {targets} | "
            f"{r['diff']:.2e} | {r['keys']} | {r['text']} | {r['seconds']:.1f} |"
        )
    table = "\n".join(lines) + "\n"
    path = Path(os.environ.get("QIR_TV_REPORT") or tmp_path_factory.getbasetemp() / "torchvision_roundtrip.md")
    path.write_text(table)
    print(f"\n{table}(written to {path})")


def _text_round_trip(graph: Any) -> tuple[Any, str]:
    try:
        printer = importlib.import_module("qir.ir.printer")
        parser = importlib.import_module("qir.ir.parser")
    except ImportError:  # the text form is optional for this test
        return graph, "no"
    text = printer.print_graph(graph)
    return parser.parse_graph(text, constants=graph.constants, objects=graph.objects), "yes"


@pytest.mark.parametrize("name", MODELS)
def test_torchvision_roundtrip(name: str) -> None:
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    start = time.perf_counter()
    model = tv.models.get_model(name, weights=None).eval()
    x = torch.randn(2, 3, 224, 224)
    graph = trace(model, (x,))
    verify(graph)
    graph2, text = _text_round_trip(graph)
    gm = emit(graph2)
    with torch.no_grad():
        expected, got = model(x), gm(x)
    diff = (got - expected).abs().max().item()
    keys_equal = list(gm.state_dict()) == list(model.state_dict())
    opaque: dict[str, int] = {}
    for n in graph.nodes:
        if n.op.name == "call":
            target = n.op.target  # type: ignore[attr-defined]
            opaque[target] = opaque.get(target, 0) + 1
    ROWS.append(
        {
            "model": name,
            "nodes": len(graph),
            "opaque": opaque,
            "diff": diff,
            "keys": keys_equal,
            "text": text,
            "seconds": time.perf_counter() - start,
        }
    )
    assert keys_equal
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
