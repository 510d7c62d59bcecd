"""QuantStub / DeQuantStub: float identity and the attribute layout prepare and convert read."""

from __future__ import annotations

import pytest
import torch

from qir.quantization import DeQuantStub, FakeQuantize, QuantStub, get_default_qat_qconfig


def test_stubs_are_identity_in_float() -> None:
    x = torch.randn(2, 3)
    assert QuantStub()(x) is x and QuantStub(scale=1 / 128)(x) is x and DeQuantStub()(x) is x


def test_fixed_scale_is_a_buffer_in_the_state_dict() -> None:
    stub = QuantStub(scale=1 / 128)
    assert stub.has_fixed_scale and stub.scale is not None and stub.scale.tolist() == [1 / 128]
    assert "scale" in stub.state_dict()
    assert not QuantStub().has_fixed_scale and "scale" not in QuantStub().state_dict()


def test_make_fake_quant_honours_the_fixed_scale() -> None:
    qc = get_default_qat_qconfig()
    fixed = QuantStub(scale=1 / 128).make_fake_quant(qc)
    assert isinstance(fixed, FakeQuantize) and fixed.has_fixed_scale and fixed.scale.tolist() == [1 / 128]
    observed = QuantStub(qconfig=qc).make_fake_quant()
    assert not observed.has_fixed_scale
    observed(torch.tensor([-1.0, 2.0]))
    assert float(observed.scale) == pytest.approx(2.0 / 127.5)


def test_stub_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="zero_point must be 0"):
        QuantStub(zero_point=3)
    with pytest.raises(ValueError, match=r"e\.g\. 1/128"):
        QuantStub(scale=0.0)
    with pytest.raises(ValueError, match="needs a qconfig"):
        QuantStub().make_fake_quant()
