"""Text form of a graph: one node per line, attributes as Python-literal expressions.

::

    graph @main(%x: tensor<1x3x8x8xf32>, %flag: bool = True) {
      %w: tensor<4x3x3x3xf32> = constant(key="conv.weight")
      %conv: tensor<1x4x6x6xf32> = conv2d(%x, %w, bias=False) @conv
      return (%conv, {"aux": %x})
    }

Conventions (docs/ir.md has the full grammar):

* every operand prints positionally, in order, as ``%name``; attributes print as
  ``name=value`` keywords, and only when they differ from the field's default;
* a :class:`~qir.ir.op.Ref` inside an attribute prints as ``%name`` of the operand it
  points at, or as ``%<index>`` when that operand's value also occupies an earlier slot
  (so the parser, which resolves ``%name`` to the first slot, reads back the same index);
* tensors in ``graph.constants`` and ``node.meta`` are not printed.

:func:`qir.ir.parser.parse_graph` inverts :func:`print_graph` exactly.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from qir.ir.graph import Graph, Node, Value, set_graph_printer
from qir.ir.op import IRError, Op, Ref
from qir.ir.types import DType, QuantSpec, Type, format_type

#: Value classes allowed inside attributes besides plain literals: attrs classes print as
#: ``Name(field=value, ...)``, enums as ``Name.member``. Register more with
#: :func:`register_attr_class`.
ATTR_CLASSES: dict[str, type] = {}

_BARE = re.compile(r"[A-Za-z0-9_.]+")


def register_attr_class(cls: type) -> type:
    """Allow instances of an attrs class or an enum in op attributes (printable and parsable)."""
    if not (attrs.has(cls) or issubclass(cls, enum.Enum)):
        raise TypeError(f"{cls.__qualname__} is neither an attrs class nor an enum")
    known = ATTR_CLASSES.get(cls.__name__)
    if known is not None and known is not cls:
        raise ValueError(f"attribute class name {cls.__name__!r} is taken by {known.__qualname__}")
    ATTR_CLASSES[cls.__name__] = cls
    return cls


register_attr_class(DType)
register_attr_class(QuantSpec)


class _AttrPrintError(Exception):
    """Internal: a value has no text form; re-raised as IRError naming the node."""


def format_str(s: str) -> str:
    """A double-quoted Python string literal for ``s`` (``ast`` reads it back exactly)."""
    out = ['"']
    for c in s:
        if c == "\\":
            out.append("\\\\")
        elif c == '"':
            out.append('\\"')
        elif c.isprintable():
            out.append(c)
        else:
            out.append(repr(c)[1:-1])  # \n, \x00, \u2028 ...
    out.append('"')
    return "".join(out)


def format_name(name: str) -> str:
    """Graph names and scopes: bare when made of ``[A-Za-z0-9_.]``, else a string literal."""
    return name if _BARE.fullmatch(name) else format_str(name)  # fullmatch: "a\n" must be quoted


def format_value(value: Any, operands: Sequence[Value] = ()) -> str:
    """Text of an attribute value, input default or output structure.

    ``operands`` are the node's operands, used to name :class:`Ref` placeholders.
    Raises :class:`IRError` for values that have no text form.
    """
    try:
        return _fmt(value, operands)
    except _AttrPrintError as e:
        raise IRError(str(e)) from None


def _fmt(v: Any, operands: Sequence[Value]) -> str:
    if v is None or v is True or v is False:
        return repr(v)
    if v is Ellipsis:
        return "..."
    t = type(v)
    if t is int:
        return repr(v)
    if t is float:
        return repr(v)  # shortest exact form; inf / -inf / nan read back as names
    if t is str:
        return format_str(v)
    if isinstance(v, Ref):
        return _fmt_ref(v, operands)
    if isinstance(v, Value):
        return f"%{v.name}"
    if t is tuple:
        if len(v) == 1:
            return f"({_fmt(v[0], operands)},)"
        return "(" + ", ".join(_fmt(x, operands) for x in v) + ")"
    if t is list:
        return "[" + ", ".join(_fmt(x, operands) for x in v) + "]"
    if t is dict:
        return "{" + ", ".join(f"{_fmt(k, operands)}: {_fmt(x, operands)}" for k, x in v.items()) + "}"
    if t is slice:
        return f"slice({_fmt(v.start, operands)}, {_fmt(v.stop, operands)}, {_fmt(v.step, operands)})"
    if isinstance(v, torch.dtype) or isinstance(v, (torch.memory_format, torch.layout)):
        return str(v)  # "torch.float32", "torch.contiguous_format", "torch.strided"
    if t is torch.device:
        return f"torch.device({format_str(str(v))})"
    if t is torch.Size:
        return "torch.Size([" + ", ".join(repr(int(x)) for x in v) + "])"
    if isinstance(v, Type):
        return f"Type({format_str(format_type(v))})"
    if isinstance(v, enum.Enum) and ATTR_CLASSES.get(t.__name__) is t:
        return f"{t.__name__}.{v.name}"
    if attrs.has(t) and ATTR_CLASSES.get(t.__name__) is t:
        return f"{t.__name__}({_fmt_fields(v, operands)})"
    raise _AttrPrintError(
        f"value {v!r} of type {t.__qualname__} has no text form; use literals, or register the class "
        "with qir.ir.printer.register_attr_class, or keep the object in Graph.objects and refer to it by key"
    )


def _fmt_ref(r: Ref, operands: Sequence[Value]) -> str:
    if 0 <= r.index < len(operands):
        v = operands[r.index]
        first = next(i for i, o in enumerate(operands) if o.name == v.name)
        if first == r.index:
            return f"%{v.name}"
    return f"%{r.index}"


def _fmt_fields(obj: Any, operands: Sequence[Value]) -> str:
    """``name=value`` for each init field of an attrs instance that differs from its default."""
    parts = []
    for f in attrs.fields(type(obj)):
        if not f.init:
            continue  # derived fields are recomputed on construction
        value = getattr(obj, f.name)
        if _is_default(f, value):
            continue
        parts.append(f"{f.alias or f.name}={_fmt(value, operands)}")
    return ", ".join(parts)


def _is_default(f: attrs.Attribute, value: Any) -> bool:  # type: ignore[type-arg]
    default: Any = f.default
    if default is attrs.NOTHING:
        return False
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        if default.takes_self:
            return False
        default = default.factory()
    conv: Any = f.converter
    if isinstance(conv, attrs.Converter):
        if conv.takes_self or conv.takes_field:  # type: ignore[attr-defined]
            return False
        conv = conv.converter  # type: ignore[attr-defined]
    if conv is not None:
        try:
            default = conv(default)
        except Exception:
            return False
    return _identical(value, default)


def _identical(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down, so omitting a default loses nothing:
    1 / 1.0 / True never collapse, nor 0.0 / -0.0; nan matches nan."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return repr(a) == repr(b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_identical(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # tensors or other values without a boolean ==
        return False


def format_op(op: Op, operands: Sequence[Value]) -> str:
    """``opname(%a, %b, attr=value)``."""
    args = [f"%{v.name}" for v in operands]
    fields = _fmt_fields(op, operands)
    if fields:
        args.append(fields)
    return f"{op.name}({', '.join(args)})"


def format_node(node: Node) -> str:
    """One node's line without indentation: ``%name: type = op(...) @scope``."""
    try:
        body = format_op(node.op, node.operands)
    except _AttrPrintError as e:
        raise IRError(f"cannot print %{node.name} = {node.op.name}: {e}") from None
    scope = "" if node.scope is None else f" @{format_name(node.scope)}"
    return f"%{node.name}: {format_type(node.type)} = {body}{scope}"


def format_header(graph: Graph) -> str:
    params = []
    for a in graph.inputs:
        p = f"%{a.name}: {format_type(a.type)}"
        if a.has_default:
            try:
                p += f" = {_fmt(a.default, ())}"
            except _AttrPrintError as e:
                raise IRError(f"cannot print the default of input %{a.name}: {e}") from None
        params.append(p)
    attributes = " attributes(training=True)" if graph.training else ""
    return f"graph @{format_name(graph.name)}({', '.join(params)}){attributes} {{"


def print_graph(graph: Graph) -> str:
    """The text form of ``graph`` (no trailing newline); see the module docstring."""
    lines = [format_header(graph)]
    lines.extend(f"  {format_node(n)}" for n in graph.nodes)
    try:
        out = _fmt(graph.output, ())
    except _AttrPrintError as e:
        raise IRError(f"cannot print the output of graph @{graph.name}: {e}") from None
    lines.append(f"  return {out}")
    lines.append("}")
    return "\n".join(lines)


set_graph_printer(print_graph)
