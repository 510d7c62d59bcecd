"""Operator coverage: for every row of the operator tables, which stage of qir handles it.

Generated from the live registries, never from a hand-kept list (it reads qir.nn's module maps
and qir.quantization's conversion tables, so it lives with the command-line tools, above the backends):

* **IR op**: an op in ``qir.ir.OP_REGISTRY`` whose torch spellings (``functions``,
  ``methods``, ``module_types``, ``function_names``) include the row's spelling;
* **QAT** / **quantized**: what ``prepare_qat_fx`` / ``convert_fx`` make of it:
  ``qir.nn.QAT_MODULE_MAP`` / ``QUANTIZED_MODULE_MAP`` for module classes; for functions,
  the generated module of ``qir.quantization.functional_swap.FUNCTIONAL_MODULES``, the
  generated ``FloatFunctional`` method (``qir.quantization.fuse``), or convert's list of
  scale-preserving calls that run on codes as written, or the ops on codes convert gives an
  integer form (``qir.quantization.code_convert.CONVERTED_FORMS``); else the row's eager
  replacement (``qir.nn.Exp``) when qir has it;
* **lowering**: a rule in ``backends.common.lower``'s registries: an op rule for the IR op
  the spelling becomes, or a legacy rule for the quantized module, ``QFunctional`` method,
  function or tensor method;
* **bernoulli2** / **bayes**: the row's support in the march's operator table.

``python -m qir.cli.coverage docs/coverage.md`` rewrites the generated block of
the page; ``tests/docs/test_coverage_doc.py`` fails while it is stale.
"""

from __future__ import annotations

import importlib
import operator
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.common.optable import MARCHES, OpEntry, generated_block, load_table, torch_spelling

__all__ = ["CoverageRow", "coverage_rows", "coverage_table_markdown", "update_doc"]

BLOCK = "operator-coverage"


@dataclass(frozen=True)
class CoverageRow:
    spelling: str
    section: str
    ir_op: str | None  # the IR op the spelling becomes (None: no op in the registry)
    qat: str | None  # how prepare_qat_fx handles it
    quantized: str | None  # how convert_fx handles it
    lowering: bool  # a lowering rule exists for what convert_fx produces
    support: tuple[str, ...]  # per march, in MARCHES order


def _spelling_ops() -> dict[str, str]:
    """Torch spelling -> IR op name, from the op registry."""
    import qir.ir.ops  # noqa: F401  (registers every op)
    from qir.ir import OP_REGISTRY

    out: dict[str, str] = {}
    for name, cls in sorted(OP_REGISTRY.items()):
        spellings = [torch_spelling(f) for f in getattr(cls, "functions", ())]
        spellings += [torch_spelling(m) for m in getattr(cls, "methods", ())]
        spellings += [torch_spelling(t) for t in getattr(cls, "module_types", ())]
        spellings += list(getattr(cls, "function_names", ()))
        for s in spellings:
            out.setdefault(s, name)
    return out


def _resolve(spelling: str) -> Any:
    """The torch object a spelling names: a class, a function, a Tensor method name, or None."""
    if spelling == torch_spelling(operator.getitem):
        return operator.getitem
    if spelling.startswith("torch.Tensor."):
        return spelling.removeprefix("torch.Tensor.")
    module, _, attr = spelling.rpartition(".")
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    if hasattr(mod, attr):
        return getattr(mod, attr)
    # the source tables' capitalisation may differ from torch's (torch.nn.HardSigmoid)
    return next((getattr(mod, a) for a in dir(mod) if a.lower() == attr.lower()), None)


def _qir_object(path: str) -> Any:
    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def _module_rule(cls: type, march: str) -> bool:
    from backends.common import lower

    return any((m, c) in lower._MODULE_RULES for c in cls.__mro__ for m in (march, "*"))


def _rule(table: dict[tuple[str, Any], Any], key: Any, march: str) -> bool:
    try:
        return (march, key) in table or ("*", key) in table
    except TypeError:
        return False


