"""``check_qconfig``: what to fix before training, read from the prepared model and a trial conversion.

Findings (each names the node or module, and the fix):

- ``shared-module``: one module called at several sites of the float model (when given);
  worst when prepare fused one call into a new module with an untied copy of the weights;
- ``unfused``: a conv / linear whose batch norm, ReLU or add stayed a separate op;
- ``unconvertible``: what ``prepare_qat_fx`` refuses because convert would (a float module with a
  qconfig and no quantized form on quantized tensors, an einsum that is no batched matmul, ...;
  qir.quantization.prepare_checks): check_qconfig prepares anyway and reports each;
- ``float-fallback``: a module left as a torch float module (no QAT form, or qconfig None);
- ``illegal-qconfig``: the trial conversion refuses a layer's qconfig on the march (e.g. a
  qint16 output the march cannot produce);
- ``illegal-op``: ``check_model`` on the converted model finds a rule the table breaks;
- ``non-finite``: an observer of a prepared model skipped batches holding NaN or Inf
  (:func:`~qir.quantization.observer.nonfinite_report`): its range comes from the other
  batches only; find the bad data.
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from qir.quantization.debug.sensitivity import quantized_layers
from qir.quantization.debug.taps import as_inputs, frozen, model_stage
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.observer import nonfinite_report
from qir.quantization.prepare_checks import collected_refusals
from qir.quantization.qat_classes import qat_class_for

__all__ = ["Finding", "QConfigReport", "check_qconfig"]

_FUSABLE_PRODUCERS = {"Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "Linear"}
_FUSABLE_CONSUMERS = ("BatchNorm", "ReLU", "ReLU6")
ERRORS = ("unconvertible", "illegal-qconfig", "illegal-op")


@dataclass(frozen=True)
class Finding:
    kind: str
    where: str
    message: str

    @property
    def is_error(self) -> bool:
        return self.kind in ERRORS


@dataclass
class QConfigReport:
    march: str
    layers: list[tuple[str, str, str, str, str]]  # layer, type, activation dtype, observer, weight dtype
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No errors (warnings may remain)."""
        return not any(f.is_error for f in self.findings)

    def of_kind(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    def table(self) -> str:
        lines = [f"qconfig check on {self.march}: {'OK' if self.ok else 'ERRORS'}, {len(self.findings)} finding(s)"]
        cols = ("layer", "type", "activation", "observer", "weight")
        widths = [max(len(c), *(len(r[i]) for r in self.layers)) if self.layers else len(c) for i, c in enumerate(cols)]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip())
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in self.layers]
        for f in self.findings:
            lines.append(f"{'error' if f.is_error else 'warning'}: {f.kind}: {f.where}: {f.message}")
        return "\n".join(lines) + "\n"


def _layer_rows(model: nn.Module) -> list[tuple[str, str, str, str, str]]:
    mods = dict(model.named_modules())
    rows = []
    for name in quantized_layers(model):
        m = mods[name]
        act, w = getattr(m, "activation_post_process", None), getattr(m, "weight_fake_quant", None)
        act_d = act.dtype.name if isinstance(act, FakeQuantize) else "qint32 (none)"
        obs = type(act.observer).__name__ if isinstance(act, FakeQuantize) else "-"
        w_d = w.dtype.name if isinstance(w, FakeQuantize) else "-"
        rows.append((name, type(m).__name__, act_d, obs, w_d))
    return rows


def _shared(counts: Counter[str], prepared: fx.GraphModule) -> list[Finding]:
    """Modules called at several sites; a call that prepare fused into another module is named."""
    sites = Counter(str(n.target) for n in prepared.graph.nodes if n.op == "call_module")
    out = []
    for name, k in counts.items():
        if k < 2:
            continue
        kept = sites.get(name, 0) + sum(v for t, v in sites.items() if t.startswith(f"{name}_call"))
        if kept < k:
            msg = (
                f"called at {k} sites, but only {kept} still call it after prepare: a call fused with its "
                "neighbour (conv + bn / add / relu) became a new module with an untied copy of the weights, which "
                "trains apart from the others; give each call site its own module, or keep the shared one unfused"
            )
        else:
            msg = (
                f"called at {k} sites: each call gets its own output observer and the weights stay shared; "
                "check that one weight quantization suits every call"
            )
        out.append(Finding("shared-module", name, msg))
    return out


def _float_call_counts(model: nn.Module, args: tuple[Any, ...]) -> Counter[str]:
    """Calls per leaf module of a float model on one run (modules with a QAT form or parameters)."""
    counts: Counter[str] = Counter()
    handles = []
    for name, mod in model.named_modules():
        if name and not any(True for _ in mod.children()):
            if qat_class_for(mod) is not None or any(True for _ in mod.parameters(recurse=False)):
                handles.append(mod.register_forward_hook(lambda *_, n=name: counts.update([n])))
    try:
        with frozen(model), torch.no_grad():
            model(*args)
    finally:
        for h in handles:
            h.remove()
    return counts


