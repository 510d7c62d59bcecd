"""The flow every test_names_* script runs, written once: calibrate -> QAT -> convert -> check ->
compile -> run, returning what it measured (the QAT-vs-integer error in output LSBs)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qir.quantization import (
    check_model,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)

Inputs = Callable[[], tuple[torch.Tensor, ...]]


@dataclass
class FlowResult:
    qat: nn.Module
    converted: nn.Module
    inputs: tuple[torch.Tensor, ...]
    integer_out: Any  # a tensor, or a tuple of tensors for a model with several outputs
    qat_out: Any

    def max_error(self) -> float:
        """The largest |integer - QAT| over every output."""
        pairs = zip(_flat(self.integer_out), _flat(self.qat_out), strict=True)
        return max(float((a - b).abs().max()) for a, b in pairs)


def _flat(out: Any) -> list[torch.Tensor]:
    """The tensors of a model's output, nested lists, tuples and dicts flattened in order."""
    if isinstance(out, dict):
        return [t for o in out.values() for t in _flat(o)]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [out]


def fx_flow(
    model: nn.Module,
    inputs: Inputs,
    calib_dict: Mapping[str, Any] | None = None,
    qat_dict: Mapping[str, Any] | None = None,
    steps: int = 4,
    example_inputs: bool = False,
) -> FlowResult:
    """The Horizon toolkit's fx flow: calibration qconfigs, calibrate, QAT qconfigs on the calibrated
    model, a few QAT steps, freeze, convert, check, compile; the artifact must equal the converted model.
    ``example_inputs``: pass ``inputs()`` to prepare_qat_fx (a model taking a list of FPN levels needs it)."""
    examples = inputs() if example_inputs else None
    calib = prepare_qat_fx(model, calib_dict or {"": get_default_calib_qconfig()}, example_inputs=examples)
    calib.eval()
    with torch.no_grad():
        for _ in range(steps):
            calib(*inputs())
    qat = prepare_qat_fx(calib, qat_dict or {"": get_default_qat_qconfig()}, example_inputs=examples)
    qat.train()
    opt = torch.optim.SGD([p for p in qat.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(steps):
        loss = sum(o.float().square().mean() for o in _flat(qat(*inputs())))
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    qat.eval()
    set_fake_quantize(qat, "validation")
    return finish(qat, convert_fx(qat), inputs())


def finish(qat: nn.Module, converted: nn.Module, inputs: tuple[torch.Tensor, ...]) -> FlowResult:
    """Check and compile ``converted``, run both, and require the artifact to be bit-exact."""
    with torch.no_grad():
        integer_out = converted(*inputs)
        qat_out = qat(*inputs)
    report = check_model(converted, inputs, advice=0)
    assert report.ok, report
    program = compile_model(converted, list(inputs))
    for got, want in zip(_flat(program(*inputs)), _flat(integer_out), strict=True):
        assert torch.equal(got, want)
    return FlowResult(qat, converted, inputs, integer_out, qat_out)
