"""``check_model``: will this model run on the march's BPU? A report per node and rule.

    report = check_model(quantized_model, example_input, advice=1)   # prints the report
    report.ok             # False when some operator is unsupported or breaks a rule
    report.violations     # the errors: node, module, operator, rule, actual, bound, advice

The model (float, fused, QAT or converted ``nn.Module``) is traced with
:func:`qir.frontend.trace` (a model fx cannot trace: its forward's path on the example input is
recorded, :mod:`qir.frontend.record`, and ``report.specialized`` says what that fixes) and
checked by the ``legalize`` pass against the march's operator table (docs/legality.md). A
``torch.jit.trace`` of a module is checked as the module it was traced from (a TorchScript
module has lost the module paths the report names nodes by), like ``compile_model`` does.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from passes.base import PassContext
from passes.legality_facts import register_module_view
from passes.legality_registry import get_table
from passes.legalize import (
    ADVISORY,
    AMBIGUOUS_RULE,
    ERROR_KINDS,
    RESULT_KEY,
    UNCHECKED,
    UNKNOWN,
    UNSUPPORTED,
    VIOLATION,
    Finding,
    LegalityResult,
    Legalize,
    resolve_march,
)
from passes.manager import run_pipeline
from qir.frontend.record import trace_or_record
from qir.quantization.fuse import FUSER_RECORD_KEY
from qir.quantization.hybrid import CPU, HybridPlan, hybrid_plan_of
from qir.quantization.jit_source import traced_original

__all__ = ["LegalityReport", "Violation", "check_model"]

#: Facts that count channels: a bound on one of them is met by splitting the layer.
_CHANNEL_FACTS = {
    "out_channels": "output channels",
    "weight_n": "output channels",
    "out_features": "output features",
    "in_channels": "input channels",
    "weight_c": "input channels",
    "in_features": "input features",
}
#: Wording of the tables' rules about precision lost in lookups and conversions (qint16 helps).
_PRECISION_WORDS = ("precision risk", "accuracy risk", "accuracy issue", "precision loss", "lookup")


@attrs.frozen
class Violation:
    """One line of a :class:`LegalityReport`.

    ``kind``: ``violation`` (a rule fails), ``unsupported`` (the march does not run the
    operator), ``unknown`` (the tables give no answer), ``unchecked`` (a fact the rule
    needs is not in the graph), ``advisory`` (a stated constraint nothing can check).
    ``ok`` is False for the first two and None for the rest. ``module`` is the qualified
    name of the module the node came from (None for function calls); ``advice`` the
    suggested fixes when ``check_model`` ran with ``advice``.
    """

    kind: str
    node: str
    module: str | None
    op: str
    spelling: str
    rule: str
    check: str
    actual: Any
    bound: Any
    message: str
    advice: tuple[str, ...] = ()
    #: The node's facts the rule reads (all facts for unknown nodes), for ``advice >= 2``.
    facts: dict[str, Any] = attrs.field(factory=dict, eq=False)

    @property
    def ok(self) -> bool | None:
        return False if self.kind in ERROR_KINDS else None


def _show(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, tuple):
        return "(" + ", ".join(_show(x) for x in v) + ")"
    return str(v)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(rows: Sequence[Sequence[str]], indent: str = "  ", widths: Sequence[int] | None = None) -> list[str]:
    """Rows as left-aligned columns; ``widths`` caps columns (longer cells are clipped)."""
    if widths is not None:
        rows = [[_clip(c, w) for c, w in zip(r, widths, strict=True)] for r in rows]
    cols = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, cols, strict=True)).rstrip() for r in rows]


@attrs.frozen
class LegalityReport:
    """The outcome of :func:`check_model` for one march. ``str(report)`` is the printout."""

    march: str
    findings: tuple[Violation, ...]
    checked: int
    cpu_nodes: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    advice: int = 0
    #: hybrid models: the CPU placements (``target (n calls): reason``), not checked against the march
    hybrid_cpu: tuple[str, ...] = ()
    #: a model fx cannot trace: what the path checked (recorded on the example inputs) fixes
    specialized: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """No operator is unsupported and no checkable rule fails (unknowns do not count)."""
        return not self.violations

    @property
    def violations(self) -> tuple[Violation, ...]:
        """Errors: rules that fail and operators the march does not support."""
        return tuple(f for f in self.findings if f.kind in ERROR_KINDS)

    @property
    def unsupported(self) -> tuple[Violation, ...]:
        return tuple(f for f in self.findings if f.kind == UNSUPPORTED)

    @property
    def advisories(self) -> tuple[Violation, ...]:
        return tuple(f for f in self.findings if f.kind == ADVISORY)

    @property
    def unknown(self) -> tuple[Violation, ...]:
        """Nodes the tables give no answer for, and rules whose facts the graph lacks."""
        return tuple(f for f in self.findings if f.kind in (UNKNOWN, UNCHECKED))

    def for_module(self, name: str) -> tuple[Violation, ...]:
        return tuple(f for f in self.findings if f.module == name)

    def __str__(self) -> str:
        errors, unknown, adv = self.violations, self.unknown, self.advisories
        verdict = "PASSED" if self.ok else "FAILED"
        head = (
            f"qir check_model: march {self.march}: {verdict} - {len(errors)} error(s), {len(unknown)} unknown, "
            f"{len(adv)} advisory note(s); {self.checked} node(s) checked"
        )
        if self.cpu_nodes:
            head += f", {len(self.cpu_nodes)} outside the quantized region (CPU)"
        lines = [head]
        if self.specialized:
            lines += ["", "Checked the path the forward took on the example inputs:"]
            lines += [f"  - {s}" for s in self.specialized]
        if self.hybrid_cpu:
            lines += ["", "Placed on the CPU (hybrid; float, not checked against the march):"]
            lines += [f"  {h}" for h in self.hybrid_cpu]
        if errors:
            lines += ["", "Errors:"]
            lines += self._rows(errors)
        if unknown:
            lines += ["", "Unknown (the tables give no answer; not counted as errors):"]
            lines += self._rows(unknown)
        if adv:
            lines += ["", "Advisories (stated by the tables, not checkable; grouped by rule):"]
            lines += self._advisory_rows(adv)
        if self.notes:
            lines += ["", f"Notes for every operator on {self.march}:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)

    def _rows(self, items: Sequence[Violation]) -> list[str]:
        header = ["kind", "node", "module", "operator", "rule", "actual", "bound"]
        rows = [header] + [
            [f.kind, f"%{f.node}", f.module or "-", f.spelling, f.rule, _show(f.actual), _show(f.bound)] for f in items
        ]
        table = _table(rows, widths=[11, 28, 28, 36, 48, 16, 16])
        out = [table[0]]
        for f, line in zip(items, table[1:], strict=True):
            out.append(line)
            out += [f"      fix: {a}" for a in f.advice]
            if self.advice >= 2 and f.facts:
                out.append("      facts: " + ", ".join(f"{k}={_show(v)}" for k, v in sorted(f.facts.items())))
        return out

    def _advisory_rows(self, items: Sequence[Violation]) -> list[str]:
        groups: dict[tuple[str, str], list[Violation]] = {}
        for f in items:
            groups.setdefault((f.spelling, f.rule), []).append(f)
        rows = [["operator", "nodes", "advisory"]]
        fixes: list[tuple[str, ...]] = []
        for (spelling, rule), fs in groups.items():
            names = [f.module or f"%{f.node}" for f in fs]
            shown = ", ".join(names[:3]) + (f", +{len(names) - 3} more" if len(names) > 3 else "")
            rows.append([spelling, shown, rule])
            fixes.append(fs[0].advice)
        table = _table(rows, widths=[36, 50, 90])
        out = [table[0]]
        for line, adv in zip(table[1:], fixes, strict=True):
            out.append(line)
            out += [f"      fix: {a}" for a in adv]
        return out


# ----------------------------------------------------------------------------- advice


def _hybrid(f: Finding) -> str:
    if f.scope:
        return (
            f"run it on the CPU (hybrid: prepare_qat_fx(..., hybrid=True, "
            f"hybrid_dict={{'module_name': ['{f.scope}']}}))"
        )
    return (
        f"run it on the CPU: put a DeQuantStub before and a QuantStub after %{f.node}, or wrap it in a module "
        f"and name that module in prepare_qat_fx(..., hybrid=True, hybrid_dict={{'module_name': [...]}})"
    )


def _alt_check(table: Any, spelling: str, facts: dict[str, Any]) -> list[str] | None:
    """Rule texts the alternative row breaks with ``facts`` (None: the march lacks the row)."""
    entry = table.get(spelling)
    if entry is None or not entry.supported:
        return None
    return [r.text or str(r) for r in entry.checks() if r.check(facts).ok is False]


def _linear_as_conv(f: Finding, table: Any) -> str | None:
    facts = f.facts
    cin, cout = facts.get("in_features"), facts.get("out_features")
    if cin is None or cout is None:
        return None
    keep = ("input_dtype", "output_dtype", "weight_dtype", "has_bias", "bias_dtype", "is_model_output")
    conv: dict[str, Any] = {k: facts[k] for k in keep if k in facts}
    conv.update(
        in_channels=cin,
        out_channels=cout,
        weight_n=cout,
        weight_c=cin,
        weight_h=1,
        weight_w=1,
        kernel=(1, 1),
        stride=(1, 1),
        padding=(0, 0),
        dilation=(1, 1),
        groups=1,
        sumin=False,
    )
    broken = _alt_check(table, "torch.nn.Conv2d", conv)
    if broken is None:
        return None
    text = (
        f"use Conv2d 1x1 instead of Linear: nn.Conv2d({cin}, {cout}, kernel_size=1) on an (N, {cin}, 1, 1) "
        f"input (drop the flatten before it; copy weight.view({cout}, {cin}, 1, 1))"
    )
    return text + (f" - but it breaks: {'; '.join(broken)}" if broken else "")


def _adaptive_as_avgpool(f: Finding, table: Any) -> str | None:
    facts = f.facts
    h, w, kernel = facts.get("input_h"), facts.get("input_w"), facts.get("kernel")
    if h is None or w is None or kernel is None:
        return None
    keep = ("input_dtype", "output_dtype", "input_c", "input_h", "input_w")
    pool: dict[str, Any] = {k: facts[k] for k in keep if k in facts}
    pool.update(kernel=tuple(kernel), stride=tuple(kernel), padding=(0, 0))
    broken = _alt_check(table, "torch.nn.AvgPool2d", pool)
    if broken is None:
        return None
    k = tuple(kernel)
    text = (
        f"AvgPool2d with kernel=H,W instead of AdaptiveAvgPool2d: nn.AvgPool2d(kernel_size={k}, stride={k}) "
        f"gives the same result on this {h}x{w} input"
    )
    if not broken:
        return text
    entry = table.get("torch.nn.AvgPool2d")
    steps = _pool_steps_advice(
        attrs.evolve(f, spelling=entry.spelling, fields=("kernel",), facts=pool, bound=_kernel_range(entry))
    )
    return text + f" - but it breaks: {'; '.join(broken)}" + (f"; {steps}" if steps else "")


#: Operators a march lacks -> a supported spelling that computes the same, checked on the
#: march before it is offered.
_ALTERNATIVES: dict[str, Callable[[Finding, Any], str | None]] = {
    "torch.nn.Linear": _linear_as_conv,
    "torch.nn.AdaptiveAvgPool2d": _adaptive_as_avgpool,
}


def _split_advice(f: Finding) -> str | None:
    fields = [x for x in f.fields if x in _CHANNEL_FACTS]
    actual, bound = f.actual, f.bound
    if not fields or not isinstance(actual, (int, float)) or not isinstance(bound, (int, float)) or bound <= 0:
        return None
    what = _CHANNEL_FACTS[fields[0]]
    limit = int(bound) - (1 if f.check.split(" ")[1:2] == ["<"] else 0)
    parts = math.ceil(actual / limit)
    each = math.ceil(actual / parts)
    layer = f.spelling.rsplit(".", 1)[-1]
    if what.startswith("output"):
        how = f"{parts} {layer}s of {each} {what} each, concatenated along C (FloatFunctional.cat)"
    else:
        how = f"{parts} {layer}s over slices of {each} {what}, summed (FloatFunctional.add)"
    return f"split the layer: {what} {_show(actual)} > {_show(limit)} -> {how}"


def _kernel_range(entry: Any) -> tuple[Any, Any] | None:
    """(low, high) of the row's range rule on ``kernel``, if it has one."""
    for rule in entry.checks():
        low, high = getattr(rule, "low", None), getattr(rule, "high", None)
        if "kernel" in rule.fields() and low is not None and high is not None:
            return (getattr(low, "value", low), getattr(high, "value", high))
    return None


