"""Attribute schemas of the integer kernels: declared once, beside each kernel, and checked on
both sides of the artifact file.

Every kernel registers a :class:`KernelSchema` (``register_kernel(op, schema=...)``): how many
inputs it takes, the constant roles it reads (with their dtypes), and every attribute it reads
with its type and range. The lowering checks each instruction it emits against it
(``LowerContext.emit``), and the artifact loader checks each instruction it reads, so a file
can only hold what the compiler could have written; an attribute the schema does not name is
refused, not ignored.

The ranges are what a real program needs with room to spare (e.g. a requantization shift in
[0, 63], a kernel size in [1, 4096]); they keep a forged attribute from turning into a huge
allocation or a division by zero inside a kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from backends.common.program import CONST_DTYPES, Instruction, ValueRef

__all__ = [
    "CODE_BOUND",
    "CODE_BOUND_OPT",
    "CODE_DTYPES",
    "DIM",
    "INT_DTYPES",
    "MAX_COUNT",
    "MAX_EXTENT",
    "MAX_INDEX",
    "MULT",
    "MULT_OPT",
    "OUT_DTYPE",
    "PAIR_PAD",
    "PAIR_POS",
    "SHIFT",
    "SHIFT_OPT",
    "Attr",
    "Const",
    "KernelSchema",
    "SchemaError",
    "boolean",
    "floating",
    "integer",
    "ints",
    "json_tree",
    "one_of",
    "optional",
    "text",
]

#: Output dtypes of code-producing kernels.
CODE_DTYPES = ("qint8", "qint16", "qint32")
#: A dimension index, a pad width, a size: generous bounds on what any real layer has.
MAX_INDEX = 64
MAX_EXTENT = 4096
MAX_COUNT = 2**20
#: Integer literals in layout-function arguments (view / reshape sizes, slice bounds).
MAX_SHAPE_LITERAL = 2**31 - 1
#: Nodes of a layout-function argument tree.
MAX_TREE_NODES = 256


class SchemaError(ValueError):
    """An instruction breaks its kernel's schema: ``field`` is the attribute path, the message the rule."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


@dataclass(frozen=True)
class Attr:
    """One attribute's rule: ``check(value)`` returns what is wrong, or None."""

    check: Callable[[Any], str | None]
    doc: str
    required: bool = True


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(lo: int, hi: int, required: bool = True) -> Attr:
    def check(v: Any) -> str | None:
        if not _is_int(v):
            return f"must be an integer, got {v!r:.40}"
        return None if lo <= v <= hi else f"{v} is outside [{lo}, {hi}]"

    return Attr(check, f"int in [{lo}, {hi}]", required)


def floating(lo: float, hi: float, required: bool = True) -> Attr:
    """A finite number in [lo, hi] (integers allowed: JSON writes 1.0 as 1.0, but users may not)."""

    def check(v: Any) -> str | None:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return f"must be a number, got {v!r:.40}"
        if not math.isfinite(v) or not lo <= v <= hi:
            return f"{v!r} is outside [{lo}, {hi}] (finite numbers only)"
        return None

    return Attr(check, f"number in [{lo}, {hi}]", required)


def boolean(required: bool = True) -> Attr:
    return Attr(lambda v: None if isinstance(v, bool) else f"must be true or false, got {v!r:.40}", "bool", required)


def one_of(*values: Any, required: bool = True) -> Attr:
    def check(v: Any) -> str | None:
        ok = any(v == x and type(v) is type(x) for x in values)
        return None if ok else f"{v!r:.40} is not one of {', '.join(repr(x) for x in values)}"

    return Attr(check, "one of " + ", ".join(repr(x) for x in values), required)


def text(max_chars: int = 256, required: bool = True) -> Attr:
    def check(v: Any) -> str | None:
        if not isinstance(v, str):
            return f"must be a string, got {v!r:.40}"
        return None if len(v) <= max_chars else f"a string of {len(v)} characters (at most {max_chars})"

    return Attr(check, "string", required)


