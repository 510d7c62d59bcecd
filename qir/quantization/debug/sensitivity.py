"""Layer sensitivity: the output error when only one layer is quantized, and when only it stays float.

Works on a prepared (calibrated or QAT) model by switching its fake quants, on a copy: a
"layer" is a module that owns fake quants (its output ``activation_post_process`` and its
``weight_fake_quant``). The reference is the same model with every fake quant off (the
fused float model).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qir.quantization.debug.metrics import Metric, metric
from qir.quantization.debug.taps import as_inputs, frozen, model_stage
from qir.quantization.fake_quantize import FakeQuantize, float_fake_quant

__all__ = ["LayerSensitivity", "SensitivityReport", "layer_sensitivity", "quantized_layers"]

#: Attribute names of the fake quants that make a module a quantized layer.
_OWNED = ("activation_post_process", "weight_fake_quant")


def quantized_layers(model: nn.Module) -> dict[str, list[FakeQuantize]]:
    """Layer path -> the fake quants it owns (output first, then weight), in module order."""
    layers: dict[str, list[FakeQuantize]] = {}
    for name, mod in model.named_modules():
        owned = [getattr(mod, a, None) for a in _OWNED]
        fqs = [fq for fq in owned if isinstance(fq, FakeQuantize)]
        if fqs:
            layers[name] = fqs
    return layers


@dataclass
class LayerSensitivity:
    """One layer: its output dtype and the model-output similarity in both experiments."""

    layer: str
    module_type: str
    dtype: str
    only_quantized: float  # only this layer's fake quants on
    only_float: float  # every fake quant on but this layer's


@dataclass
class SensitivityReport:
    metric: str
    higher_is_better: bool
    all_quantized: float  # every fake quant on
    layers: list[LayerSensitivity]  # ranked: most sensitive first

    def ranked(self) -> list[str]:
        return [r.layer for r in self.layers]

    def table(self) -> str:
        better = "higher" if self.higher_is_better else "lower"
        lines = [
            f"layer sensitivity ({self.metric} of the model output vs float; {better} is better); "
            f"all layers quantized: {self.all_quantized:.6g}",
            f"{'rank':<5} {'layer':<24} {'type':<18} {'dtype':<7} {'only this quantized':>20} {'only this float':>16}",
        ]
        for i, r in enumerate(self.layers):
            lines.append(
                f"{i + 1:<5} {r.layer:<24} {r.module_type:<18} {r.dtype:<7} "
                f"{r.only_quantized:>20.6g} {r.only_float:>16.6g}"
            )
        return "\n".join(lines) + "\n"


def _output(model: nn.Module, batches: Sequence[tuple[Any, ...]]) -> torch.Tensor:
    outs = []
    with torch.no_grad():
        for args in batches:
            out = model(*args)
            if not isinstance(out, torch.Tensor):
                raise TypeError(
                    f"sensitivity compares one output tensor; the model returned {type(out).__name__} "
                    "(wrap it to return the tensor that matters)"
                )
            outs.append(out.detach().float().reshape(out.shape[0], -1) if out.dim() else out.reshape(1, 1))
    return torch.cat(outs)


def as_batches(inputs: Any) -> list[tuple[Any, ...]]:
    """One call's inputs (a tensor or tuple) or a list of them, as a list of positional-argument tuples."""
    if isinstance(inputs, list) and inputs and all(isinstance(b, (torch.Tensor, tuple)) for b in inputs):
        return [as_inputs(b) for b in inputs]
    return [as_inputs(inputs)]


def layer_sensitivity(
    model: nn.Module,
    inputs: Any,
    metric_name: str | Metric = "cosine",
    layers: Sequence[str] | None = None,
) -> SensitivityReport:
    """Rank the quantized layers of a prepared ``model`` by how much quantizing each alone hurts the output.

    ``inputs``: a tensor, a tuple of inputs, or a list of batches. ``metric_name``: ``cosine``
    (default), ``relative_l2``, ``max_abs`` or ``sqnr``, of the output against the model with
    every fake quant off. Rows are ranked by the "only this layer quantized" figure, worst
    first. The model is not changed (the experiments run on a copy).
    """
    if model_stage(model) != "prepared":
        raise ValueError(
            f"layer_sensitivity needs a prepared (calibrated or QAT) model with fake quants, got a "
            f"{model_stage(model)} model; run prepare_qat_fx and calibrate first"
        )
    m = metric(metric_name)
    work = copy.deepcopy(model)
    batches = as_batches(inputs)
    found = quantized_layers(work)
    names = list(found) if layers is None else list(layers)
    unknown = [n for n in names if n not in found]
    if unknown:
        raise ValueError(f"not quantized layers of this model: {', '.join(unknown)}; layers: {', '.join(found)}")
    every = [fq for fqs in found.values() for fq in fqs]
    mods = dict(work.named_modules())

    def run(enabled: set[int]) -> torch.Tensor:
        # float_fake_quant: with every fake quant on, a model in validation state would run its
        # integer twin instead; all experiments must run the same (fake-quant) arithmetic.
        with frozen(work), float_fake_quant():  # eval, observers off; then this experiment's switches
            for fq in every:
                fq.fake_quant_enabled = id(fq) in enabled
            return _output(work, batches)

    ref = run(set())
    all_on = {id(fq) for fq in every}
    rows = []
    for name in names:
        own = {id(fq) for fq in found[name]}
        act = getattr(mods[name], "activation_post_process", None)
        rows.append(
            LayerSensitivity(
                layer=name,
                module_type=type(mods[name]).__name__,
                dtype=act.dtype.name if isinstance(act, FakeQuantize) else "-",
                only_quantized=m.fn(ref, run(own)),
                only_float=m.fn(ref, run(all_on - own)),
            )
        )
    # Worst "only this quantized" first; ties broken by the biggest gain when it alone stays float.
    rows.sort(
        key=lambda r: (r.only_quantized, -r.only_float) if m.higher_is_better else (-r.only_quantized, r.only_float)
    )
    return SensitivityReport(m.name, m.higher_is_better, m.fn(ref, run(all_on)), rows)
