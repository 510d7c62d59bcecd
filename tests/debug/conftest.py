"""A calibrated digits model (untrained weights, real digits images), built once per module."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from qir.examples import DeployableDigitsNet
from qir.examples.digits_data import digits_split
from qir.march import march_scope
from qir.quantization import convert_fx, get_default_calib_qconfig, prepare_qat_fx, set_fake_quantize


@dataclass
class Digits:
    float_model: nn.Module
    calibrated: nn.Module
    converted: nn.Module
    x_train: torch.Tensor
    x_test: torch.Tensor


def calibrated(model: nn.Module, x: torch.Tensor, qconfig_dict: dict | None = None) -> nn.Module:
    prepared = prepare_qat_fx(model, qconfig_dict or {"": get_default_calib_qconfig()})
    set_fake_quantize(prepared, "calibration")
    prepared.eval()
    with torch.no_grad():
        prepared(x)
    set_fake_quantize(prepared, "validation")
    return prepared


@pytest.fixture(scope="module")
def digits() -> Digits:
    torch.manual_seed(0)
    x_tr, _, x_te, _ = digits_split()
    model = DeployableDigitsNet().eval()
    # The scope covers the build only: held across a module fixture's yield it would outlive
    # (and restore over) the per-test scopes below.
    with march_scope("bayes"):
        calib = calibrated(model, x_tr[:256])
        return Digits(model, calib, convert_fx(calib), x_tr[:256], x_te[:128])


@pytest.fixture(autouse=True)
def bayes() -> Iterator[None]:
    with march_scope("bayes"):
        yield
