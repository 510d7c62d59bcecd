"""A model prepared without example_inputs records its first call's inputs, so convert_fx can
convert it by the quantize pass; the result equals module swapping's."""

from __future__ import annotations

import copy

import torch

import qir
from qir.nn.quantized import QUANTIZED_MODULE_MAP
from qir.quantization import (
    FakeQuantState,
    convert_fx,
    first_inputs,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.convert import CONVERT_PATH_KEY
from qir.quantization.prepare import PREPARE_BY_PASS, PREPARE_PATH_KEY, PREPARE_RECORD_KEY
from tests.quantization.path_op_nets import PoolsAndFunctionals


def _record(m: torch.nn.Module) -> object:
    return m.meta[PREPARE_RECORD_KEY]  # type: ignore[operator]


def test_the_record_key_is_prepares() -> None:
    assert first_inputs._RECORD_KEY == PREPARE_RECORD_KEY


def test_calibration_then_qat_without_example_inputs_converts_by_the_quantize_pass() -> None:
    qir.set_march("bayes")
    torch.manual_seed(0)
    calib = prepare_qat_fx(PoolsAndFunctionals(), {"": get_default_calib_qconfig()})
    assert _record(calib).example_inputs is None  # type: ignore[attr-defined]
    set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    first = torch.randn(2, 3, 16, 16)
    calib(first)
    recorded = _record(calib).example_inputs  # type: ignore[attr-defined]
    assert isinstance(recorded, tuple) and torch.equal(recorded[0], first) and recorded[0] is not first
    first.add_(1.0)  # the record is a copy: a reused input buffer does not change it
    assert not torch.equal(recorded[0], first)
    calib(torch.randn(2, 3, 16, 16))
    assert _record(calib).example_inputs is recorded  # recorded once

    qat = prepare_qat_fx(calib, {"": get_default_qat_qconfig()})
    carried = _record(qat).example_inputs  # type: ignore[attr-defined]
    assert torch.equal(carried[0], recorded[0])  # carried to the QAT model: they typed its IR
    assert qat.meta[PREPARE_PATH_KEY] == PREPARE_BY_PASS
    opt = torch.optim.SGD(qat.parameters(), lr=0.01)
    for _ in range(2):
        loss = sum(y.square().mean() for y in qat(torch.randn(4, 3, 16, 16)))
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    qat.eval()
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    by_pass = convert_fx(qat)
    assert by_pass.meta[CONVERT_PATH_KEY] == "quantize pass"

    by_swap = convert_fx(qat, mapping=dict(QUANTIZED_MODULE_MAP))  # a mapping= only module swapping honours
    assert by_swap.meta[CONVERT_PATH_KEY].startswith("module swap: a custom mapping=")
    x = torch.randn(3, 3, 16, 16)  # another batch size than the recorded one
    for a, b, v in zip(by_pass(x), by_swap(x), qat(x), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a, v)


def test_given_example_inputs_are_kept_and_copies_record_their_own() -> None:
    qir.set_march("bayes")
    given = torch.randn(1, 3, 16, 16)
    m = prepare_qat_fx(PoolsAndFunctionals(), {"": get_default_qat_qconfig()}, given)
    m(torch.randn(2, 3, 16, 16))
    assert torch.equal(_record(m).example_inputs, given)  # type: ignore[attr-defined]

    bare = prepare_qat_fx(PoolsAndFunctionals(), {"": get_default_qat_qconfig()})
    dup = copy.deepcopy(bare)
    x = torch.randn(2, 3, 16, 16)
    dup(x)
    assert torch.equal(_record(dup).example_inputs[0], x)  # type: ignore[attr-defined]
    assert _record(bare).example_inputs is None  # type: ignore[attr-defined]


def test_a_jit_trace_is_not_recorded() -> None:
    qir.set_march("bayes")
    bare = prepare_qat_fx(PoolsAndFunctionals(), {"": get_default_qat_qconfig()})
    torch.jit.trace(bare, torch.randn(1, 3, 16, 16), check_trace=False)
    assert _record(bare).example_inputs is None  # type: ignore[attr-defined]
