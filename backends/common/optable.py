"""Per-march operator tables: loading, schema checks, lookup, and the coverage report.

Each march keeps its table as package data, ``backends/<march>/ops.json``: one entry per
row of the supported-operator tables, with the torch spelling, the eager-mode
replacement, support status, dtypes and the "other constraints" as rules
(:mod:`backends.common.rules`). ``docs/operators.md`` describes the format.

    table = load_table("bayes")
    entry = table.lookup("torch.nn.Conv2d")          # or table.by_ir_op("conv2d")
    bad = entry.violations({"out_channels": 9000, "is_model_output": False, ...})

Rows that say "Refer to X" are resolved when loading: the entry takes X's support,
dtypes and rules (following chains), and loading fails on a cycle or a missing X.
"""

from __future__ import annotations

import enum
import functools
import importlib.resources
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from backends.common.rules import (
    FIELDS,
    OPS,
    Advisory,
    Bound,
    Compare,
    Conditional,
    Const,
    Facts,
    Field,
    FieldBound,
    Member,
    Operand,
    Product,
    Range,
    Rule,
    Verdict,
    walk,
)

FORMAT_VERSION = 1
#: The section of rows qir adds for its own functions (not rows of Horizon's source tables).
QIR_SECTION = "qir_functional"
DTYPES = ("float32", "qint8", "qint16", "qint32", "qbool")
SAME_AS_INPUT = "same_as_input"


class OpTableError(ValueError):
    """A table file that does not follow the schema; the message names file, row and field."""


class Support(str, enum.Enum):
    SUPPORTED = "supported"
    NOT_SUPPORTED = "not_supported"
    #: The source row gives no usable answer (e.g. it refers to a row the tables lack).
    UNKNOWN = "unknown"


@attrs.frozen
class Section:
    id: str
    title: str


@attrs.frozen
class OpEntry:
    """One operator row for one march, with any "Refer to" already resolved.

    ``refer`` keeps the row's own reference; ``support``, the dtypes, ``constraints`` and
    ``rules`` are then the referenced row's (plus rules of this row, if it has any).
    ``input_dtypes``/``output_dtypes`` None means the source does not say.
    """

    spelling: str
    section: str
    row: int
    support: Support
    ir_op: str | None = None
    eager_replacement: tuple[str, ...] = ()
    input_dtypes: tuple[str, ...] | None = None
    output_dtypes: tuple[str, ...] | str | None = None
    constraints: str = ""
    rules: tuple[Rule, ...] = ()
    refer: str | None = None
    refer_absent: str | None = None
    note: str = ""
    #: How many leading ``rules`` came from the referenced row.
    inherited: int = 0

    @property
    def supported(self) -> bool:
        return self.support is Support.SUPPORTED

    def dtype_rules(self) -> tuple[Rule, ...]:
        """The dtype columns as rules on ``input_dtype`` / ``output_dtype``."""
        out: list[Rule] = []
        if self.input_dtypes is not None:
            out.append(Member(Field("input_dtype"), self.input_dtypes, text="Input: " + ", ".join(self.input_dtypes)))
        if self.output_dtypes == SAME_AS_INPUT:
            out.append(Compare(Field("output_dtype"), "==", FieldBound("input_dtype"), text="Output: Same as input"))
        elif isinstance(self.output_dtypes, tuple):
            out.append(
                Member(Field("output_dtype"), self.output_dtypes, text="Output: " + ", ".join(self.output_dtypes))
            )
        return tuple(out)

    def checks(self) -> tuple[Rule, ...]:
        """Every rule of this entry: dtype columns first, then the constraints."""
        return self.dtype_rules() + self.rules

    def check(self, facts: Facts) -> list[tuple[Rule, Verdict]]:
        return [(r, r.check(facts)) for r in self.checks()]

    def violations(self, facts: Facts) -> list[Verdict]:
        """Verdicts of the rules that do not hold (unknowns and advisories excluded)."""
        return [v for _, v in self.check(facts) if v.ok is False]


