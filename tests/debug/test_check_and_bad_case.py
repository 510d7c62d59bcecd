"""check_qconfig finds each kind of problem; find_bad_case finds the inputs planted to break quantization."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from qir.quantization import (
    DeQuantStub,
    QuantStub,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
)
from qir.quantization.debug import check_qconfig, find_bad_case
from tests.debug.conftest import Digits


class Troubled(nn.Module):
    """A conv whose output is used twice (its BN cannot fuse), a module called twice, a ReLU fed twice."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()
        self.conv2, self.relu2 = nn.Conv2d(8, 8, 1), nn.ReLU()
        self.shared = nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        y = self.conv(x)
        z = self.relu(self.bn(y)) + y
        a = self.conv2(z)
        b = self.shared(self.shared(self.relu2(a)))
        return self.dequant(b + a)


def test_each_problem_is_found_and_named() -> None:
    rep = check_qconfig(Troubled().eval(), torch.rand(2, 3, 8, 8), {"": get_default_qat_qconfig()}, march="bayes")
    kinds = {(f.kind, f.where) for f in rep.findings}
    assert ("shared-module", "shared") in kinds
    assert ("unfused", "conv -> bn") in kinds and ("unfused", "conv2 -> relu2") in kinds
    assert ("float-fallback", "bn") in kinds
    assert ("illegal-qconfig", "bn") in kinds and not rep.ok
    assert "untied copy of the weights" in rep.table()  # its second call fused with the add


def test_int16_output_refused_on_bernoulli2_accepted_on_bayes(digits: Digits, tmp_path: Path) -> None:
    qd = {"": get_default_calib_qconfig(), "module_name": {"conv0": get_default_calib_qconfig(dtype="qint16")}}
    b2 = check_qconfig(digits.float_model, digits.x_test[:2], qd, march="bernoulli2", out_dir=tmp_path)
    assert not b2.ok and [(f.kind, f.where) for f in b2.findings] == [("illegal-qconfig", "conv0")]
    assert "qint16" in b2.findings[0].message
    assert (tmp_path / "qconfig_check.txt").read_text() == b2.table()
    bayes = check_qconfig(digits.float_model, digits.x_test[:2], qd, march="bayes")
    assert bayes.ok and bayes.findings == []
    assert ("conv0", "ConvReLU2d", "qint16", "PercentileObserver", "qint8") in bayes.layers


def test_prepared_model_is_checked_as_it_is(digits: Digits) -> None:
    rep = check_qconfig(digits.calibrated, digits.x_test[:2], march="bayes")
    assert rep.ok and len(rep.layers) == 6
    with pytest.raises(ValueError, match="pass the float model"):
        check_qconfig(digits.calibrated, digits.x_test[:2], {"": get_default_calib_qconfig()}, march="bayes")
    with pytest.raises(ValueError, match="no qconfig_dict"):
        check_qconfig(digits.float_model, digits.x_test[:2], march="bayes")


def test_find_bad_case_finds_planted_samples(digits: Digits) -> None:
    x = digits.x_test.clone()
    planted = [5, 17, 60]
    x[planted] *= 4.0  # beyond the calibrated ranges: saturation in the quantized model only
    batches = [x[:50], x[50:100], x[100:]]
    worst = find_bad_case(digits.float_model, digits.converted, batches, top_k=3)
    assert sorted(c.index for c in worst) == planted
    assert worst[0].value <= worst[-1].value  # cosine: least similar first
    by_l2 = find_bad_case(digits.float_model, digits.converted, batches, "relative_l2", top_k=3)
    assert sorted(c.index for c in by_l2) == planted and by_l2[0].value >= by_l2[-1].value
    with pytest.raises(ValueError, match="top_k"):
        find_bad_case(digits.float_model, digits.converted, x, top_k=0)


class SharedUnfused(nn.Module):
    """One conv applied twice in a row: nothing to fuse it with, so both calls keep its weights."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.conv(self.conv(self.quant(x))))


def test_shared_module_kept_shared_is_a_milder_finding() -> None:
    rep = check_qconfig(SharedUnfused().eval(), torch.rand(2, 4, 4, 4), {"": get_default_qat_qconfig()}, march="bayes")
    shared = rep.of_kind("shared-module")
    assert [f.where for f in shared] == ["conv"] and "weights stay shared" in shared[0].message
    assert rep.ok