def _graph_findings(model: fx.GraphModule) -> list[Finding]:
    out: list[Finding] = []
    mods = dict(model.named_modules())
    for node in model.graph.nodes:
        if node.op != "call_module":
            continue
        mod = mods[str(node.target)]
        cls = type(mod)
        if cls.__name__ in _FUSABLE_PRODUCERS and cls.__module__.startswith("qir.nn.qat"):
            for user in node.users:
                name = type(mods[str(user.target)]).__name__ if user.op == "call_module" else str(user.target)
                fusable = name.startswith(_FUSABLE_CONSUMERS) or name in ("add", "__add__")
                if fusable:
                    why = (
                        f"its output has {len(node.users)} users; fusion needs the only use"
                        if len(node.users) > 1
                        else "the pair is not a fusion pattern in this order"
                    )
                    out.append(
                        Finding(
                            "unfused",
                            f"{node.target} -> {user.name}",
                            f"{cls.__name__} then {name} stay separate ({why}): an extra quantization step "
                            "between them; reorder so conv(+bn)(+add)(+relu) follow each other",
                        )
                    )
        if cls.__module__.startswith("torch.") and not isinstance(mod, (nn.Identity, nn.Flatten, nn.Unflatten)):
            if qat_class_for(mod) is None:
                fix = "qir has no QAT form of it; a batch norm fuses only right after a conv used once"
                if not cls.__name__.startswith("BatchNorm"):
                    fix = "no QAT form of it: a DeQuantStub before it (and a QuantStub after) runs it on the CPU"
            else:
                fix = "its qconfig is None, so prepare left it float; give it a qconfig"
            out.append(Finding("float-fallback", str(node.target), f"{cls.__name__} runs in float: {fix}"))
    return out


def _nonfinite_findings(model: nn.Module) -> list[Finding]:
    return [
        Finding(
            "non-finite",
            name,
            f"skipped {n} batch(es) holding NaN or Inf, so its range comes from the other batches only; "
            "find the bad inputs (qir.quantization.debug.find_bad_case, or torch.isfinite on the data), or set "
            "nonfinite='raise' in the qconfig's observer arguments to stop at the first",
        )
        for name, n in nonfinite_report(model).items()
    ]


def _trial_conversion(model: nn.Module, args: tuple[Any, ...], march: str) -> list[Finding]:
    from qir.march import march_scope
    from qir.quantization import check_model, convert_fx, set_fake_quantize

    work = copy.deepcopy(model)
    set_fake_quantize(work, "calibration")
    work.eval()
    try:
        with march_scope(march), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
            work(*args)
            set_fake_quantize(work, "validation")
            converted = convert_fx(work)
            report = check_model(converted, args, march=march)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
        text = str(e).splitlines()[0]
        where = text.split("'")[1] if text.count("'") >= 2 else "(model)"
        return [Finding("illegal-qconfig", where, text)]
    return [
        Finding("illegal-op", v.module or v.node, f"{v.spelling}: {v.rule} (actual {v.actual}, bound {v.bound})")
        for v in report.violations
        if v.ok is False
    ]


def check_qconfig(
    model: nn.Module,
    example_inputs: Any,
    qconfig_dict: dict[str, Any] | None = None,
    march: str | None = None,
    out_dir: str | Path | None = None,
) -> QConfigReport:
    """Check a model's quantization setup before training; print nothing, return the report.

    ``model``: a float model with ``qconfig_dict`` (prepared here, on a copy), or a model
    prepared by ``prepare_qat_fx`` (``qconfig_dict`` None). The trial conversion calibrates
    a copy on ``example_inputs`` only, to learn whether the march accepts every qconfig.
    ``out_dir``: also write ``qconfig_check.txt``.
    """
    from qir.march import get_march, march_scope
    from qir.quantization import prepare_qat_fx

    march_name = str(getattr(march, "value", march) if march is not None else get_march().value)
    args = as_inputs(example_inputs)
    stage = model_stage(model)
    if qconfig_dict is not None:
        if stage != "float":
            raise ValueError(f"check_qconfig got a {stage} model and a qconfig_dict; pass the float model with it")
        with march_scope(march_name), contextlib.redirect_stdout(io.StringIO()), collected_refusals() as refused:
            prepared: nn.Module = prepare_qat_fx(model, qconfig_dict)
    elif stage == "prepared":
        prepared, refused = model, []
    else:
        raise ValueError(
            f"check_qconfig needs a prepared model, or a float model and a qconfig_dict; got a {stage} model "
            "and no qconfig_dict"
        )
    if not isinstance(prepared, fx.GraphModule):
        raise TypeError(f"check_qconfig reads prepare_qat_fx's GraphModule; got {type(prepared).__name__}")
    report = QConfigReport(march_name, _layer_rows(prepared))
    report.findings += [Finding("unconvertible", e.where or "model", str(e)) for e in refused]
    if qconfig_dict is not None:
        report.findings += _shared(_float_call_counts(model, args), prepared)
    report.findings += _graph_findings(prepared)
    report.findings += _nonfinite_findings(prepared)
    report.findings += _trial_conversion(prepared, args, march_name)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "qconfig_check.txt").write_text(report.table())
    return report
