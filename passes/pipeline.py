"""Pipeline text: parse ``"absorb-bn,fuse,legalize{march=bayes ops=[conv2d,linear]}"`` into
pass instances and print them back.

Grammar (whitespace allowed between tokens)::

    pipeline := [pass ("," pass)*]
    pass     := NAME ["{" [option ((" " | ",") option)*] "}"]
    option   := NAME "=" value | NAME          (a bare NAME sets a bool option to true)
    value    := "[" [value ("," value)*] "]" | QUOTED | BARE
    QUOTED   := a JSON string, "like \\"this\\""
    BARE     := characters other than whitespace , { } [ ] = "

Options are the pass class's attrs fields; each value is converted to the field's type:
``bool`` (true/false), ``int``, ``float``, ``str``, enums (by value when the values are
strings, else by name), ``Literal[...]``, ``X | None`` (``none``), other unions (first
type that accepts the text; a quoted value is always a string), and ``tuple[X, ...]``,
``tuple[X, Y]``, ``list[X]``, ``Sequence[X]`` written as ``[a,b]``.

Printing is canonical: options in field order, separated by one space, options equal to
their default left out; ``str(parse_pipeline(s)) == s`` for canonical ``s``.
"""

from __future__ import annotations

import collections.abc
import difflib
import enum
import json
import math
import re
import types
import typing
from collections.abc import Iterable, Iterator
from typing import Any, Literal, TypeAlias, Union, overload

import attrs

from passes.base import Pass, set_pass_formatter
from passes.errors import PipelineError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_BARE = re.compile(r'[^\s,{}\[\]="]+')
_INT = re.compile(r"[-+]?[0-9]+\Z")
_FLOAT = re.compile(r"[-+]?([0-9]+\.?[0-9]*([eE][-+]?[0-9]+)?|\.[0-9]+([eE][-+]?[0-9]+)?|inf|infinity|nan)\Z", re.I)
# strings printed without quotes: they must lex as one BARE token and never read as
# another type in a union (numbers, true/false/none, inf/nan)
_PLAIN_STR = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-/:]*\Z")
_WORDS = frozenset({"none", "true", "false", "inf", "infinity", "nan"})


# --------------------------------------------------------------------------- syntax


@attrs.frozen
class Scalar:
    """One value token as written; ``quoted`` tokens are always strings."""

    text: str
    quoted: bool
    pos: int

    def __str__(self) -> str:
        return json.dumps(self.text) if self.quoted else self.text


@attrs.frozen
class RawList:
    items: tuple[Raw, ...]
    pos: int

    def __str__(self) -> str:
        return "[" + ",".join(str(i) for i in self.items) + "]"


Raw: TypeAlias = Scalar | RawList


@attrs.frozen
class RawOption:
    """``name=value`` as written; ``value`` is None for the bare-flag form ``{name}``."""

    name: str
    value: Raw | None
    pos: int


@attrs.frozen
class PassSpec:
    """One pass of a pipeline as written, before its name and options are checked."""

    name: str
    options: tuple[RawOption, ...]
    pos: int


class _Syntax(Exception):
    def __init__(self, message: str, pos: int) -> None:
        super().__init__(message)
        self.message = message
        self.pos = pos