def ints(lo: int, hi: int, length: int | tuple[int, int], required: bool = True, scalar: bool = False) -> Attr:
    """A list of integers in [lo, hi] of ``length`` (or a (min, max) length); ``scalar``: one int also allowed."""
    lmin, lmax = (length, length) if isinstance(length, int) else length

    def check(v: Any) -> str | None:
        if scalar and _is_int(v):
            return None if lo <= v <= hi else f"{v} is outside [{lo}, {hi}]"
        if not isinstance(v, (list, tuple)):
            return f"must be a list of integers, got {v!r:.40}"
        if not lmin <= len(v) <= lmax:
            return f"has {len(v)} entries, expected {lmin if lmin == lmax else f'{lmin} to {lmax}'}"
        for i, x in enumerate(v):
            if not _is_int(x) or not lo <= x <= hi:
                return f"entry {i} ({x!r:.40}) is not an integer in [{lo}, {hi}]"
        return None

    return Attr(check, f"list of ints in [{lo}, {hi}]", required)


def optional(attr: Attr, required: bool = True) -> Attr:
    """``attr`` or null."""
    return Attr(lambda v: None if v is None else attr.check(v), f"{attr.doc} or null", required)


def json_tree(max_nodes: int = MAX_TREE_NODES, required: bool = True, top: type = list) -> Attr:
    """Plain data (value references, ints within :data:`MAX_SHAPE_LITERAL`, slices, strings,
    bools, None, lists / tuples) of at most ``max_nodes`` nodes under a ``top`` (list: positional
    arguments, dict: keyword arguments): the arguments of a layout function."""

    def check(v: Any) -> str | None:
        if not isinstance(v, top):
            return f"must be {'a list' if top is list else 'an object'}, got {type(v).__name__}"
        todo: list[Any] = list(v.values()) if isinstance(v, dict) else list(cast(Iterable[Any], v))
        n = 1
        while todo:
            x = todo.pop()
            n += 1
            if n > max_nodes:
                return f"more than {max_nodes} values"
            if isinstance(x, (list, tuple)):
                todo.extend(x)
            elif isinstance(x, dict):
                return "holds an object where a value, a list or a slice belongs"
            elif isinstance(x, slice):
                todo.extend((x.start, x.stop, x.step))
            elif _is_int(x):
                if abs(x) > MAX_SHAPE_LITERAL:
                    return f"integer {x} is outside [-{MAX_SHAPE_LITERAL}, {MAX_SHAPE_LITERAL}]"
            elif isinstance(x, float):
                if not math.isfinite(x):
                    return f"{x!r} is not finite"
            elif not (x is None or x is Ellipsis or isinstance(x, (bool, str, ValueRef))):
                return f"holds a {type(x).__name__}"
        return None

    return Attr(check, "plain data", required)


#: Attribute rules several kernels share.
OUT_DTYPE = one_of(*CODE_DTYPES)
MULT = integer(-(2**32), 2**32)
MULT_OPT = integer(-(2**32), 2**32, required=False)
SHIFT = integer(0, 63)
SHIFT_OPT = integer(0, 63, required=False)
DIM = integer(-MAX_INDEX, MAX_INDEX)
CODE_BOUND = integer(-(2**31), 2**31 - 1)
CODE_BOUND_OPT = integer(-(2**31), 2**31 - 1, required=False)
PAIR_POS = ints(1, MAX_EXTENT, 2, scalar=True)
PAIR_PAD = ints(0, MAX_EXTENT, 2, scalar=True)
#: Integer constant dtypes (weights, tables, multipliers, shifts, biases).
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8")


@dataclass(frozen=True)
class Const:
    """A constant role: the dtypes it may have and its allowed ranks."""

    dtypes: tuple[str, ...]
    ranks: tuple[int, int] = (0, 8)
    required: bool = True