def _factor(n: int, limit: int) -> list[int] | None:
    """``n`` as a product of factors each <= ``limit`` (largest first), or None when a prime factor exceeds it."""
    out: list[int] = []
    while n > limit:
        d = next((d for d in range(limit, 1, -1) if n % d == 0), None)
        if d is None:
            return None
        out.append(d)
        n //= d
    return out + ([n] if n > 1 or not out else [])


def _pool_steps_advice(f: Finding) -> str | None:
    """A too-large pooling window with stride = kernel equals pooling in steps whose kernels multiply to it."""
    facts = f.facts
    kernel, stride, padding = facts.get("kernel"), facts.get("stride"), facts.get("padding") or ()
    if "kernel" not in f.fields or kernel is None or not isinstance(f.bound, tuple):
        return None
    if tuple(kernel) != tuple(stride or ()) or any(p != 0 for p in padding):
        return None
    limit = int(f.bound[1])
    steps = [_factor(int(k), limit) for k in kernel]
    if any(s is None for s in steps):
        return None
    n = max(len(s) for s in steps if s is not None)
    padded = [(s or []) + [1] * (n - len(s or [])) for s in steps]
    chain = " then ".join(f"{f.spelling.rsplit('.', 1)[-1]}({tuple(p[i] for p in padded)})" for i in range(n))
    return f"pool in steps: {chain} (same result: windows of {tuple(kernel)} with stride = kernel)"