def _functional_route(op_name: str, obj: Any) -> tuple[str | None, str | None, list[tuple[str, Any]]]:
    """(qat, quantized, lowering keys) for a function or Tensor-method spelling."""
    from torch import nn

    from qir.nn import QAT_MODULE_MAP, QUANTIZED_MODULE_MAP
    from qir.nn.modules.unary import UNARY_MODULES
    from qir.nn.qat import FloatFunctional as QatFF
    from qir.nn.quantized import QFunctional
    from qir.quantization.functional_swap import FUNCTIONAL_MODULES

    convert = importlib.import_module("qir.quantization.convert")  # the package exports a function of that name
    fuse = importlib.import_module("qir.quantization.fuse")

    module_cls: type | None = None
    factory = FUNCTIONAL_MODULES.get(op_name)
    if factory is not None:
        fname = getattr(factory, "__name__", "")
        if fname.startswith("qir_nn_"):
            module_cls = UNARY_MODULES.get(fname.removeprefix("qir_nn_"))
        elif op_name == "interpolate":
            from qir.nn import Interpolate

            module_cls = Interpolate
        elif op_name == "grid_sample":
            from qir.nn import GridSample

            module_cls = GridSample
        elif op_name in ("pow", "square"):
            from qir.nn import Pow

            module_cls = Pow
        else:
            from qir.ir import OP_REGISTRY

            types = getattr(OP_REGISTRY[op_name], "module_types", ())
            module_cls = types[0] if types else None
    elif op_name in fuse.MODULE_FUNCTIONALS:
        from qir.ir import OP_REGISTRY

        types = getattr(OP_REGISTRY[op_name], "module_types", ())
        module_cls = types[0] if types else None
    if module_cls is not None and module_cls in QAT_MODULE_MAP:
        qat = QAT_MODULE_MAP[module_cls]
        q = QUANTIZED_MODULE_MAP.get(qat)
        kind = "generated" if factory is not None or op_name in fuse.MODULE_FUNCTIONALS else "module"
        return (
            f"{kind} `{module_cls.__name__}` → `qat.{qat.__name__}`",
            f"`{q.__name__}`" if q else None,
            [("module", q)] if q else [],
        )
    ff_tables = (fuse._TWO_TENSOR, fuse._SEQUENCE, fuse._UNARY)
    method = next((t[op_name] for t in ff_tables if op_name in t), None)
    if method is not None and hasattr(QatFF, method):
        quantized = f"`QFunctional.{method}`" if hasattr(QFunctional, method) else None
        return f"generated `FloatFunctional.{method}`", quantized, [("functional", method)]
    code_convert = importlib.import_module("qir.quantization.code_convert")
    if op_name in code_convert.CONVERTED_FORMS:  # ops on codes: kept, given an integer form at conversion
        scale_ops = importlib.import_module("qir.quantization.scale_ops")
        kept = scale_ops.CODE_OPS[op_name] in (scale_ops.CODES, scale_ops.REDUCE, scale_ops.PAIR)
        return (
            "kept (scale-preserving)" if kept else "kept (exact on codes)",
            "runs on codes",
            list(code_convert.CONVERTED_FORMS[op_name]),
        )
    preserving = (
        (obj in convert._PRESERVING_FUNCTIONS) if not isinstance(obj, str) else (obj in convert._PRESERVING_METHODS)
    )
    if preserving:
        keys: list[tuple[str, Any]] = [("method", obj)] if isinstance(obj, str) else [("function", obj)]
        if obj in (nn.functional.relu6, nn.functional.hardtanh):
            keys = [("function", convert.relu6_codes)]
        elif obj is nn.functional.interpolate:
            keys = [("function", convert.nearest_interpolate_codes)]
        return "kept (scale-preserving)", "runs on codes", keys
    return None, None, []


def _route(entry: OpEntry, ir_op: str | None) -> tuple[str | None, str | None, list[tuple[str, Any]]]:
    from qir.nn import QAT_MODULE_MAP, QUANTIZED_MODULE_MAP

    convert = importlib.import_module("qir.quantization.convert")
    qat_classes = importlib.import_module("qir.quantization.qat_classes")
    optional = qat_classes.optional_qat_class(entry.spelling)  # torchvision's, whether installed or not
    if optional is not None:
        q = QUANTIZED_MODULE_MAP.get(optional)
        return f"`qat.{optional.__name__}`", (f"`{q.__name__}`" if q else None), ([("module", q)] if q else [])
    obj = _resolve(entry.spelling)
    if isinstance(obj, type):
        if obj in QAT_MODULE_MAP:
            qat = QAT_MODULE_MAP[obj]
            q = QUANTIZED_MODULE_MAP.get(qat)
            return f"`qat.{qat.__name__}`", (f"`{q.__name__}`" if q else None), ([("module", q)] if q else [])
        if obj in convert._PRESERVING_MODULES:
            return "kept (scale-preserving)", "runs on codes", [("module", obj)]
        if ir_op == "batch_norm":
            from torch import nn

            from qir.nn.quantized import Conv2d

            bn_qat = "folded into the conv (fuse)"
            if obj in (nn.BatchNorm2d, nn.SyncBatchNorm):  # passes/standalone_bn.py: 4-d inputs
                bn_qat += "; alone: a depthwise 1x1 `qat.Conv2d`"
            return bn_qat, "in the conv", [("module", Conv2d)]
    elif obj is not None and ir_op is not None:
        route = _functional_route(ir_op, obj)
        if route[0] is not None:
            return route
    for path in entry.eager_replacement:  # eager mode: the row's replacement module, when qir has it
        cls = _qir_object(path) if path.startswith("qir.") else None
        if isinstance(cls, type) and cls in QAT_MODULE_MAP and "FloatFunctional" not in path:
            qat = QAT_MODULE_MAP[cls]
            q = QUANTIZED_MODULE_MAP.get(qat)
            return (
                f"eager `{path}` → `qat.{qat.__name__}`",
                (f"`{q.__name__}`" if q else None),
                ([("module", q)] if q else []),
            )
    return None, None, []