def located(text: str, pos: int, message: str) -> str:
    """``message`` followed by the line of ``text`` holding ``pos`` and a caret under it."""
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    line = text[start : end if end >= 0 else len(text)]
    col = pos - start
    return f"{message} (column {col + 1})\n  {line}\n  {' ' * col}^"


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def ws(self) -> bool:
        start = self.i
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1
        return self.i > start

    def name(self, what: str) -> str:
        m = _NAME.match(self.text, self.i)
        if m is None:
            found = repr(self.peek()) if self.peek() else "the end"
            raise _Syntax(f"expected {what}, found {found}", self.i)
        self.i = m.end()
        return m.group()

    def pipeline(self) -> list[PassSpec]:
        self.ws()
        specs: list[PassSpec] = []
        if not self.peek():
            return specs
        specs.append(self.pass_())
        while True:
            self.ws()
            if not self.peek():
                return specs
            if self.peek() != ",":
                raise _Syntax(f"expected ',' between passes, found {self.peek()!r}", self.i)
            self.i += 1
            self.ws()
            specs.append(self.pass_())

    def pass_(self) -> PassSpec:
        pos = self.i
        name = self.name("a pass name")
        self.ws()
        options: list[RawOption] = []
        if self.peek() != "{":
            return PassSpec(name, (), pos)
        brace = self.i
        self.i += 1
        self.ws()
        while self.peek() != "}":
            if not self.peek():
                raise _Syntax(f"'{{' of pass {name!r} is never closed", brace)
            kpos = self.i
            key = self.name(f"an option name of pass {name!r}")
            self.ws()
            value: Raw | None = None
            if self.peek() == "=":
                self.i += 1
                self.ws()
                value = self.value()
            options.append(RawOption(key, value, kpos))
            spaced = self.ws()
            if self.peek() == ",":
                self.i += 1
                self.ws()
            elif self.peek() not in ("}", "") and not spaced:
                raise _Syntax(f"expected ' ', ',' or '}}' after option {key!r}, found {self.peek()!r}", self.i)
        self.i += 1
        return PassSpec(name, tuple(options), pos)

    def value(self) -> Raw:
        pos = self.i
        c = self.peek()
        if c == "[":
            self.i += 1
            self.ws()
            items: list[Raw] = []
            if self.peek() != "]":
                items.append(self.value())
                self.ws()
                while self.peek() == ",":
                    self.i += 1
                    self.ws()
                    items.append(self.value())
                    self.ws()
            if self.peek() != "]":
                found = repr(self.peek()) if self.peek() else "the end"
                raise _Syntax(f"expected ',' or ']' in the list opened here, found {found}", pos)
            self.i += 1
            return RawList(tuple(items), pos)
        if c == '"':
            return Scalar(self.quoted(), True, pos)
        m = _BARE.match(self.text, self.i)
        if m is None:
            found = repr(c) if c else "the end"
            raise _Syntax(f"expected a value, found {found}; quote values that contain , {{ }} [ ] = or spaces", pos)
        self.i = m.end()
        return Scalar(m.group(), False, pos)

    def quoted(self) -> str:
        start = self.i
        j = start + 1
        while j < len(self.text) and self.text[j] != '"':
            j += 2 if self.text[j] == "\\" else 1
        if j >= len(self.text):
            raise _Syntax("string is never closed", start)
        self.i = j + 1
        try:
            return str(json.loads(self.text[start : j + 1]))
        except json.JSONDecodeError as e:
            raise _Syntax(f"bad string: {e.msg}", start + e.pos) from None


def parse_specs(text: str) -> list[PassSpec]:
    """The passes of ``text`` as written, checking syntax only (no registry lookups)."""
    try:
        return _Parser(text).pipeline()
    except _Syntax as e:
        raise PipelineError(located(text, e.pos, f"bad pipeline: {e.message}")) from None


# --------------------------------------------------------------------------- option types


class _BadValue(Exception):
    def __init__(self, message: str, pos: int) -> None:
        super().__init__(message)
        self.message = message
        self.pos = pos


_UNION_ORIGINS = (Union, types.UnionType)
_SEQ_ORIGINS = (tuple, list, collections.abc.Sequence)


def describe_type(tp: Any) -> str:
    """How an option type reads in messages: ``int``, ``[str, ...]``, ``one of a, b``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in _UNION_ORIGINS:
        return " | ".join("none" if a is type(None) else describe_type(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(_format_scalar(a) for a in args)
    if origin in _SEQ_ORIGINS:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return "[" + ", ".join(describe_type(a) for a in args) + "]"
        return f"[{describe_type(args[0])}, ...]" if args else "[...]"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(_enum_text(m) for m in tp)
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def expressible(tp: Any) -> bool:
    """Whether values of ``tp`` can be written in pipeline text."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in _UNION_ORIGINS:
        return all(expressible(a) for a in args)
    if origin is Literal:
        return all(isinstance(a, (bool, int, str)) for a in args)
    if origin in _SEQ_ORIGINS:
        return bool(args) and all(expressible(a) for a in args if a is not Ellipsis)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return True
    return tp in (bool, int, float, str, type(None))


