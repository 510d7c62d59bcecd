"""The model options shared by check / compile / perf / show, and the float -> integer flow.

A float model is (1) wrapped in QuantStub / DeQuantStub when it has none, (2) prepared
with the chosen qconfig, (3) calibrated on ``--calib-data`` (random normal data when there
is none: said on stderr), (4) converted. A QAT model is converted; a converted model is used
as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qir.cli import calibdata, legality
from qir.cli.errors import UserError
from qir.cli.modelspec import CONVERTED, FLOAT, QAT, load_model, model_kind
from qir.cli.progress import bar
from qir.cli.shapes import example_inputs, shapes_from
from qir.cli.stubbed import add_stubs_if_missing

QCONFIGS = ("calib", "qat", "qat16")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="package.module:factory or path/to/file.py:factory (returns an nn.Module)")
    p.add_argument(
        "--input-shape",
        action="append",
        metavar="N,C,H,W",
        help="input shape, e.g. 1,3,224,224 (repeat for each input)",
    )
    add_march_arg(p)
    p.add_argument(
        "--qconfig",
        choices=QCONFIGS,
        default="calib",
        help="float models: calib (8-bit, percentile calibration; default), qat (8-bit moving-average "
        "min/max), qat16 (16-bit activations)",
    )
    p.add_argument("--calib-data", metavar="PATH", help=".npy / .npz file or folder of images (default: random data)")
    p.add_argument("--calib-steps", type=int, default=8, metavar="N", help="calibration batches (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random example / calibration data")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_march_arg(p: argparse.ArgumentParser, default: str = "bayes") -> None:
    p.add_argument("--march", default=default, help=f"bayes (RDK Ultra) or bernoulli2 (RDK X3); default {default}")


def parse_march(text: str) -> str:
    from qir.march import March

    try:
        return March.parse(text).value
    except ValueError:
        raise UserError(f"--march {text!r} is unknown; valid: {', '.join(m.value for m in March)}") from None


@dataclass
class Prepared:
    """A model ready for check / compile: converted, with example inputs and what was done."""

    model: nn.Module
    inputs: list[torch.Tensor]
    march: str
    kind: str  # what the factory returned: float / qat / converted
    name: str
    stages: list[tuple[str, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: The earlier stages, where the flow had them: the float model (with the stubs qir
    #: added, if any) and the calibrated or given QAT model.
    float_model: nn.Module | None = None
    prepared: nn.Module | None = None


def _run(model: nn.Module, inputs: list[torch.Tensor], what: str) -> Any:
    try:
        with torch.no_grad():
            return model(*inputs)
    except Exception as e:
        shapes = " ".join(",".join(map(str, x.shape)) for x in inputs)
        raise UserError(
            f"{what} fails on --input-shape {shapes}: {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from None


def _qconfig(name: str) -> Any:
    from qir.quantization import (
        get_default_calib_qconfig,
        get_default_qat_qconfig,
    )

    table: dict[str, Callable[[], Any]] = {
        "calib": get_default_calib_qconfig,
        "qat": get_default_qat_qconfig,
        "qat16": lambda: get_default_qat_qconfig(dtype="qint16"),
    }
    return table[name]()


def _calibrate(args: argparse.Namespace, model: nn.Module, shapes: list[tuple[int, ...]], prep: Prepared) -> None:
    from qir.quantization import set_fake_quantize

    if args.calib_steps < 1:
        raise UserError(f"--calib-steps must be at least 1, got {args.calib_steps}")
    if args.calib_data:
        batches = calibdata.calibration_batches(args.calib_data, shapes, args.calib_steps)
        prep.notes.append(f"calibrated on {len(batches)} batch(es) from {args.calib_data}")
    else:
        batches = calibdata.random_batches(shapes, args.calib_steps, args.seed)
        msg = (
            f"calibrated on {len(batches)} batch(es) of RANDOM normal data (no --calib-data): the scales fit "
            "N(0, 1) inputs, not your data; accuracy numbers would be meaningless"
        )
        prep.notes.append(msg)
    set_fake_quantize(model, "calibration")
    model.eval()
    with torch.no_grad():
        for b in bar(batches, "calibrate", enabled=False if args.no_progress else None):
            _run(model, b, "calibration")
    set_fake_quantize(model, "validation")


def prepare(args: argparse.Namespace, precheck: bool = False) -> Prepared:
    """Load the model and bring it to a converted model for ``args.march`` (see the module doc).

    ``precheck``: check a float model's legality before quantizing it, and stop (exit 2,
    report printed) when it is illegal: the operators decide that already.
    """
    from qir.march import march_scope
    from qir.quantization import convert_fx, prepare_qat_fx

    march = parse_march(args.march)
    shapes = shapes_from(args.input_shape, f"qir {args.command}")
    t0 = time.perf_counter()
    model = load_model(args.model)
    kind = model_kind(model)
    prep = Prepared(model, example_inputs(shapes, args.seed), march, kind, args.model.rpartition(":")[2])
    prep.stages.append(("load", time.perf_counter() - t0))
    model.eval()
    if kind == QAT:
        from qir.quantization.fake_quantize import types_only_fake_quant

        # a check that it runs: in QAT state its forward would move the trained scales convert reads
        with types_only_fake_quant():
            example_output = _run(model, prep.inputs, f"model '{args.model}'")
    else:
        example_output = _run(model, prep.inputs, f"model '{args.model}'")
    if kind == CONVERTED:
        return prep
    if kind == FLOAT and precheck:
        _precheck(args, model, prep)
    # prepare / convert may print progress of their own; the CLI prints its own summary
    with march_scope(march), contextlib.redirect_stdout(io.StringIO()):
        if kind == FLOAT:
            model, added = add_stubs_if_missing(model, example_output, len(shapes))
            prep.float_model = model
            if added:
                prep.notes.append(
                    "the model has no QuantStub: qir put QuantStub before each input and DeQuantStub after each output"
                )
            t0 = time.perf_counter()
            try:
                model = prepare_qat_fx(model, {"": _qconfig(args.qconfig)})
            except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
                raise UserError(f"prepare_qat_fx refused the model: {e}") from None
            prep.stages.append((f"prepare ({args.qconfig} qconfig)", time.perf_counter() - t0))
            t0 = time.perf_counter()
            _calibrate(args, model, shapes, prep)
            prep.stages.append(("calibrate", time.perf_counter() - t0))
        prep.prepared = model
        t0 = time.perf_counter()
        try:
            prep.model = convert_fx(model)
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
            raise UserError(f"convert_fx failed: {e}") from None
        prep.stages.append(("convert", time.perf_counter() - t0))
    _run(prep.model, prep.inputs, "the converted model")
    return prep


def _precheck(args: argparse.Namespace, model: nn.Module, prep: Prepared) -> None:
    report = legality.check(model, prep.inputs, prep.march)
    if not report.ok:
        print(f"qir {args.command}: {args.model} (float model, checked before quantization), march {prep.march}")
        legality.write_report(report, getattr(args, "report", None))
        legality.gate(report)


def kind_note(kind: str) -> str:
    return {
        FLOAT: "float model: calibrated and converted by qir",
        QAT: "QAT model: converted by qir",
        CONVERTED: "converted model: used as it is",
    }[kind]