def _ir_op(kind: str, key: Any) -> str | None:
    """The IR op the front end makes of a module class, function or tensor method (the first registered)."""
    import builtins

    from qir.ir import OP_REGISTRY

    if kind == "functional":  # a QFunctional method: the integer op registered for it
        for name, cls in OP_REGISTRY.items():
            if key in getattr(cls, "ff_methods", ()):
                return name
        return None
    if kind == "function" and key in (operator.getitem, builtins.getattr):  # the front end's own two
        return "getitem" if key is operator.getitem else "getattr"
    for name, cls in OP_REGISTRY.items():
        if kind == "module" and key in getattr(cls, "module_types", ()):
            return name
        if kind == "function" and any(f is key for f in getattr(cls, "functions", ())):
            return name
        if kind == "method" and key in getattr(cls, "methods", ()):
            return name
    return None


def _lowered(keys: list[tuple[str, Any]]) -> bool:
    """Every key has a rule on every march: a legacy rule for the spelling itself, or an op rule
    for the IR op the spelling becomes."""
    import backends.common.lower_rules  # registers the common rules
    import backends.common.lower_rules_yuv  # noqa: F401  (centered YUV to RGB)
    from backends.common import lower

    for march in MARCHES:  # each march's package registers the op rules it lowers with (rules.py)
        importlib.import_module(f"backends.{march}")
    if not keys:
        return False
    tables = {"function": lower._FUNCTION_RULES, "method": lower._METHOD_RULES}
    for kind, key in keys:
        op = _ir_op(kind, key)
        for march in MARCHES:
            lower.get_kernel_policy(march)  # loads the march's backend: its op rules
            if kind == "functional":  # a QFunctional method: the integer op it traces to
                ok = False
            elif kind == "module":
                ok = _module_rule(key, march)
            elif kind == "function":  # by the callable or its qualified name
                ok = lower.function_rule(march, key) is not None
            else:
                ok = _rule(tables[kind], key, march)
            if not ok and (op is None or lower.op_rule(march, op) is None):
                return False
    return True


def coverage_rows() -> list[CoverageRow]:
    """One row per operator-table row, in table order."""
    tables = [load_table(m) for m in MARCHES]
    ops = _spelling_ops()
    from qir.ir import OP_REGISTRY as registry

    rows = []
    for entry in tables[0].source_entries():
        ir_op = ops.get(entry.spelling)
        if ir_op is None and entry.ir_op in registry:  # spelled differently in the registry (QuantStub: quantize)
            ir_op = entry.ir_op
        qat, quantized, keys = _route(entry, ir_op)
        support = tuple(t.lookup(entry.spelling).support.value for t in tables)
        rows.append(CoverageRow(entry.spelling, entry.section, ir_op, qat, quantized, _lowered(keys), support))
    return rows


_SUPPORT = {"supported": "yes", "not_supported": "no", "unknown": "?"}


def coverage_table_markdown() -> str:
    rows = coverage_rows()
    titles = {s.id: s.title for s in load_table(MARCHES[0]).sections}
    n = len(rows)
    out = [
        "| | rows | IR op | QAT | quantized | lowering | " + " | ".join(MARCHES) + " |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(MARCHES),
        f"| **all** | {n} | {sum(r.ir_op is not None for r in rows)} | {sum(r.qat is not None for r in rows)} | "
        f"{sum(r.quantized is not None for r in rows)} | {sum(r.lowering for r in rows)} | "
        + " | ".join(str(sum(r.support[i] == "supported" for r in rows)) for i in range(len(MARCHES)))
        + " |",
        "",
    ]
    section = None
    for r in rows:
        if r.section != section:
            section = r.section
            out += [
                f"#### {titles.get(section, section)}",
                "",
                "| Operator | IR op | QAT | quantized | lowering | " + " | ".join(MARCHES) + " |",
                "|---|---|---|---|---|" + "---|" * len(MARCHES),
            ]
        cells = [
            f"`{r.spelling}`",
            f"`{r.ir_op}`" if r.ir_op else "—",
            r.qat or "—",
            r.quantized or "—",
            "yes" if r.lowering else "—",
            *(_SUPPORT[s] for s in r.support),
        ]
        out.append("| " + " | ".join(cells) + " |")
        nxt = rows.index(r) + 1
        if nxt == len(rows) or rows[nxt].section != section:
            out.append("")
    return "\n".join(out)


def update_doc(path: str | Path) -> bool:
    """Rewrite the generated block of ``path``; returns whether it changed."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    begin, end = f"<!-- generated:{BLOCK} begin -->", f"<!-- generated:{BLOCK} end -->"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    new = head + generated_block(BLOCK, coverage_table_markdown()) + tail
    if new != text:
        p.write_text(new, encoding="utf-8")
    return new != text


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{arg}: {'updated' if update_doc(arg) else 'up to date'}")