def _dtype_advice(f: Finding) -> str | None:
    if not f.fields or not all(x.endswith("_dtype") for x in f.fields) or not isinstance(f.bound, tuple):
        return None
    allowed = ", ".join(str(b) for b in f.bound)
    who = f"'{f.scope}'" if f.scope else f"%{f.node}"
    if f.fields == ("output_dtype",) and f.actual == "qint32":
        return (
            f"{f.spelling} cannot give a high-precision qint32 output on this march (it takes {allowed}): "
            f"give {who} get_default_qat_qconfig() instead of get_default_qat_out_qconfig()"
        )
    return f"{f.fields[0]} is {f.actual}; the march takes {allowed}: give {who} a qconfig that produces {f.bound[0]}"


def _int16_advice(f: Finding) -> str | None:
    entry = f.entry
    text = f.rule.lower()
    precision = any(w in text for w in _PRECISION_WORDS) or "input_abs_max" in f.fields
    ins = getattr(entry, "input_dtypes", None) or ()
    if precision and "qint16" in ins and f.facts.get("input_dtype") == "qint8":
        who = f"'{f.scope}'" if f.scope else f"%{f.node}"
        return (
            f"use qint16 instead of qint8 for {who} (qconfig default_qat_16bit_fake_quant_qconfig): "
            "the row takes qint16"
        )
    return None