def _enum_by_value(cls: type[enum.Enum]) -> bool:
    return all(isinstance(m.value, str) for m in cls)


def _enum_text(m: enum.Enum) -> str:
    return _format_str(m.value) if _enum_by_value(type(m)) else m.name


def _rank(tp: Any) -> int:
    """Order in which union members are tried, when reading and when printing: the
    narrowest reading of a token wins ("3" is an int before a float, a string last), so
    printing and reading agree whatever order the annotation lists the members in."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return 4
    if origin in _SEQ_ORIGINS:
        return 6
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return 5
    return {type(None): 0, bool: 1, int: 2, float: 3, str: 7}.get(tp, 8)


def convert(tp: Any, raw: Raw) -> Any:
    """The value of type ``tp`` that ``raw`` spells; :class:`_BadValue` says why not."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in _UNION_ORIGINS:
        for a in sorted(args, key=_rank):
            if isinstance(raw, Scalar) and typing.get_origin(a) in _SEQ_ORIGINS:
                continue  # in a union a lone value is itself, never a 1-list: "a" in tuple[str, ...] | str
            try:
                return convert(a, raw)
            except _BadValue:
                continue
        raise _BadValue(f"expected {describe_type(tp)}, got {raw}", raw.pos)
    if origin in _SEQ_ORIGINS:
        items = raw.items if isinstance(raw, RawList) else (raw,)  # a lone value is a 1-list
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(items) != len(args):
                raise _BadValue(f"expected {len(args)} values {describe_type(tp)}, got {len(items)}", raw.pos)
            return tuple(convert(a, i) for a, i in zip(args, items, strict=True))
        out = [convert(args[0], i) for i in items]
        return out if origin is list else tuple(out)
    if isinstance(raw, RawList):
        raise _BadValue(f"expected {describe_type(tp)}, got a list {raw}", raw.pos)
    text = raw.text
    if origin is Literal:
        for a in args:
            if (isinstance(a, str) and a == text) or (not raw.quoted and _format_scalar(a) == text):
                return a
        raise _BadValue(f"expected {describe_type(tp)}, got {raw}", raw.pos)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for m in tp:
            if (_enum_by_value(tp) and m.value == text) or m.name == text:
                return m
        raise _BadValue(f"expected {describe_type(tp)}, got {raw}", raw.pos)
    if tp is str:
        return text
    if raw.quoted:
        raise _BadValue(f"expected {describe_type(tp)}, got the string {raw}", raw.pos)
    if tp is type(None) and text == "none":
        return None
    if tp is bool and text in ("true", "false"):
        return text == "true"
    if tp is int and _INT.match(text):
        return int(text)
    if tp is float and _FLOAT.match(text):
        return float(text)
    raise _BadValue(f"expected {describe_type(tp)}, got {raw}", raw.pos)