@attrs.frozen
class OpTable:
    """All operator entries of one march, indexed by torch spelling and by IR op name."""

    march: str
    source: str
    sections: tuple[Section, ...]
    notes: tuple[str, ...]
    general_rules: tuple[Rule, ...]
    entries: tuple[OpEntry, ...]
    _by_spelling: dict[str, OpEntry] = attrs.field(init=False, repr=False, eq=False)
    _by_ir: dict[str, tuple[OpEntry, ...]] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        by_ir: dict[str, list[OpEntry]] = {}
        for e in self.entries:
            if e.ir_op is not None:
                by_ir.setdefault(e.ir_op, []).append(e)
        object.__setattr__(self, "_by_spelling", {e.spelling: e for e in self.entries})
        object.__setattr__(self, "_by_ir", {k: tuple(v) for k, v in by_ir.items()})

    def __iter__(self) -> Iterator[OpEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, spelling: object) -> bool:
        return spelling in self._by_spelling

    def get(self, spelling: str) -> OpEntry | None:
        return self._by_spelling.get(canonical_spelling(spelling))

    def lookup(self, spelling: str) -> OpEntry:
        """The entry for a torch spelling (``"torch.nn.Conv2d"``); KeyError names the table."""
        entry = self.get(spelling)
        if entry is None:
            raise KeyError(f"{self.march} operator table ({self.source}) has no row for {spelling!r}")
        return entry

    def by_ir_op(self, name: str) -> tuple[OpEntry, ...]:
        """Entries whose torch spellings become IR op ``name`` (several for e.g. batch_norm)."""
        return self._by_ir.get(name, ())

    def ir_ops(self) -> frozenset[str]:
        return frozenset(self._by_ir)

    def in_section(self, section: str) -> tuple[OpEntry, ...]:
        return tuple(e for e in self.entries if e.section == section)

    def source_entries(self) -> tuple[OpEntry, ...]:
        """The rows transcribed from the source tables (every section but :data:`QIR_SECTION`)."""
        return tuple(e for e in self.entries if e.section != QIR_SECTION)


# ----------------------------------------------------------------------------- spellings

#: Python-level spellings that the tables list under another name.
_ALIASES = {
    "operator.add": "torch.add",
    "operator.sub": "torch.sub",
    "operator.mul": "torch.mul",
    "operator.truediv": "torch.div",
    "operator.matmul": "torch.matmul",
    "operator.getitem": "torch.Tensor.getitem",
    "torch.Tensor.__getitem__": "torch.Tensor.getitem",
    "torch.ao.quantization.QuantStub": "torch.quantization.QuantStub",
    "torch.ao.quantization.DeQuantStub": "torch.quantization.DeQuantStub",
}


def canonical_spelling(spelling: str) -> str:
    return _ALIASES.get(spelling, spelling)


def torch_spelling(obj: Any) -> str:
    """The table spelling of a torch callable, module class or ``Tensor`` method name.

    ``F.relu`` -> ``torch.nn.functional.relu``; ``nn.Conv2d`` (or an instance) ->
    ``torch.nn.Conv2d``; ``"reshape"`` -> ``torch.Tensor.reshape``; ``operator.add`` ->
    ``torch.add``. Unknown objects fall back to ``module.qualname``.
    """
    import torch  # deferred: loading a table does not need torch

    if isinstance(obj, str):
        return canonical_spelling(obj if "." in obj else f"torch.Tensor.{obj}")
    if isinstance(obj, torch.nn.Module):
        obj = type(obj)
    name = getattr(obj, "__name__", None)
    if name is None:
        raise TypeError(f"cannot name {obj!r} as a torch spelling")
    spaces: list[tuple[str, Any]] = [
        ("torch", torch),
        ("torch.nn.functional", torch.nn.functional),
        ("torch.nn", torch.nn),
        ("torch.quantization", torch.ao.quantization),
        ("torch.Tensor", torch.Tensor),
    ]
    for mod_name in ("torchvision.ops", "torchvision.models.detection.rpn"):
        mod = sys.modules.get(mod_name)  # only when the user already imported torchvision
        if mod is not None:
            spaces.append((mod_name, mod))
    for prefix, space in spaces:
        if getattr(space, name, None) is obj:
            return canonical_spelling(f"{prefix}.{name}")
    module = getattr(obj, "__module__", None) or "builtins"
    module = "operator" if module == "_operator" else module
    return canonical_spelling(f"{module}.{getattr(obj, '__qualname__', name)}")