def _eager_advice(f: Finding) -> str | None:
    entry = f.entry
    repl = [r for r in getattr(entry, "eager_replacement", ()) if r.startswith("qir.nn.") and "quantized" not in r]
    if repl and f.scope is None:
        return f"in eager mode use {repl[0]}() instead of {f.spelling}"
    return None


def advise(f: Finding, table: Any) -> tuple[str, ...]:
    """Suggested fixes for one finding, most specific first."""
    out: list[str] = []
    if f.kind == UNSUPPORTED:
        alt = _ALTERNATIVES.get(f.spelling)
        text = alt(f, table) if alt is not None else None
        if text:
            out.append(text)
        out.append(_hybrid(f))
    elif f.kind == VIOLATION:
        for fn in (_split_advice, _pool_steps_advice, _dtype_advice, _int16_advice):
            text = fn(f)
            if text:
                out.append(text)
        if not out:
            out.append(f"change %{f.node} so that {f.check} holds ({', '.join(f.fields)} is {_show(f.actual)})")
    elif f.kind == ADVISORY:
        text = _int16_advice(f)
        if text:
            out.append(text)
    elif f.kind == UNKNOWN and f.rule == AMBIGUOUS_RULE:
        out.append(f"call it the way the march supports: {f.message}")
    elif f.kind == UNKNOWN:
        out.append(
            f"the {table.march} tables do not list {f.spelling}: confirm with the compiler; if it refuses, "
            + _hybrid(f)
        )
    elif f.kind == UNCHECKED:
        out.append(f"check '{f.rule}' by hand: {f.message}")
        text = _int16_advice(f)
        if text:
            out.append(text)
    eager = _eager_advice(f)
    if eager:
        out.append(eager)
    return tuple(out)


