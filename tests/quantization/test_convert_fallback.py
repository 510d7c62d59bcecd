"""convert_fx falling back from the ``quantize`` pass to module swapping is visible: the result's
``meta["qir.convert_path"]`` says why, and a ``pipeline=`` the user gave that could not run as given
gets a warning (a test comparing outputs alone cannot tell which path ran). Which graph the pipeline
edits in place: qir's own passes run on the call's traced graph, a user's pass on a guarded copy."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import passes
import passes.manager
from qir.nn.quantized import QUANTIZED_MODULE_MAP
from qir.quantization import DeQuantStub, QuantStub, convert_fx, get_default_qat_qconfig
from qir.quantization.convert import CONVERT_PATH_KEY
from tests.quantization.test_convert_paths import _qat


class Table16(nn.Module):  # a qint16 input to softmax's qint8 exp table: the quantize pass refuses it
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv, self.sm = nn.Conv2d(3, 4, 1), nn.Softmax(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.sm(self.conv(self.quant(x))))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv, self.relu = nn.Conv2d(3, 4, 3), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.relu(self.conv(self.quant(x))))


def _refused() -> nn.Module:
    qconfig = {"": get_default_qat_qconfig(), "module_name": {"conv": get_default_qat_qconfig(dtype="qint16")}}
    return _qat(Table16(), "bayes", qconfig)[0]


def _convert_path_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "converts by module swapping" in str(w.message)]


def test_a_users_pipeline_the_quantize_pass_refuses_warns_why() -> None:
    qat = _refused()
    with pytest.warns(UserWarning, match="converts by module swapping") as record:
        out = convert_fx(qat, pipeline="quantize{march=bayes}")
    why = out.meta[CONVERT_PATH_KEY]
    assert why.startswith("module swap: the quantize pass refused the model: ")
    (message,) = _convert_path_warnings(list(record))
    assert "pipeline='quantize{march=bayes}'" in message
    assert why.removeprefix("module swap: ") in message  # the same reason as meta's
    assert "instead" not in message  # no pass of the pipeline besides quantize


def test_a_users_passes_that_run_on_the_integer_model_instead_are_named() -> None:
    qat, x = _qat(Plain(), "bayes")
    with pytest.warns(UserWarning, match="a custom mapping= is honoured by module swapping only") as record:
        out = convert_fx(qat, mapping=dict(QUANTIZED_MODULE_MAP), pipeline="dce")
    assert out.meta[CONVERT_PATH_KEY].startswith("module swap: a custom mapping=")
    (message,) = _convert_path_warnings(list(record))
    assert "pipeline='dce,quantize{march=bayes}'" in message
    assert "dce runs on the integer model's IR instead" in message
    assert torch.equal(out(x), convert_fx(qat)(x))


@pytest.mark.parametrize("pipeline", [None, "dce"])
def test_no_warning_when_the_pass_converts_or_no_pipeline_was_given(pipeline: str | None) -> None:
    converted_by_pass, _ = _qat(Plain(), "bayes")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = convert_fx(converted_by_pass, pipeline=pipeline)
        swapped = convert_fx(_refused())  # module swap, but with the default pipeline: meta says why
    assert out.meta[CONVERT_PATH_KEY] == "quantize pass"
    assert swapped.meta[CONVERT_PATH_KEY].startswith("module swap: the quantize pass refused the model: ")
    assert _convert_path_warnings(record) == []


def test_qirs_own_passes_edit_the_traced_graph_a_users_pass_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    if "test-qat-relu-to-relu6" not in passes.available_passes():
        passes.load_pass_module(str(Path(__file__).resolve().parents[1] / "data" / "qat_relu6_pass.py"))
    seen: list[bool] = []
    real = passes.manager.run_pipeline

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs["inplace"])
        return real(*args, **kwargs)

    monkeypatch.setattr(passes.manager, "run_pipeline", spy)
    qat, _ = _qat(Plain(), "bayes")
    for pipeline in (None, "dce", "test-qat-relu-to-relu6"):
        assert convert_fx(qat, pipeline=pipeline).meta[CONVERT_PATH_KEY] == "quantize pass"
    assert seen == [True, True, False]
