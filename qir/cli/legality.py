"""Running ``check_model`` for the CLI: the report printed, exit 2 when the model is illegal."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qir.cli.errors import IllegalModel, UserError


def check(model: nn.Module, inputs: list[torch.Tensor], march: str) -> Any:
    """The :class:`~qir.quantization.check.LegalityReport` with advice (printing is left to the caller)."""
    from qir.quantization import check_model

    example = inputs[0] if len(inputs) == 1 else tuple(inputs)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # check_model prints when asked for advice
            return check_model(model, example, march=march, advice=1)
    except (TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"check_model could not trace the model: {type(e).__name__}: {e}") from None


def write_report(report: Any, path: str | None) -> None:
    if path is None:
        return
    try:
        Path(path).write_text(str(report) + "\n")
    except OSError as e:
        raise UserError(f"cannot write the legality report to '{path}': {e}") from None


def gate(report: Any) -> None:
    """Print an illegal model's report and stop with exit code 2."""
    if not report.ok:
        print(report)
        raise IllegalModel(
            f"the model is not legal on {report.march} ({len(report.violations)} error(s), listed above)"
        )
