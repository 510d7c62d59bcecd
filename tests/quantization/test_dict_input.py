"""A forward taking a dict (``forward(self, data)`` reading ``data["img"]``, seed 001's RetinaNet):
check_model, compile_model, perf_model and visualize_model take the dict as its one positional argument."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.quantization import DeQuantStub, QuantStub

from qir.march import March, set_march
from qir.quantization import (
    check_model,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    perf_model,
    prepare_qat_fx,
    visualize_model,
)


class DictInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.c = nn.Conv2d(3, 4, 1)

    def forward(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.dq(self.c(self.q(data["img"])))


@pytest.fixture(scope="module")
def converted() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    set_march(March.BAYES)
    torch.manual_seed(0)
    x = {"img": torch.rand(1, 3, 8, 8)}
    qat = prepare_qat_fx(DictInput(), {"": get_default_qat_qconfig()})
    qat(x)
    return convert_fx(qat.eval()), x


@pytest.mark.parametrize("wrapped", [False, True])
def test_check_and_compile_take_a_dict_as_one_argument(converted: tuple[nn.Module, dict], wrapped: bool) -> None:
    q, x = converted
    inputs = (x,) if wrapped else x
    assert check_model(q, inputs, march="bayes").ok
    compiled = compile_model(q, inputs, march="bayes")
    assert torch.equal(compiled(x), q(x))


def test_perf_and_visualize_take_a_dict(converted: tuple[nn.Module, dict], tmp_path: Path) -> None:
    q, x = converted
    profile = perf_model(q, x, march="bayes", out_dir=str(tmp_path))
    assert profile.layers
    svg = visualize_model(q, x, march="bayes", save_path=tmp_path / "m.svg", show=False)
    assert "<svg" in Path(svg).read_text()


def test_other_inputs_are_refused_by_type(converted: tuple[nn.Module, dict]) -> None:
    q, _ = converted
    with pytest.raises(TypeError, match=r"a dict \(one argument\) .* got int"):
        compile_model(q, 3, march="bayes")
    with pytest.raises(TypeError, match=r"a dict \(one argument\) .* got int"):
        check_model(q, 3, march="bayes")
