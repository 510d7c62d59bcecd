"""Automatic int16 promotion: the fewest layers whose qint16 output brings the model to a similarity target.

Each step prepares the float model with a qconfig dict, calibrates it and measures the
output against the float model; so a promoted layer's qint16 scale is calibrated, not
derived. A layer is a candidate only where the march can run it with a qint16 output:
the model with that layer promoted must convert and pass ``check_model`` on the march
(the operator tables decide, consumers included).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qir.quantization.debug.metrics import Metric, metric
from qir.quantization.debug.sensitivity import _output, as_batches, layer_sensitivity, quantized_layers
from qir.quantization.debug.taps import frozen
from qir.quantization.fake_quantize import FakeQuantize, float_fake_quant

__all__ = ["MixedPrecisionResult", "auto_int16"]


@dataclass
class MixedPrecisionResult:
    """What the search found. ``qconfig_dict()`` builds the dict for ``prepare_qat_fx``."""

    promoted: list[str]
    before: float
    after: float
    target: float
    met: bool
    metric: str
    march: str
    candidates: list[str]
    illegal: dict[str, str]
    steps: list[tuple[list[str], float]] = field(default_factory=list)
    #: With every candidate promoted, when even that misses the target (then nothing is promoted).
    bound: float | None = None
    base_qconfig: Any = None
    int16_qconfig: Any = None

    def qconfig_dict(self, qconfig: Any = None, int16_qconfig: Any = None) -> dict[str, Any]:
        """``{"": qconfig, "module_name": {layer: int16_qconfig, ...}}``; defaults: the search's own qconfigs.

        Pass QAT qconfigs (``get_default_qat_qconfig()`` and ``get_default_qat_qconfig(dtype="qint16")``)
        to train with the result.
        """
        base = self.base_qconfig if qconfig is None else qconfig
        wide = self.int16_qconfig if int16_qconfig is None else int16_qconfig
        out: dict[str, Any] = {"": base}
        if self.promoted:
            out["module_name"] = {name: wide for name in self.promoted}
        return out

    def summary(self) -> str:
        verdict = "met" if self.met else "NOT met"
        lines = [
            f"auto int16 on {self.march}: target {self.metric} {self.target} {verdict}; "
            f"{self.before:.6g} -> {self.after:.6g} with {len(self.promoted)} of {len(self.candidates)} "
            f"candidate layer(s) promoted: {', '.join(self.promoted) or '(none)'}"
        ]
        if self.bound is not None:
            lines.append(
                f"  all {len(self.candidates)} candidates at qint16 give {self.bound:.6g}, short of the target: the "
                "rest of the error is in layers that cannot be promoted (listed below) or in the int8 weights; "
                "see layer_sensitivity"
            )
        for name, why in self.illegal.items():
            lines.append(f"  not a candidate: {name}: {why}")
        for promoted, value in self.steps:
            lines.append(f"  tried [{', '.join(promoted)}]: {value:.6g}")
        return "\n".join(lines) + "\n"


def _prepare_calibrated(
    float_model: nn.Module, qconfig_dict: dict[str, Any], calib: Sequence[tuple[Any, ...]], march: str
) -> nn.Module:
    from qir.march import march_scope
    from qir.quantization import prepare_qat_fx, set_fake_quantize

    with march_scope(march), contextlib.redirect_stdout(io.StringIO()):
        model = prepare_qat_fx(float_model, qconfig_dict)
    set_fake_quantize(model, "calibration")
    model.eval()
    with torch.no_grad():
        for args in calib:
            model(*args)
    set_fake_quantize(model, "validation")
    return model


def _legal(model: nn.Module, example: tuple[Any, ...], march: str) -> str | None:
    """``None`` when ``model`` converts and passes check_model on ``march``, else why not."""
    from qir.march import march_scope
    from qir.quantization import check_model, convert_fx

    try:
        with march_scope(march), contextlib.redirect_stdout(io.StringIO()):
            converted = convert_fx(model)
            report = check_model(converted, example, march=march)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
        return str(e).splitlines()[0]
    if not report.ok:
        v = report.violations[0]
        return f"{v.node}: {v.rule}"
    return None


def _meets(m: Metric, value: float, target: float) -> bool:
    return value >= target if m.higher_is_better else value <= target


def auto_int16(
    float_model: nn.Module,
    calib_inputs: Any,
    eval_inputs: Any,
    target: float,
    march: str | None = None,
    metric_name: str | Metric = "cosine",
    qconfig: Any = None,
    int16_qconfig: Any = None,
    candidates: Sequence[str] | None = None,
) -> MixedPrecisionResult:
    """Promote the fewest layers to a qint16 output until the output ``metric`` vs float meets ``target``.

    First the bound: every candidate promoted at once; when even that misses the target,
    nothing is promoted and ``bound`` says how far it got. Otherwise greedy, then pruned:
    layers are tried in order of how much the model improves when each alone stays float
    (:func:`layer_sensitivity`), each added while the target is not met; then every promoted
    layer whose removal still meets the target is removed. Candidates
    are the layers with a qint8 output fake quant (not a fixed scale) that the march can
    run as qint16. ``qconfig`` / ``int16_qconfig`` default to the calibration qconfigs
    (qint8 / qint16 activations). The float model is not changed.
    """
    from qir.march import get_march
    from qir.quantization import get_default_calib_qconfig

    march = str(getattr(march, "value", march) if march is not None else get_march().value)
    m = metric(metric_name)
    base = get_default_calib_qconfig() if qconfig is None else qconfig
    wide = get_default_calib_qconfig(dtype="qint16") if int16_qconfig is None else int16_qconfig
    calib, evals = as_batches(calib_inputs), as_batches(eval_inputs)

    with frozen(float_model):
        ref = _output(float_model, evals)

    def score(promoted: Sequence[str]) -> tuple[float, nn.Module]:
        qd: dict[str, Any] = {"": base}
        if promoted:
            qd["module_name"] = dict.fromkeys(promoted, wide)
        model = _prepare_calibrated(float_model, qd, calib, march)
        with frozen(model), float_fake_quant():  # the arithmetic layer_sensitivity ranks with
            return m.fn(ref, _output(model, evals)), model

    before, model0 = score([])
    layers = quantized_layers(model0)
    names = list(layers) if candidates is None else list(candidates)
    illegal: dict[str, str] = {}
    legal: list[str] = []
    for name in names:
        fqs = layers.get(name)
        act = getattr(dict(model0.named_modules()).get(name), "activation_post_process", None)
        if fqs is None:
            raise ValueError(f"{name!r} is not a quantized layer of the prepared model; layers: {', '.join(layers)}")
        if not isinstance(act, FakeQuantize) or act.has_fixed_scale or act.dtype.name != "qint8":
            continue
        why = _legal(
            _prepare_calibrated(float_model, {"": base, "module_name": {name: wide}}, calib[:1], march), calib[0], march
        )
        if why is None:
            legal.append(name)
        else:
            illegal[name] = why
    result = MixedPrecisionResult(
        promoted=[],
        before=before,
        after=before,
        target=target,
        met=_meets(m, before, target),
        metric=m.name,
        march=march,
        candidates=legal,
        illegal=illegal,
        base_qconfig=base,
        int16_qconfig=wide,
    )
    if result.met or not legal:
        return result
    # The bound: every candidate promoted at once. When even that misses the target, the
    # remaining error sits in layers that cannot be promoted (or in the int8 weights): say
    # so after one step instead of trying the candidates one by one.
    everything, model_all = score(legal)
    result.steps.append((list(legal), everything))
    if not _meets(m, everything, target) and _legal(model_all, calib[0], march) is None:
        result.bound = everything
        return result
    gain = layer_sensitivity(model0, evals, m, layers=legal)
    order = sorted(gain.layers, key=lambda r: -r.only_float if m.higher_is_better else r.only_float)
    promoted: list[str] = []
    value = before
    for row in order:
        trial = [*promoted, row.layer]
        v, model = score(trial)
        result.steps.append((trial, v))
        if _legal(model, calib[0], march) is not None:
            continue  # legal alone, not together with the layers already promoted
        promoted, value = trial, v
        if _meets(m, v, target):
            break
    if _meets(m, value, target):
        for name in list(reversed(promoted[:-1])):
            trial = [p for p in promoted if p != name]
            v, _ = score(trial)
            result.steps.append((trial, v))
            if _meets(m, v, target):
                promoted, value = trial, v
    result.promoted, result.after, result.met = promoted, value, _meets(m, value, target)
    return result