# ----------------------------------------------------------------------------- qir's modules


def _conv_view(m: Any) -> nn.Module:
    """The float conv / linear an integer conv module was converted from (on the meta device)."""
    w, hp = m.weight, m.hp
    kind: type[nn.Module] = getattr(nn, m.kind)
    bias = getattr(m, "bias", None) is not None
    if kind is nn.Linear:
        return nn.Linear(w.shape[1], w.shape[0], bias=bias, device="meta")
    groups = hp.get("groups") or 1
    transposed = m.kind.startswith("ConvTranspose")
    cin, cout = (w.shape[0], w.shape[1] * groups) if transposed else (w.shape[1] * groups, w.shape[0])
    kw = {k: hp[k] for k in ("stride", "padding", "dilation") if hp.get(k) is not None}
    if transposed and hp.get("output_padding") is not None:
        kw["output_padding"] = hp["output_padding"]
    return kind(cin, cout, tuple(w.shape[2:]), groups=groups, bias=bias, device="meta", **kw)


def qir_module_view(m: nn.Module) -> nn.Module | type | None:
    """The float module (or class) one of qir's QAT / integer modules stands for, or None.

    Registered with :func:`passes.legality_facts.register_module_view`, so the legality
    pass finds the table rows of converted and QAT models.
    """
    mod = type(m).__module__
    if not (mod.startswith("qir.nn.qat") or mod.startswith("qir.nn.quantized") or mod.startswith("qir.nn.modules")):
        return None
    from qir.nn import qat, quantized
    from qir.nn.modules.interpolate import Interpolate
    from qir.nn.modules.unary import UNARY_MODULES

    name = type(m).__name__
    if isinstance(m, quantized.QuantizedConvBase):
        return _conv_view(m)
    if isinstance(m, (qat.QuantStub, quantized.QuantStub)):
        return torch.ao.quantization.QuantStub
    if isinstance(m, (qat.DeQuantStub, quantized.DeQuantStub)):
        return torch.ao.quantization.DeQuantStub
    if isinstance(m, qat.UnaryLUT):
        return m.function_module
    if isinstance(m, quantized.UnaryLUT):
        cls = UNARY_MODULES.get(m.op_name) or getattr(nn, m.op_name, None)
        return cls if isinstance(cls, type) else None
    if isinstance(m, (Interpolate, quantized.Interpolate)):
        return nn.Upsample(size=m.size, scale_factor=m.scale_factor, mode=m.mode, align_corners=m.align_corners)
    if isinstance(m, quantized.MaxPool2d):
        return nn.MaxPool2d(m.kernel_size, m.stride, m.padding, m.dilation, ceil_mode=m.ceil_mode)
    if isinstance(m, quantized.AvgPool2d):
        return nn.AvgPool2d(m.kernel_size, m.stride, m.padding, m.ceil_mode, m.count_include_pad, m.divisor_override)
    if isinstance(m, quantized.AdaptiveAvgPool2d):
        return nn.AdaptiveAvgPool2d(m.output_size)
    plain = {"ReLU": nn.ReLU, "ReLU6": nn.ReLU6, "Identity": nn.Identity}
    if isinstance(m, quantized.QuantizedModule) and name in plain:
        return plain[name]()
    if name == "Div":
        from qir.nn.modules.binary import Div

        return Div
    return None


register_module_view(qir_module_view)


# ----------------------------------------------------------------------------- entry point


def _to_violation(f: Finding, table: Any, advice: int) -> Violation:
    shown = f.facts if not f.fields else {k: f.facts[k] for k in f.fields if k in f.facts}
    return Violation(
        kind=f.kind,
        node=f.node,
        module=f.scope,
        op=f.op,
        spelling=f.spelling,
        rule=f.rule,
        check=f.check,
        actual=f.actual,
        bound=f.bound,
        message=f.message,
        advice=advise(f, table) if advice else (),
        facts=shown,
    )


def report_from_result(result: LegalityResult, advice: int = 0) -> LegalityReport:
    """Turn a ``legalize`` pass result into a report (with fixes when ``advice``)."""
    table = get_table(result.march)
    findings = tuple(_to_violation(f, table, advice) for f in result.findings)
    return LegalityReport(result.march, findings, result.checked, result.cpu_nodes, result.notes, advice)