#: ``shape(inst, args, consts) -> outputs`` over abstract values (backends.common.kernels.infer).
ShapeFn = Callable[[Instruction, list[Any], Mapping[str, Any]], list[Any]]
#: ``work(inst, args, outputs) -> bytes``: the temporary memory one call needs beyond its outputs.
WorkFn = Callable[[Instruction, list[Any], list[Any]], int]


@dataclass(frozen=True)
class KernelSchema:
    """What one kernel reads from an instruction (see the module docstring), and what it makes:
    ``shape`` (required by ``register_kernel``) gives its outputs' shapes and dtypes from its
    arguments', raising ``infer.ShapeError`` when they do not fit; ``work`` the temporary bytes
    one call needs (None: two float64 buffers of its largest tensor)."""

    inputs: tuple[int, int] = (1, 1)
    attrs: Mapping[str, Attr] = field(default_factory=dict)
    consts: Mapping[str, Const] = field(default_factory=dict)
    #: extra rule over the whole instruction and its constants (name -> tensor; None when the
    #: caller has none): attributes that depend on one another or on a constant's shape
    extra: Callable[[Instruction, Mapping[str, Any] | None], str | None] | None = None
    shape: ShapeFn | None = None
    work: WorkFn | None = None

    def __post_init__(self) -> None:
        for d in self.consts.values():
            unknown = set(d.dtypes) - set(CONST_DTYPES)
            assert not unknown, f"unknown constant dtypes {unknown}"

    def check(self, inst: Instruction, constants: Mapping[str, Any] | None = None) -> None:
        """Raise :class:`SchemaError` if ``inst`` is not what this kernel reads. With
        ``constants`` (name -> tensor), the dtype and rank of each constant role too."""
        lo, hi = self.inputs
        if not lo <= len(inst.inputs) <= hi:
            want = str(lo) if lo == hi else f"{lo} to {hi}"
            raise SchemaError("inputs", f"{inst.op} takes {want} input(s), got {len(inst.inputs)}")
        if len(inst.outputs) != 1:
            raise SchemaError("outputs", f"{inst.op} binds exactly 1 output, got {len(inst.outputs)}")
        attrs = dict(inst.attrs)
        for name in attrs:
            if name not in self.attrs:
                known = ", ".join(sorted(self.attrs)) or "none"
                raise SchemaError(f"attrs.{name}", f"{inst.op} has no attribute {name!r} (its attributes: {known})")
        for name, rule in self.attrs.items():
            if name not in attrs:
                if rule.required:
                    raise SchemaError(f"attrs.{name}", f"{inst.op} needs attribute {name!r} ({rule.doc})")
                continue
            problem = rule.check(attrs[name])
            if problem is not None:
                raise SchemaError(f"attrs.{name}", problem)
        for role in inst.consts:
            if role not in self.consts:
                known = ", ".join(sorted(self.consts)) or "none"
                raise SchemaError(f"consts.{role}", f"{inst.op} reads no constant {role!r} (its constants: {known})")
        for role, const in self.consts.items():
            if role not in inst.consts:
                if const.required:
                    raise SchemaError(f"consts.{role}", f"{inst.op} needs constant {role!r}")
                continue
            if constants is not None and inst.consts[role] in constants:
                t = constants[inst.consts[role]]
                dt = next((k for k, v in CONST_DTYPES.items() if v == t.dtype), str(t.dtype))
                if dt not in const.dtypes:
                    raise SchemaError(f"consts.{role}", f"dtype {dt} is not one of {', '.join(const.dtypes)}")
                if not const.ranks[0] <= t.dim() <= const.ranks[1]:
                    raise SchemaError(f"consts.{role}", f"rank {t.dim()} is outside {list(const.ranks)}")
        if self.extra is not None:
            problem = self.extra(inst, constants)
            if problem is not None:
                raise SchemaError("attrs", problem)

    def attr_names(self) -> Iterable[str]:
        return self.attrs.keys()
