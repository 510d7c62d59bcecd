"""``legalize{march=...}``: check every compute node against the march's operator table.

The pass reads the table a backend registered (:func:`passes.legality_registry.get_table`)
and never changes the graph. For each node it finds the table rows
(:func:`passes.legality_facts.rows_for`), builds the facts the rows' rules read
(:func:`passes.legality_facts.build_facts`) and records a :class:`Finding` for every rule
that fails, every operator the march does not support, every node the tables give no
answer for, every rule whose fact could not be built, and every advisory rule. The
:class:`LegalityResult` lands in ``ctx.options["legalize.result"]``; with ``strict=true``
a failing graph raises :class:`LegalityError`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Literal

import attrs

from passes.base import Pass, PassContext, register_pass
from passes.legality_facts import (
    MODULE_SECTION,
    Domains,
    Subject,
    boundary_kind,
    build_facts,
    compute_domains,
    fused_parts,
    part_facts,
    rows_for,
    skip_reason,
    subject_of,
)
from passes.legality_registry import get_table, normalize_march
from qir.ir.graph import Graph, Node

#: ``ctx.options`` key of the :class:`LegalityResult` of the last run.
RESULT_KEY = "legalize.result"

VIOLATION = "violation"  # a checkable rule does not hold
UNSUPPORTED = "unsupported"  # the march does not run the operator
UNKNOWN = "unknown"  # the tables give no answer (no row, "unknown" support, rows disagree)
UNCHECKED = "unchecked"  # a rule needs a fact the graph does not give
ADVISORY = "advisory"  # a constraint the tables state but nothing can check statically
#: ``Finding.rule`` of an ``unknown`` finding whose function and Tensor-method rows disagree.
AMBIGUOUS_RULE = "spellings disagree"
#: Finding kinds that make a graph illegal.
ERROR_KINDS = frozenset({VIOLATION, UNSUPPORTED})


@attrs.frozen
class Finding:
    """One thing the legality check reports about one node.

    ``ok`` is False for errors (``violation``, ``unsupported``) and None for what could not
    be decided (``unknown``, ``unchecked``, ``advisory``). ``rule`` is the table's wording,
    ``check`` the rule as the pass evaluated it (``out_channels <= 8192``), ``actual`` the
    fact value and ``bound`` what it was compared with. ``fields`` names the facts the
    failing part of the rule reads.
    """

    kind: str
    node: str
    scope: str | None
    op: str
    spelling: str
    rule: str
    check: str = ""
    actual: Any = None
    bound: Any = None
    message: str = ""
    fields: tuple[str, ...] = ()
    entry: Any = attrs.field(default=None, eq=False, repr=False)
    facts: dict[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def ok(self) -> bool | None:
        return False if self.kind in ERROR_KINDS else None

    @property
    def where(self) -> str:
        """``%node (scope)`` for messages."""
        return f"%{self.node} ({self.scope})" if self.scope else f"%{self.node}"


@attrs.frozen
class LegalityResult:
    """Everything one legality run found. ``ok`` is True when no finding is an error."""

    march: str
    findings: tuple[Finding, ...]
    checked: int
    skipped: int
    #: Nodes outside the quantized region (before a QuantStub, after a DeQuantStub): CPU work.
    cpu_nodes: tuple[str, ...] = ()
    #: The march's general rules (advisories for every operator).
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.kind in ERROR_KINDS)

    def of_kind(self, *kinds: str) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.kind in kinds)


class LegalityError(ValueError):
    """A graph breaks its march's operator table (``legalize{strict=true}``).

    The message lists every error with node, module, rule and values; ``result`` has them all.
    """

    def __init__(self, result: LegalityResult) -> None:
        self.result = result
        lines = [f"{len(result.errors)} legality error(s) on march {result.march}:"]
        for f in result.errors:
            lines.append(f"  {f.where}: {f.spelling}: {f.message}")
        super().__init__("\n".join(lines))


# ----------------------------------------------------------------------------- checking


def _rule_fields(rule: Any) -> tuple[str, ...]:
    target = getattr(rule, "require", rule)  # a conditional fails on its requirement
    return tuple(sorted(target.fields()))


def _entry_findings(subject: Subject, entry: Any, facts: dict[str, Any], march: str) -> list[Finding]:
    node = subject.node
    base = {
        "node": node.name,
        "scope": node.scope,
        "op": subject.ir_name,
        "spelling": entry.spelling,
        "entry": entry,
        "facts": facts,
    }
    support = getattr(entry.support, "value", entry.support)
    if support == "not_supported":
        repl = f"; eager replacement: {', '.join(entry.eager_replacement)}" if entry.eager_replacement else ""
        return [
            Finding(
                UNSUPPORTED,
                rule="Not supported",
                check="supported",
                message=f"{entry.spelling} is not supported on {march}{repl}",
                **base,
            )
        ]
    if support != "supported":
        why = f"it refers to {entry.refer_absent}, which the tables lack" if entry.refer_absent else "no usable answer"
        return [
            Finding(
                UNKNOWN,
                rule="support unknown",
                check="supported",
                message=f"the {march} table gives {entry.spelling} {why}",
                **base,
            )
        ]
    out: list[Finding] = []
    for rule in entry.checks():
        if not rule.checkable:
            out.append(Finding(ADVISORY, rule=rule.text, check="advisory", message=f"advisory: {rule.text}", **base))
            continue
        v = rule.check(facts)
        if v.ok is False:
            out.append(
                Finding(
                    VIOLATION,
                    rule=rule.text,
                    check=str(rule),
                    actual=v.actual,
                    bound=v.bound,
                    message=v.message,
                    fields=_rule_fields(rule),
                    **base,
                )
            )
        elif v.ok is None:
            out.append(
                Finding(
                    UNCHECKED,
                    rule=rule.text,
                    check=str(rule),
                    message=v.message,
                    fields=tuple(sorted(rule.fields())),
                    **base,
                )
            )
    return out


def _signature(findings: Iterable[Finding]) -> frozenset[tuple[str, str, str]]:
    return frozenset((f.kind, f.rule, f.check) for f in findings)


def _node_findings(
    subject: Subject, rows: tuple[Any, ...], looked_up: str, facts: dict[str, Any], march: str
) -> list[Finding]:
    node = subject.node
    if not rows:
        what = "opaque call" if subject.op is None else f"IR op {subject.ir_name}"
        return [
            Finding(
                UNKNOWN,
                node.name,
                node.scope,
                subject.ir_name,
                looked_up,
                rule="not in the tables",
                check="listed",
                message=f"{looked_up} ({what}) is not in the {march} operator tables",
                facts=facts,
            )
        ]
    per_row = [_entry_findings(subject, e, facts, march) for e in rows]
    if len({_signature(fs) for fs in per_row}) <= 1:
        return per_row[0]
    answers = "; ".join(
        f"{e.spelling}: {', '.join(sorted({f.kind for f in fs})) or 'ok'}" for e, fs in zip(rows, per_row, strict=True)
    )
    return [
        Finding(
            UNKNOWN,
            node.name,
            node.scope,
            subject.ir_name,
            " | ".join(e.spelling for e in rows),
            rule=AMBIGUOUS_RULE,
            check="one spelling",
            message=f"the graph does not record which spelling was called and the {march} rows disagree ({answers})",
            facts=facts,
        )
    ]


def _part_rows(table: Any, ir_name: str, module_form: bool) -> tuple[Any, ...]:
    rows = tuple(table.by_ir_op(ir_name))
    preferred = tuple(r for r in rows if (r.section == MODULE_SECTION) == module_form)
    return preferred[:1] or rows[:1]


def check_graph(graph: Graph, table: Any, march: str, assume_dtype: str = "qint8") -> LegalityResult:
    """Check every compute node of ``graph`` against ``table``; the graph is not changed."""
    subjects: list[tuple[Subject, tuple[Any, ...], str]] = []
    skipped = 0
    for node in graph.nodes:
        if skip_reason(node, graph) is not None:
            skipped += 1
            continue
        subject = subject_of(node, graph)
        rows, looked_up = rows_for(table, subject)
        subjects.append((subject, rows, looked_up))
    boundaries: dict[Node, str] = {}
    for subject, rows, _ in subjects:
        kind = boundary_kind(rows[0]) if len(rows) == 1 else None
        if kind is not None:
            boundaries[subject.node] = kind
    domains: Domains = compute_domains(graph, boundaries, assume_dtype)
    findings: list[Finding] = []
    cpu: list[str] = []
    for subject, rows, looked_up in subjects:
        node = subject.node
        if node not in boundaries and not domains.is_quantized(node):
            cpu.append(node.name)
            continue
        facts = build_facts(subject, graph, domains)
        findings += _node_findings(subject, rows, looked_up, facts, march)
        for ir_name, addend in fused_parts(subject):
            # the add of a fused conv is FloatFunctional.add (a function row); its activation
            # is the fused module's ReLU / ReLU6 (a module row)
            part_rows = _part_rows(table, ir_name, module_form=addend is None)
            pf = part_facts(facts, subject, addend, domains)
            findings += _node_findings(subject, part_rows, ir_name, pf, march)
    notes = tuple(r.text for r in getattr(table, "general_rules", ()))
    return LegalityResult(march, tuple(findings), len(subjects) - len(cpu), skipped, tuple(cpu), notes)


def resolve_march(march: Any, ctx: PassContext | None = None) -> str:
    """The march to check: the pass option, else ``ctx.options['march']``, else ``qir.march.get_march()``."""
    if march:
        return normalize_march(march)
    if ctx is not None and ctx.options.get("march"):
        return normalize_march(ctx.options["march"])
    from qir.march import get_march  # deferred: only when neither the option nor the context says

    return normalize_march(get_march())


def _march_option(v: Any) -> str | None:
    return None if v is None or v == "" else normalize_march(v)


@register_pass
@attrs.frozen
class Legalize(Pass):
    """Check every compute node against the march's operator table; report, never rewrite.

    Options: ``march`` (default: ``ctx.options['march']``, then ``qir.march.get_march()``),
    ``strict`` (raise :class:`LegalityError` when the graph is illegal), ``assume_dtype``
    (the dtype float values inside the quantized region are checked as, default qint8).
    The result is stored under ``ctx.options['legalize.result']``; counters
    ``legalize.errors`` / ``legalize.unknown`` / ``legalize.advisories`` go to ``ctx.stats``.
    """

    name: ClassVar[str] = "legalize"
    summary: ClassVar[str] = "check nodes against the march's operator table (reports, never rewrites)"

    march: str | None = attrs.field(default=None, converter=_march_option)
    strict: bool = False
    assume_dtype: Literal["qint8", "qint16"] = "qint8"

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        march = resolve_march(self.march, ctx)
        result = check_graph(graph, get_table(march), march, self.assume_dtype)
        ctx.options[RESULT_KEY] = result
        ctx.count("legalize.errors", len(result.errors))
        ctx.count("legalize.unknown", len(result.of_kind(UNKNOWN, UNCHECKED)))
        ctx.count("legalize.advisories", len(result.of_kind(ADVISORY)))
        if self.strict and not result.ok:
            raise LegalityError(result)
        return False