# ----------------------------------------------------------------------------- parsing

_ENTRY_KEYS = {
    "spelling",
    "section",
    "ir_op",
    "eager_replacement",
    "support",
    "refer",
    "refer_absent",
    "input_dtypes",
    "output_dtypes",
    "constraints",
    "rules",
    "note",
}
_TOP_KEYS = {"march", "format", "sections", "notes", "general_rules", "operators"}


class _Ctx:
    """Where we are in the file, for error messages."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.row = ""

    def fail(self, where: str, msg: str) -> OpTableError:
        loc = f"{self.source}: {self.row}" if self.row else f"{self.source}:"
        return OpTableError(f"{loc} field {where!r}: {msg}")


def _str(ctx: _Ctx, d: Mapping[str, Any], key: str, where: str, *, required: bool = True) -> str | None:
    v = d.get(key)
    if v is None:
        if required:
            raise ctx.fail(f"{where}{key}", "missing")
        return None
    if not isinstance(v, str) or not v:
        raise ctx.fail(f"{where}{key}", f"expected a non-empty string, got {v!r}")
    return v


def _check_keys(ctx: _Ctx, d: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        raise ctx.fail(where or "<entry>", f"unknown key(s) {extra}; allowed: {sorted(allowed)}")


def _field_name(ctx: _Ctx, name: Any, where: str) -> str:
    if not isinstance(name, str) or name not in FIELDS:
        raise ctx.fail(where, f"unknown fact {name!r}; the vocabulary is backends.common.rules.FIELDS")
    return name


def _operand(ctx: _Ctx, v: Any, where: str) -> Operand:
    if isinstance(v, dict):
        _check_keys(ctx, v, {"product"}, where)
        factors = v.get("product")
        if not isinstance(factors, list) or len(factors) < 2:
            raise ctx.fail(where, "product needs a list of at least two facts")
        return Product(tuple(_field_name(ctx, f, f"{where}.product[{i}]") for i, f in enumerate(factors)))
    return Field(_field_name(ctx, v, where))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bound(ctx: _Ctx, v: Any, where: str, *, numeric: bool) -> Bound:
    if isinstance(v, dict):
        _check_keys(ctx, v, {"ref", "add", "mul", "div"}, where)
        ref = _field_name(ctx, v.get("ref"), f"{where}.ref")
        add, mul = v.get("add", 0), v.get("mul", 1)
        if not _is_number(add) or not _is_number(mul):
            raise ctx.fail(where, "add and mul must be numbers")
        div = v.get("div")
        if div is not None:
            div = _field_name(ctx, div, f"{where}.div")
        return FieldBound(ref, add, mul, div)
    if numeric and not _is_number(v):
        raise ctx.fail(where, f"expected a number or a {{'ref': fact}} bound, got {v!r}")
    if isinstance(v, list):
        v = tuple(v)
    return Const(v)


def _rule(ctx: _Ctx, d: Any, where: str, *, top: bool) -> Rule:
    if not isinstance(d, dict):
        raise ctx.fail(where, f"a rule must be an object, got {d!r}")
    text = d.get("text", "")
    if not isinstance(text, str):
        raise ctx.fail(f"{where}.text", "expected a string")
    if "advisory" in d:
        _check_keys(ctx, d, {"advisory", "reason"}, where)
        adv = _str(ctx, d, "advisory", f"{where}.")
        reason = d.get("reason", "")
        if not isinstance(reason, str):
            raise ctx.fail(f"{where}.reason", "expected a string")
        return Advisory(text=adv or "", reason=reason)
    if top and not text:
        raise ctx.fail(f"{where}.text", "a checkable rule needs the table's original wording in 'text'")
    if "when" in d or "require" in d:
        _check_keys(ctx, d, {"when", "require", "text"}, where)
        if "when" not in d or "require" not in d:
            raise ctx.fail(where, "a conditional needs both 'when' and 'require'")
        return Conditional(
            when=_rule(ctx, d["when"], f"{where}.when", top=False),
            require=_rule(ctx, d["require"], f"{where}.require", top=False),
            text=text,
        )
    if "field" not in d:
        raise ctx.fail(where, "a rule needs 'advisory', 'when'/'require', or 'field'")
    if "in" in d or "not_in" in d:
        _check_keys(ctx, d, {"field", "in", "not_in", "text"}, where)
        key = "in" if "in" in d else "not_in"
        values = d[key]
        if not isinstance(values, list) or not values:
            raise ctx.fail(f"{where}.{key}", "expected a non-empty list")
        return Member(
            Field(_field_name(ctx, d["field"], f"{where}.field")),
            tuple(tuple(x) if isinstance(x, list) else x for x in values),
            negate=key == "not_in",
            text=text,
        )
    lhs = _operand(ctx, d["field"], f"{where}.field")
    if "low" in d or "high" in d:
        _check_keys(ctx, d, {"field", "low", "high", "low_inclusive", "high_inclusive", "text"}, where)
        if "low" not in d or "high" not in d:
            raise ctx.fail(where, "a range needs both 'low' and 'high'")
        lo_inc, hi_inc = d.get("low_inclusive", True), d.get("high_inclusive", True)
        if not isinstance(lo_inc, bool) or not isinstance(hi_inc, bool):
            raise ctx.fail(where, "low_inclusive/high_inclusive must be booleans")
        low = _bound(ctx, d["low"], f"{where}.low", numeric=True)
        high = _bound(ctx, d["high"], f"{where}.high", numeric=True)
        return Range(lhs, low, high, lo_inc, hi_inc, text=text)
    _check_keys(ctx, d, {"field", "op", "value", "quantifier", "text"}, where)
    op = d.get("op")
    if op not in OPS:
        raise ctx.fail(f"{where}.op", f"unknown operator {op!r}; expected one of {sorted(OPS)}")
    if "value" not in d:
        raise ctx.fail(f"{where}.value", "missing")
    quantifier = d.get("quantifier", "all")
    if quantifier not in ("all", "any"):
        raise ctx.fail(f"{where}.quantifier", f"expected 'all' or 'any', got {quantifier!r}")
    numeric = op not in ("==", "!=") or isinstance(lhs, Product)
    return Compare(lhs, op, _bound(ctx, d["value"], f"{where}.value", numeric=numeric), quantifier, text=text)


def _rules(ctx: _Ctx, v: Any, where: str) -> tuple[Rule, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ctx.fail(where, "expected a list of rules")
    return tuple(_rule(ctx, r, f"{where}[{i}]", top=True) for i, r in enumerate(v))


def _dtypes(ctx: _Ctx, v: Any, where: str, *, same_ok: bool) -> tuple[str, ...] | str | None:
    if v is None:
        return None
    if same_ok and v == SAME_AS_INPUT:
        return SAME_AS_INPUT
    if not isinstance(v, list) or not v or any(x not in DTYPES for x in v):
        want = f"a non-empty list of {DTYPES}" + (f" or {SAME_AS_INPUT!r}" if same_ok else "")
        raise ctx.fail(where, f"expected {want}, got {v!r}")
    return tuple(v)


@attrs.frozen
class _Raw:
    """A parsed entry before "Refer to" resolution."""

    entry: OpEntry
    label: str


def _entry(ctx: _Ctx, d: Any, index: int, sections: set[str]) -> _Raw:
    if not isinstance(d, dict):
        raise ctx.fail(f"operators[{index}]", "expected an object")
    ctx.row = f"operators[{index}]"
    spelling = _str(ctx, d, "spelling", "") or ""
    ctx.row = f"operators[{index}] ({spelling})"
    _check_keys(ctx, d, _ENTRY_KEYS, "")
    section = _str(ctx, d, "section", "") or ""
    if section not in sections:
        raise ctx.fail("section", f"{section!r} is not one of the file's sections {sorted(sections)}")
    eager = d.get("eager_replacement", [])
    if not isinstance(eager, list) or any(not isinstance(x, str) for x in eager):
        raise ctx.fail("eager_replacement", "expected a list of strings")
    refer = _str(ctx, d, "refer", "", required=False)
    support_raw = d.get("support")
    if (refer is None) == (support_raw is None):
        raise ctx.fail("support", "give exactly one of 'support' and 'refer'")
    if refer is not None:
        for k in ("input_dtypes", "output_dtypes", "constraints", "refer_absent"):
            if k in d:
                raise ctx.fail(k, "a 'refer' row takes these from the referenced row")
        support = Support.UNKNOWN  # replaced on resolution
    else:
        try:
            support = Support(support_raw)
        except ValueError:
            raise ctx.fail("support", f"expected one of {[s.value for s in Support]}, got {support_raw!r}") from None
    refer_absent = _str(ctx, d, "refer_absent", "", required=False)
    if refer_absent is not None and support is not Support.UNKNOWN:
        raise ctx.fail("refer_absent", "only an 'unknown' row may name a reference the tables lack")
    rules = _rules(ctx, d.get("rules"), "rules")
    if support is Support.NOT_SUPPORTED and rules:
        raise ctx.fail("rules", "a not-supported row has no constraints")
    constraints = d.get("constraints", "")
    note = d.get("note", "")
    for k, v in (("constraints", constraints), ("note", note)):
        if not isinstance(v, str):
            raise ctx.fail(k, "expected a string")
    ir_op = d.get("ir_op")
    if ir_op is not None and (not isinstance(ir_op, str) or not ir_op):
        raise ctx.fail("ir_op", f"expected an IR op name or null, got {ir_op!r}")
    entry = OpEntry(
        spelling=spelling,
        section=section,
        row=index + 1,
        support=support,
        ir_op=ir_op,
        eager_replacement=tuple(eager),
        input_dtypes=_dtypes(ctx, d.get("input_dtypes"), "input_dtypes", same_ok=False),  # type: ignore[arg-type]
        output_dtypes=_dtypes(ctx, d.get("output_dtypes"), "output_dtypes", same_ok=True),
        constraints=constraints,
        rules=rules,
        refer=refer,
        refer_absent=refer_absent,
        note=note,
    )
    return _Raw(entry, ctx.row)


def _resolve(ctx: _Ctx, raws: Sequence[_Raw]) -> tuple[OpEntry, ...]:
    by_spelling = {r.entry.spelling: r for r in raws}
    done: dict[str, OpEntry] = {}

    def target(raw: _Raw, chain: tuple[str, ...]) -> OpEntry:
        e = raw.entry
        if e.spelling in done:
            return done[e.spelling]
        if e.refer is None:
            done[e.spelling] = e
            return e
        if e.refer in chain or e.refer == e.spelling:
            cycle = " -> ".join((*chain, e.spelling, e.refer))
            raise OpTableError(f"{ctx.source}: {raw.label} field 'refer': reference cycle {cycle}")
        nxt = by_spelling.get(e.refer)
        if nxt is None:
            raise OpTableError(
                f"{ctx.source}: {raw.label} field 'refer': no row {e.refer!r} in this table "
                "(use support 'unknown' with 'refer_absent' for references the source tables lack)"
            )
        t = target(nxt, (*chain, e.spelling))
        resolved = attrs.evolve(
            e,
            support=t.support,
            input_dtypes=t.input_dtypes,
            output_dtypes=t.output_dtypes,
            constraints=t.constraints,
            rules=t.rules + e.rules,
            refer_absent=t.refer_absent,
            inherited=len(t.rules),
        )
        done[e.spelling] = resolved
        return resolved

    return tuple(target(r, ()) for r in raws)


def parse_table(data: Any, source: str, march: str | None = None) -> OpTable:
    """Validate and build a table from decoded JSON; ``source`` names the file in errors."""
    ctx = _Ctx(source)
    if not isinstance(data, dict):
        raise ctx.fail("<top>", "expected a JSON object")
    _check_keys(ctx, data, _TOP_KEYS, "<top>")
    name = _str(ctx, data, "march", "") or ""
    if march is not None and name != march:
        raise ctx.fail("march", f"file is for march {name!r}, expected {march!r}")
    if data.get("format") != FORMAT_VERSION:
        raise ctx.fail("format", f"expected format {FORMAT_VERSION}, got {data.get('format')!r}")
    secs_raw = data.get("sections")
    if not isinstance(secs_raw, list) or not secs_raw:
        raise ctx.fail("sections", "expected a non-empty list")
    sections = []
    for i, s in enumerate(secs_raw):
        if not isinstance(s, dict):
            raise ctx.fail(f"sections[{i}]", "expected an object")
        _check_keys(ctx, s, {"id", "title"}, f"sections[{i}]")
        sid = _str(ctx, s, "id", f"sections[{i}].") or ""
        sections.append(Section(sid, _str(ctx, s, "title", f"sections[{i}].") or ""))
    notes = data.get("notes", [])
    if not isinstance(notes, list) or any(not isinstance(n, str) for n in notes):
        raise ctx.fail("notes", "expected a list of strings")
    general = _rules(ctx, data.get("general_rules"), "general_rules")
    ops = data.get("operators")
    if not isinstance(ops, list) or not ops:
        raise ctx.fail("operators", "expected a non-empty list")
    sec_ids = {s.id for s in sections}
    raws: list[_Raw] = []
    seen: dict[str, int] = {}
    for i, d in enumerate(ops):
        raw = _entry(ctx, d, i, sec_ids)
        if raw.entry.spelling in seen:
            raise ctx.fail("spelling", f"duplicate of operators[{seen[raw.entry.spelling]}]")
        seen[raw.entry.spelling] = i
        raws.append(raw)
        ctx.row = ""
    return OpTable(name, source, tuple(sections), tuple(notes), general, _resolve(ctx, raws))


def load_table_file(path: str | Path, march: str | None = None) -> OpTable:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise OpTableError(f"{p}: line {e.lineno} column {e.colno}: invalid JSON: {e.msg}") from None
    return parse_table(data, str(p), march)


@functools.cache
def load_table(march: str) -> OpTable:
    """The table shipped in ``backends/<march>/ops.json`` (parsed once per process)."""
    res = importlib.resources.files("backends").joinpath(march, "ops.json")
    if not res.is_file():
        raise OpTableError(f"no operator table for march {march!r} (looked for backends/{march}/ops.json)")
    with importlib.resources.as_file(res) as p:
        return load_table_file(p, march)


# ----------------------------------------------------------------------------- reports

MARCHES = ("bernoulli2", "bayes")


def rule_counts(table: OpTable) -> dict[str, int]:
    """Rules as written in the file (a "Refer to" row's inherited rules are not recounted)."""
    counts = {"checkable": 0, "advisory": 0}
    for e in table.entries:
        for r in e.rules[e.inherited :]:
            counts["advisory" if isinstance(r, Advisory) else "checkable"] += 1
    for r in table.general_rules:
        counts["advisory" if isinstance(r, Advisory) else "checkable"] += 1
    return counts


def _cell(e: OpEntry) -> str:
    if e.support is Support.UNKNOWN:
        return f"unknown (refers to {e.refer_absent}, absent)" if e.refer_absent else "unknown"
    word = "yes" if e.supported else "no"
    if e.supported and e.rules:
        checked = sum(1 for r in e.rules if r.checkable)
        adv = len(e.rules) - checked
        parts = [f"{checked} checked"] if checked else []
        parts += [f"{adv} advisory"] if adv else []
        word += f" ({', '.join(parts)})"
    return f"see `{e.refer}`: {word}" if e.refer else word


def coverage_markdown(marches: Sequence[str] = MARCHES) -> str:
    """The operator coverage matrix of ``docs/operators.md``, generated from the tables."""
    tables = [load_table(m) for m in marches]
    first = tables[0]
    lines = ["| Section | Rows | " + " | ".join(f"{t.march} supported" for t in tables) + " |"]
    lines.append("|---|---:|" + "---:|" * len(tables))
    for s in first.sections:
        rows = [t.in_section(s.id) for t in tables]
        counts = " | ".join(str(sum(e.supported for e in r)) for r in rows)
        lines.append(f"| {s.title} | {len(rows[0])} | {counts} |")
    total = " | ".join(str(sum(e.supported for e in t)) for t in tables)
    lines.append(f"| **all** | {len(first)} | {total} |")
    lines += ["", "| March | Checkable rules | Advisory rules |", "|---|---:|---:|"]
    for t in tables:
        c = rule_counts(t)
        lines.append(f"| {t.march} | {c['checkable']} | {c['advisory']} |")
    for s in first.sections:
        lines += ["", f"#### {s.title}", ""]
        lines.append("| Operator | IR op | " + " | ".join(t.march for t in tables) + " |")
        lines.append("|---|---|" + "---|" * len(tables))
        for e in first.in_section(s.id):
            cells = " | ".join(_cell(t.lookup(e.spelling)) for t in tables)
            lines.append(f"| `{e.spelling}` | {f'`{e.ir_op}`' if e.ir_op else '-'} | {cells} |")
    return "\n".join(lines) + "\n"


def fields_markdown() -> str:
    """The rule vocabulary table of ``docs/operators.md``, generated from :data:`FIELDS`."""
    lines = ["| Fact | Kind | Meaning |", "|---|---|---|"]
    lines += [f"| `{k}` | {v.kind} | {v.description} |" for k, v in FIELDS.items()]
    return "\n".join(lines) + "\n"


GENERATED = {"coverage": coverage_markdown, "fields": fields_markdown}


def generated_block(name: str, body: str) -> str:
    return f"<!-- generated:{name} begin -->\n{body}<!-- generated:{name} end -->"


def update_doc(path: str | Path) -> bool:
    """Rewrite the generated blocks of a markdown file; returns whether it changed."""
    p = Path(path)
    text = old = p.read_text(encoding="utf-8")
    for name, fn in GENERATED.items():
        begin, end = f"<!-- generated:{name} begin -->", f"<!-- generated:{name} end -->"
        i, j = text.find(begin), text.find(end)
        if i < 0 or j < i:
            raise ValueError(f"{p}: no generated block {name!r} (markers {begin} ... {end})")
        text = text[:i] + generated_block(name, fn()) + text[j + len(end) :]
    if text != old:
        p.write_text(text, encoding="utf-8")
    return text != old


def all_rules(table: OpTable) -> Iterator[tuple[OpEntry, Rule]]:
    """Every (entry, rule) pair with conditionals expanded, resolved references included."""
    for e in table.entries:
        for r in e.checks():
            for part in walk(r):
                yield e, part


if __name__ == "__main__":
    # python -m backends.common.optable docs/operators.md
    for arg in sys.argv[1:]:
        print(f"{arg}: {'updated' if update_doc(arg) else 'up to date'}")