def check_model(
    model: nn.Module,
    example_input: Any,
    march: Any = None,
    advice: int | bool | None = None,
) -> LegalityReport:
    """Check that every operator of ``model`` runs on ``march``'s BPU.

    ``model`` is a float, fused, QAT or converted ``nn.Module`` (not modified; a model in
    training mode is checked as a copy in eval mode, as it will be deployed).
    ``example_input`` is a tensor or a dict (the forward's one argument) or a tuple of the
    forward's positional arguments. ``march`` defaults to
    ``qir.march.get_march()``. With ``advice`` (truthy, or a level) each finding carries
    suggested fixes and the report is printed. Returns a :class:`LegalityReport`;
    ``report.ok`` is False when an operator is unsupported or a rule fails.

    A hybrid model's CPU placements (``prepare_qat_fx(..., hybrid=True)``) run in float:
    the report lists them (``report.hybrid_cpu``) and checks only the BPU operators.

    ``model`` may also be a ``torch.jit.trace`` of the module, as the seeds call it: the report is
    about the traced module, found by the tensors the trace shares with it
    (:mod:`qir.quantization.jit_source`), so nodes keep their module paths.
    """
    if isinstance(model, torch.jit.ScriptFunction):
        raise TypeError("check_model needs a module or its torch.jit.trace, not a TorchScript function")
    if isinstance(model, torch.jit.ScriptModule):
        model = traced_original(model, "check_model")
    if not isinstance(model, nn.Module):
        raise TypeError(f"check_model needs an nn.Module, got {type(model).__name__}")
    name = resolve_march(march)
    subject = model
    if model.training:
        subject = copy.deepcopy(model).eval()  # check what is deployed; the user's model keeps its mode
    graph, spec = trace_or_record(subject, example_input)
    ctx = PassContext()
    run_pipeline(graph, Legalize(march=name), ctx=ctx, inplace=True)
    result: LegalityResult = ctx.options[RESULT_KEY]
    result = _at_layer_paths(result, model)
    report = report_from_result(result, int(advice or 0))
    if spec is not None:
        report = attrs.evolve(report, specialized=tuple(spec.lines()))
    plan = hybrid_plan_of(model)
    if plan is not None:
        report = _with_hybrid(report, plan)
    if advice:
        print(report)
    return report


def _at_layer_paths(result: LegalityResult, model: nn.Module) -> LegalityResult:
    """Findings on a fused layer that lives at another module's path, named by the layer.

    ``fuse_fx`` puts a conv / linear fused with the FloatFunctional add after it into the add's
    slot (``add`` holds ``LinearAdd``, ``fc`` becomes Identity); the report names the conv / linear
    the user wrote (``fc``, as the float model's report does), so the row and its fixes point at
    the layer whose operator it lists.
    """
    record = getattr(model, "meta", {}).get(FUSER_RECORD_KEY)
    sources = getattr(record, "sources", None)
    if not isinstance(sources, dict):
        return result

    def layer(scope: str | None) -> str | None:
        parts = sources.get(scope) if scope is not None else None
        return str(parts[0]) if isinstance(parts, list) and parts else scope

    findings = tuple(f if layer(f.scope) == f.scope else attrs.evolve(f, scope=layer(f.scope)) for f in result.findings)
    return attrs.evolve(result, findings=findings)


def _with_hybrid(report: LegalityReport, plan: HybridPlan) -> LegalityReport:
    """A hybrid model's CPU modules run in float: listed as CPU placements, never as findings."""
    cpu = plan.on(CPU)
    targets = {p.target for p in cpu}

    def on_cpu(module: str | None) -> bool:
        return module is not None and any(module == t or module.startswith(t + ".") for t in targets)

    rows: dict[str, tuple[int, str]] = {}
    for p in cpu:
        count, _ = rows.get(p.target, (0, p.reason))
        rows[p.target] = (count + 1, p.reason)
    lines = tuple(f"{t} ({n} call{'s' if n > 1 else ''}): {why}" for t, (n, why) in rows.items())
    return attrs.evolve(report, findings=tuple(f for f in report.findings if not on_cpu(f.module)), hybrid_cpu=lines)