def _matches(tp: Any, value: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in _UNION_ORIGINS:
        return any(_matches(a, value) for a in args)
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if origin in _SEQ_ORIGINS:
        if not isinstance(value, (tuple, list)):
            return False
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return len(value) == len(args) and all(_matches(a, v) for a, v in zip(args, value, strict=True))
        return all(_matches(args[0], v) for v in value)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(tp, type) and isinstance(value, tp)


def _format_str(s: str) -> str:
    if _PLAIN_STR.match(s) and s.lower() not in _WORDS:
        return s
    return json.dumps(s, ensure_ascii=False)


def _format_scalar(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, enum.Enum):
        return _enum_text(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return _format_str(v)
    raise TypeError(f"cannot write {v!r} in a pipeline")


def format_value(tp: Any, value: Any) -> str:
    """Pipeline text for ``value`` read as type ``tp`` (the inverse of :func:`convert`)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in _UNION_ORIGINS:
        for a in sorted(args, key=_rank):
            if _matches(a, value):
                return format_value(a, value)
        raise TypeError(f"{value!r} is not a {describe_type(tp)}")
    if origin in _SEQ_ORIGINS:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return "[" + ",".join(format_value(a, v) for a, v in zip(args, value, strict=True)) + "]"
        return "[" + ",".join(format_value(args[0], v) for v in value) + "]"
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(float(value))  # 1 -> "1.0", so the text reads back as the same float
    return _format_scalar(value)


# --------------------------------------------------------------------------- options


@attrs.frozen
class OptionSpec:
    """One option of a pass: an ``__init__`` argument of its attrs class."""

    name: str  # the constructor keyword (attrs alias), as written in pipelines
    attribute: str  # the attribute holding the value
    type: Any
    default: Any  # attrs.NOTHING when required or not computable
    required: bool

    @property
    def has_default(self) -> bool:
        return self.default is not attrs.NOTHING

    def describe(self) -> str:
        if self.required:
            return f"{self.name}: {describe_type(self.type)} (required)"
        if not self.has_default:
            return f"{self.name}: {describe_type(self.type)}"
        try:
            shown = format_value(self.type, self.default)
        except TypeError:
            shown = repr(self.default)
        return f"{self.name}: {describe_type(self.type)} = {shown}"


_SPECS: dict[type[Pass], dict[str, OptionSpec]] = {}


def option_specs(cls: type[Pass]) -> dict[str, OptionSpec]:
    """The options of pass class ``cls``, by pipeline name, in field order."""
    specs = _SPECS.get(cls)
    if specs is None:
        specs = _SPECS[cls] = _option_specs(cls)
    return specs


def _option_specs(cls: type[Pass]) -> dict[str, OptionSpec]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception as e:
        raise PipelineError(
            f"cannot resolve the option types of pass {cls.name!r} ({cls.__module__}.{cls.__qualname__}): "
            f"{type(e).__name__}: {e}; define the types its fields name at module level"
        ) from e
    specs: dict[str, OptionSpec] = {}
    for f in attrs.fields(cls):
        if not f.init:
            continue
        default: Any = f.default
        required = default is attrs.NOTHING
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = attrs.NOTHING if default.takes_self else default.factory()
        alias = f.alias or f.name
        specs[alias] = OptionSpec(alias, f.name, hints.get(f.name, f.type), default, required)
    return specs


def _option_hint(cls: type[Pass]) -> str:
    specs = option_specs(cls)
    if not specs:
        return f"pass {cls.name!r} takes no options"
    return f"options of {cls.name!r}: " + ", ".join(s.describe() for s in specs.values())


def instantiate(spec: PassSpec, text: str | None = None) -> Pass:
    """The pass instance ``spec`` describes; errors point into ``text`` when given."""
    from passes.registry import get_pass_class

    def fail(message: str, pos: int) -> PipelineError:
        return PipelineError(located(text, pos, message) if text is not None else message)

    try:
        cls = get_pass_class(spec.name)
    except PipelineError as e:
        raise fail(str(e), spec.pos) from None
    specs = option_specs(cls)
    kwargs: dict[str, Any] = {}
    for opt in spec.options:
        key = opt.name if opt.name in specs else opt.name.replace("-", "_")
        o = specs.get(key)
        if o is None:
            close = difflib.get_close_matches(opt.name, list(specs), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise fail(f"pass {spec.name!r} has no option {opt.name!r}; {hint}{_option_hint(cls)}", opt.pos)
        if key in kwargs:
            raise fail(f"option {key!r} of pass {spec.name!r} is given twice", opt.pos)
        if not expressible(o.type):
            raise fail(
                f"option {key!r} of pass {spec.name!r} has type {describe_type(o.type)}, which pipeline text "
                f"cannot express; construct the pass in Python: {cls.__qualname__}({key}=...)",
                opt.pos,
            )
        if opt.value is None:
            if not _matches(o.type, True):
                need = f"{key}=<{describe_type(o.type)}>"
                raise fail(f"option {key!r} of pass {spec.name!r} needs a value: {need}", opt.pos)
            kwargs[key] = True
            continue
        try:
            kwargs[key] = convert(o.type, opt.value)
        except _BadValue as e:
            raise fail(f"option {key!r} of pass {spec.name!r}: {e.message}", e.pos) from None
    missing = [o for o in specs.values() if o.required and o.name not in kwargs]
    if missing:
        need = " ".join(f"{o.name}=<{describe_type(o.type)}>" for o in missing)
        raise fail(f"pass {spec.name!r} needs option(s) {need}", spec.pos)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise fail(f"pass {spec.name!r} rejected its options: {e}", spec.pos) from e


# --------------------------------------------------------------------------- printing


def _same(a: Any, b: Any) -> bool:
    try:
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return bool(a == b)
    except Exception:  # exotic option values whose == raises or is ambiguous (tensors)
        return False


def format_pass(p: Pass, strict: bool = False) -> str:
    """``p`` in pipeline syntax. Non-default options only, in field order.

    Values pipeline text cannot express (objects) raise :class:`PipelineError` when
    ``strict``, else show as ``<repr>`` (fine for messages, not for parsing back).
    """
    parts: list[str] = []
    for o in option_specs(type(p)).values():
        value = getattr(p, o.attribute)
        if o.has_default and _same(value, o.default):
            continue
        try:
            if not expressible(o.type):
                raise TypeError(f"type {describe_type(o.type)} cannot be written in a pipeline")
            text = format_value(o.type, value)
        except TypeError as e:
            if strict:
                raise PipelineError(f"cannot print option {o.name!r} of pass {p.name!r}: {e}") from None
            text = f"<{value!r}>"
        parts.append(f"{o.name}={text}")
    return f"{p.name}{{{' '.join(parts)}}}" if parts else p.name


set_pass_formatter(format_pass)


def format_pipeline(passes: Iterable[Pass], strict: bool = True) -> str:
    """The canonical pipeline text of ``passes``; :func:`parse_pipeline` reads it back."""
    return ",".join(format_pass(p, strict) for p in passes)


# --------------------------------------------------------------------------- pipeline


def _to_tuple(passes: Iterable[Pass]) -> tuple[Pass, ...]:
    return tuple(passes)


@attrs.frozen
class Pipeline:
    """An ordered, immutable sequence of pass instances. ``str()`` gives its text."""

    passes: tuple[Pass, ...] = attrs.field(converter=_to_tuple)

    @classmethod
    def parse(cls, text: str) -> Pipeline:
        return parse_pipeline(text)

    def __str__(self) -> str:
        return format_pipeline(self.passes, strict=False)

    def __iter__(self) -> Iterator[Pass]:
        return iter(self.passes)

    def __len__(self) -> int:
        return len(self.passes)

    @overload
    def __getitem__(self, i: int) -> Pass: ...
    @overload
    def __getitem__(self, i: slice) -> Pipeline: ...
    def __getitem__(self, i: int | slice) -> Pass | Pipeline:
        if isinstance(i, slice):
            return Pipeline(self.passes[i])
        return self.passes[i]

    def __add__(self, other: Pipeline | Iterable[Pass] | str) -> Pipeline:
        return Pipeline(self.passes + as_pipeline(other).passes)


def parse_pipeline(text: str) -> Pipeline:
    """Parse pipeline text into pass instances, loading built-in passes as named.

    Raises :class:`PipelineError` pointing at the offending spot: bad syntax, an unknown
    pass (listing the valid ones), an unknown option (listing the pass's options), a value
    of the wrong type, a missing required option.
    """
    return Pipeline(instantiate(spec, text) for spec in parse_specs(text))


def as_pipeline(value: Pipeline | str | Pass | Iterable[Pass]) -> Pipeline:
    """Accept pipeline text, one pass, or any iterable of passes."""
    if isinstance(value, Pipeline):
        return value
    if isinstance(value, str):
        return parse_pipeline(value)
    if isinstance(value, Pass):
        return Pipeline((value,))
    passes = tuple(value)
    for p in passes:
        if not isinstance(p, Pass):
            raise TypeError(f"a pipeline holds Pass instances, got {p!r}")
    return Pipeline(passes)
