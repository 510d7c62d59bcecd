"""Read the text form written by :mod:`qir.ir.printer` back into a :class:`Graph`.

The structure (header, one node per line, ``return``, ``}``) is scanned by hand; attribute
expressions are parsed with :mod:`ast` and walked with a whitelist (literals, tuples,
lists, dicts, ``slice``, ``...``, ``inf`` / ``nan``, torch dtypes, registered attribute
classes and ``%name`` references). Nothing is evaluated. ``//`` starts a comment.

Errors are :class:`ParseError` with a 1-based line and column, the offending line and
what was expected.
"""

from __future__ import annotations

import ast
import difflib
import math
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

import qir.ir.ops  # noqa: F401  (registers the built-in ops the text names)
from qir.ir.call_targets import attribute_allowed, lookup_call_target, method_allowed, refusal
from qir.ir.graph import Graph, Value
from qir.ir.op import OP_REGISTRY, IRError, Op, Ref
from qir.ir.printer import ATTR_CLASSES
from qir.ir.stand_ins import mark_stand_in
from qir.ir.types import TensorType, Type, parse_type
from qir.ir.unknown_dims import infer_type

MAX_CONSTANT_BYTES = 256 * 2**20
"""Default bound on a constant :func:`parse_graph` zero-fills (``allow_unbound=True``)."""

MAX_INT_LITERAL = 2**64
"""Integer literals in attributes must lie in ``[-MAX_INT_LITERAL, MAX_INT_LITERAL]``: no
tensor index, size or quantization parameter needs more, and larger ones only surface later
as overflows inside torch."""


def _all_nonneg(shape: tuple[int, ...]) -> bool:
    return all(d >= 0 for d in shape)


class ParseError(IRError):
    """Malformed text. ``line`` and ``column`` are 1-based; ``reason`` is the bare message."""

    def __init__(self, reason: str, line: int, column: int, source: str = "<text>", text: str = "") -> None:
        self.reason = reason
        self.line = line
        self.column = column
        self.source = source
        msg = f"{source}:{line}:{column}: {reason}"
        if text:
            msg += f"\n  {text}\n  {' ' * (column - 1)}^"
        super().__init__(msg)


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPNAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_BARE = re.compile(r"[A-Za-z0-9_.]+")
_STRING = re.compile(r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'")
_CLOSE = {"(": ")", "[": "]", "{": "}"}
_TORCH_ATTR_TYPES = (torch.dtype, torch.memory_format, torch.layout)


def _strip_comment(text: str) -> str:
    """Cut a ``//`` comment, ignoring ``//`` inside string literals."""
    if "//" not in text:
        return text
    i = 0
    while i < len(text):
        c = text[i]
        if c in "\"'":
            m = _STRING.match(text, i)
            i = m.end() if m else len(text)
            continue
        if text.startswith("//", i):
            return text[:i]
        i += 1
    return text


class _Line:
    """A cursor over one source line (comments removed)."""

    def __init__(self, parser: _Parser, lineno: int, raw: str) -> None:
        self.p = parser
        self.lineno = lineno
        self.raw = raw
        self.text = _strip_comment(raw).rstrip()
        self.pos = 0

    # -- errors ----------------------------------------------------------------
    def error(self, reason: str, col: int | None = None) -> ParseError:
        c = self.pos if col is None else col
        return ParseError(reason, self.lineno, c + 1, self.p.source, self.raw.rstrip())

    def found(self) -> str:
        rest = self.text[self.pos :]
        return f"{rest[:20]!r}" if rest else "end of line"

    # -- lexing ----------------------------------------------------------------
    def ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def at(self, s: str) -> bool:
        self.ws()
        return self.text.startswith(s, self.pos)

    def eat(self, s: str) -> bool:
        if self.at(s):
            self.pos += len(s)
            return True
        return False

    def expect(self, s: str, what: str | None = None) -> None:
        if not self.eat(s):
            raise self.error(f"expected {what or repr(s)}, found {self.found()}")

    def match(self, rx: re.Pattern[str], what: str) -> str:
        self.ws()
        m = rx.match(self.text, self.pos)
        if m is None:
            raise self.error(f"expected {what}, found {self.found()}")
        self.pos = m.end()
        return m.group(0)

    def done(self) -> bool:
        self.ws()
        return self.pos >= len(self.text)

    def value_name(self) -> str:
        self.expect("%", "a value name like %x")
        if not _IDENT.match(self.text, self.pos):
            raise self.error(f"expected an identifier after '%', found {self.found()}")
        return self.match(_IDENT, "an identifier")

    def symbol(self, what: str) -> str:
        """A bare ``[A-Za-z0-9_.]+`` name or a string literal (graph names, scopes)."""
        self.ws()
        m = _STRING.match(self.text, self.pos)
        if m is not None:
            start, self.pos = self.pos, m.end()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", SyntaxWarning)
                    warnings.simplefilter("ignore", DeprecationWarning)
                    value = ast.literal_eval(m.group(0))  # a lone string literal: safe
            except (SyntaxError, ValueError) as e:  # bad escapes, NUL characters
                raise self.error(f"bad string literal for {what}: {getattr(e, 'msg', None) or e}", start) from None
            assert isinstance(value, str)
            return value
        return self.match(_BARE, what)

    def type(self) -> Type:
        """A type: runs to whitespace, or to ``,`` ``)`` ``=`` outside ``<>`` / ``[]``."""
        self.ws()
        start, depth = self.pos, 0
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c in "<[":
                depth += 1
            elif c in ">]":
                depth -= 1
            elif c in " \t" or (depth == 0 and c in ",)="):
                break
            self.pos += 1
        src = self.text[start : self.pos]
        if not src:
            raise self.error(f"expected a type like tensor<1x3xf32>, found {self.found()}")
        try:
            return parse_type(src)
        except (ValueError, TypeError, OverflowError) as e:
            raise self.error(f"bad type {src[:60]!r}: {e}", start) from None

    def span(self, stops: str) -> tuple[int, int, frozenset[int]]:
        """Scan an expression up to a ``stops`` char at bracket depth 0 (or the end).

        If the cursor is on an opening bracket the scan ends after its match. Returns
        (start, end, columns of ``%`` signs outside strings)."""
        self.ws()
        start, depth = self.pos, 0
        refs: set[int] = set()
        opened = start < len(self.text) and self.text[start] in _CLOSE
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c in "\"'":
                m = _STRING.match(self.text, self.pos)
                if m is None:
                    raise self.error("unterminated string literal")
                self.pos = m.end()
                continue
            if depth == 0 and c in stops:
                break
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
                if depth < 0:
                    raise self.error(f"unbalanced {c!r}")
                if depth == 0 and opened:
                    self.pos += 1
                    break
            elif c == "%":
                refs.add(self.pos)
            self.pos += 1
        else:
            if depth > 0:
                raise self.error("unclosed bracket", start)
        return start, self.pos, frozenset(refs)

    def expr(self, start: int, end: int, refs: frozenset[int], prefix: str = "") -> tuple[ast.expr, _Walker]:
        """Parse text[start:end] (``%`` made into identifier chars) as a Python expression."""
        body = "".join("_" if start + i in refs else c for i, c in enumerate(self.text[start:end]))
        src = prefix + body
        try:
            with warnings.catch_warnings():  # "1x" or "\d" warn before failing or parsing: our errors suffice
                warnings.simplefilter("ignore", SyntaxWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                tree = ast.parse(src, mode="eval")
        except SyntaxError as e:
            col = start + max((e.offset or 1) - 1 - len(prefix), 0)
            raise self.error(f"bad expression: {e.msg}", col) from None
        except (ValueError, RecursionError, MemoryError) as e:  # null bytes, absurd nesting
            raise self.error(f"bad expression: {type(e).__name__}: {e}", start) from None
        return tree.body, _Walker(self, src, start - len(prefix), refs)


class _Walker:
    """Turns a whitelisted expression AST into a value (never evaluates code)."""

    def __init__(self, line: _Line, src: str, origin: int, refs: frozenset[int]) -> None:
        self.line = line
        # ast columns are UTF-8 byte offsets; the line cursor counts characters
        self.char_at: list[int] | None = None
        if not src.isascii():
            self.char_at = [i for i, c in enumerate(src) for _ in range(len(c.encode()))]
            self.char_at.append(len(src))
        self.origin = origin
        self.refs = refs
        #: how ``%name`` / ``%3`` becomes a value: set per use (attribute, output, default)
        self.on_ref: Callable[[str, int], Any] = self._no_refs

    def col(self, node: ast.AST) -> int:
        offset: int = getattr(node, "col_offset", 0)
        return self.origin + (offset if self.char_at is None else self.char_at[offset])

    def error(self, node: ast.AST, reason: str) -> ParseError:
        return self.line.error(reason, self.col(node))

    def _no_refs(self, name: str, col: int) -> Any:
        raise self.line.error(f"%{name}: values cannot appear here", col)

    def is_ref(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and self.col(node) in self.refs

    def value(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            v = node.value
            if type(v) is int and abs(v) > MAX_INT_LITERAL:
                raise self.error(node, f"integer literal with {len(str(abs(v)))} digits is out of range (|n| <= 2**64)")
            if v is None or v is Ellipsis or type(v) in (bool, int, float, str):
                return v
            raise self.error(node, f"unsupported literal {v!r}")
        if isinstance(node, ast.Name):
            if self.is_ref(node):
                return self.on_ref(node.id[1:], self.col(node))
            if node.id == "inf":
                return math.inf
            if node.id == "nan":
                return math.nan
            raise self.error(
                node,
                f"unknown name {node.id!r}; expected a literal, %value, inf, nan, slice(...), "
                "torch.<dtype> or a registered attribute class",
            )
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = self.value(node.operand)
            if type(inner) not in (int, float) or self.is_ref(node.operand):
                raise self.error(node, "a sign only applies to a number")
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, (ast.Tuple, ast.List)):
            items = []
            for e in node.elts:
                if isinstance(e, ast.Starred):
                    raise self.error(e, "'*' unpacking is not allowed")
                items.append(self.value(e))
            return tuple(items) if isinstance(node, ast.Tuple) else items
        if isinstance(node, ast.Dict):
            out = {}
            for key, item in zip(node.keys, node.values, strict=True):
                if key is None:
                    raise self.error(item, "'**' unpacking is not allowed")
                k = self.value(key)
                try:
                    hash(k)
                except TypeError:
                    raise self.error(key, f"dict key {k!r} is not hashable") from None
                if k in out:
                    raise self.error(key, f"dict key {k!r} appears twice")
                out[k] = self.value(item)
            return out
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and not self.is_ref(node.value):
            return self.attribute(node, node.value.id, node.attr)
        if isinstance(node, ast.Call):
            return self.call(node)
        raise self.error(
            node,
            f"unsupported expression ({type(node).__name__}); expected a literal, tuple, list, "
            "dict, slice(...), %value, torch.<dtype> or a registered attribute class",
        )

    def attribute(self, node: ast.AST, owner: str, attr: str) -> Any:
        if owner == "torch":
            # the module dict, not getattr: torch's module __getattr__ imports submodules by name
            v = vars(torch).get(attr)
            if isinstance(v, _TORCH_ATTR_TYPES):
                return v
            raise self.error(node, f"torch.{attr} is not a torch dtype, memory format or layout")
        cls = ATTR_CLASSES.get(owner)
        if cls is not None and hasattr(cls, "__members__"):
            members = cls.__members__
            if attr in members:
                return members[attr]
            raise self.error(node, f"{owner} has no member {attr!r}{_close(attr, members)}")
        raise self.error(node, f"unknown name {owner}.{attr}")

    def call(self, node: ast.Call) -> Any:
        f = node.func
        fname = (
            f"{f.value.id}.{f.attr}"
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
            else (f.id if isinstance(f, ast.Name) else "")
        )
        if fname == "" or self.is_ref(f):
            raise self.error(
                node,
                "only slice(...), torch.device(...), torch.Size(...), Type(...) and registered "
                "attribute classes can be called",
            )
        args = [self.value(a) for a in node.args]
        kwargs = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise self.error(kw.value, "'**' unpacking is not allowed")
            kwargs[kw.arg] = self.value(kw.value)
        try:
            if fname == "slice" and 1 <= len(args) <= 3 and not kwargs:
                return slice(*args)
            if fname == "torch.device" and len(args) == 1 and isinstance(args[0], str) and not kwargs:
                return torch.device(args[0])
            if fname == "torch.Size" and len(args) == 1 and not kwargs:
                return torch.Size(args[0])
            if fname == "Type" and len(args) == 1 and isinstance(args[0], str) and not kwargs:
                return parse_type(args[0])
            cls = ATTR_CLASSES.get(fname)
            if cls is not None and attrs.has(cls) and not args:
                return cls(**kwargs)
        except Exception as e:  # constructors report bad arguments in many ways (torch: RuntimeError)
            raise self.error(node, f"bad {fname}(...): {type(e).__name__}: {e}") from None
        raise self.error(
            node,
            f"cannot call {fname}(...) here; expected slice(a, b, c), torch.device(s), "
            "torch.Size([...]), Type(s) or a registered attribute class with keyword arguments",
        )


def _close(word: str, choices: Any) -> str:
    near = difflib.get_close_matches(word, list(choices), n=3)
    return f"; did you mean {', '.join(near)}?" if near else ""


class _Parser:
    def __init__(
        self,
        text: str,
        constants: Mapping[str, torch.Tensor] | None,
        objects: Mapping[str, Any] | None,
        allow_unbound: bool,
        source: str,
    ) -> None:
        self.source = source
        self.lines = [_Line(self, i + 1, raw) for i, raw in enumerate(text.splitlines())]
        self.constants = constants
        self.objects = objects
        self.allow_unbound = allow_unbound
        self.max_constant_bytes = MAX_CONSTANT_BYTES
        self.values: dict[str, Value] = {}
        self.defined_at: dict[str, int] = {}

    def significant(self) -> Any:
        for ln in self.lines:
            if ln.text.strip():
                yield ln

    def parse(self) -> Graph:
        lines = self.significant()
        header = next(lines, None)
        if header is None:
            raise ParseError("expected 'graph @name(...) {', found no graph", 1, 1, self.source)
        graph = self.header(header)
        for ln in lines:
            if ln.at("return"):
                self.output(graph, ln)
                break
            if ln.at("}"):
                raise ln.error("expected 'return <outputs>' before '}'")
            self.node(graph, ln)
        else:
            last = self.lines[-1] if self.lines else header
            raise ParseError(
                "expected 'return <outputs>' and '}' to close the graph",
                last.lineno,
                len(last.text) + 1,
                self.source,
                last.raw,
            )
        closing = next(lines, None)
        if closing is None:
            last = self.lines[-1]
            raise ParseError(
                "expected '}' to close the graph, found end of text",
                last.lineno,
                len(last.text) + 1,
                self.source,
                last.raw,
            )
        if not closing.eat("}"):
            raise closing.error(f"expected '}}' after return, found {closing.found()}")
        if not closing.done():
            raise closing.error(f"unexpected text after '}}': {closing.found()}")
        extra = next(lines, None)
        if extra is not None:
            extra.ws()
            raise extra.error("unexpected text after the graph (one graph per text)")
        self.bind_constants(graph)
        if self.objects is not None:
            graph.objects = dict(self.objects)
        return graph

    # -- header ----------------------------------------------------------------
    def header(self, ln: _Line) -> Graph:
        ln.expect("graph", "'graph @name(...) {'")
        ln.expect("@", "'@' and the graph name")
        graph = Graph(ln.symbol("a graph name"))
        ln.expect("(")
        if not ln.eat(")"):
            while True:
                ln.ws()
                col = ln.pos
                name = ln.value_name()
                ln.expect(":", "':' and the input's type")
                typ = ln.type()
                default, has_default = None, False
                if ln.eat("="):
                    start, end, refs = ln.span(",)")
                    if start == end:
                        raise ln.error("expected a default value after '='")
                    tree, walker = ln.expr(start, end, refs)
                    default, has_default = walker.value(tree), True
                self.define(ln, name, col)
                self.values[name] = graph.add_input(name, typ, default, has_default, exact=True)
                if ln.eat(")"):
                    break
                ln.expect(",", "',' or ')' in the input list")
        if ln.at("attributes"):
            ln.expect("attributes")
            if not ln.at("("):
                raise ln.error("expected '(' after 'attributes'")
            start, end, refs = ln.span("")
            tree, walker = ln.expr(start, end, refs, prefix="f")
            assert isinstance(tree, ast.Call)
            for a in tree.args:
                raise walker.error(a, "graph attributes are keyword arguments (training=True)")
            for kw in tree.keywords:
                if kw.arg != "training":
                    raise walker.error(kw.value, f"unknown graph attribute {kw.arg!r}; known: training")
                value = walker.value(kw.value)
                if not isinstance(value, bool):
                    raise walker.error(kw.value, "training must be True or False")
                graph.training = value
        ln.expect("{", "'{' to open the graph body")
        if not ln.done():
            raise ln.error(f"unexpected text after '{{': {ln.found()}; put each node on its own line")
        return graph

    def define(self, ln: _Line, name: str, col: int) -> None:
        if name in self.defined_at:
            raise ln.error(f"%{name} is already defined on line {self.defined_at[name]}", col)
        self.defined_at[name] = ln.lineno

    # -- nodes -----------------------------------------------------------------
    def node(self, graph: Graph, ln: _Line) -> None:
        ln.ws()
        name_col = ln.pos
        if not ln.at("%"):
            raise ln.error(f"expected a node '%name: type = op(...)', 'return' or '}}', found {ln.found()}")
        name = ln.value_name()
        typ = ln.type() if ln.eat(":") else None
        ln.expect("=", "'=' after the value name")
        ln.ws()
        op_col = ln.pos
        opname = ln.match(_OPNAME, "an op name")
        cls = OP_REGISTRY.get(opname)
        if cls is None:
            raise ln.error(f"unknown op {opname!r}{_close(opname, OP_REGISTRY)}", op_col)
        if not ln.at("("):
            raise ln.error(f"expected '(' after op name {opname!r}, found {ln.found()}")
        start, end, refs = ln.span("")
        tree, walker = ln.expr(start, end, refs, prefix="f")
        assert isinstance(tree, ast.Call)
        operands: list[Value] = []
        for a in tree.args:
            if not walker.is_ref(a):
                raise walker.error(a, "expected an operand %name; attributes are keyword arguments (attr=value)")
            assert isinstance(a, ast.Name)
            operands.append(self.lookup(ln, a.id[1:], walker.col(a)))
        op = self.make_op(ln, cls, tree, walker, operands, op_col)
        scope = None
        if ln.eat("@"):
            scope = ln.symbol("a scope name after '@'")
        if not ln.done():
            raise ln.error(f"unexpected text after the node: {ln.found()}")
        if typ is None:
            try:
                typ = infer_type(op, [v.type for v in operands])
            except Exception as e:
                raise ln.error(
                    f"cannot infer the type of %{name} ({type(e).__name__}: {e}); write it as %{name}: <type> = ...",
                    name_col,
                ) from None
        self.define(ln, name, name_col)
        self.values[name] = graph.add_node(op, operands, typ, name, scope, exact_name=True)

    def lookup(self, ln: _Line, name: str, col: int) -> Value:
        if name.isdigit():
            raise ln.error(
                f"%{name}: operands are listed by name; %<index> only refers to an operand inside an attribute", col
            )
        v = self.values.get(name)
        if v is None:
            raise ln.error(
                f"use of undefined value %{name} (values must be defined before use){_close(name, self.values)}", col
            )
        return v

    def make_op(
        self, ln: _Line, cls: type[Op], tree: ast.Call, walker: _Walker, operands: list[Value], op_col: int
    ) -> Op:
        names = [v.name for v in operands]

        def ref(name: str, col: int) -> Ref:
            if name.isdigit():
                return Ref(int(name))
            if name in names:
                return Ref(names.index(name))
            raise ln.error(
                f"%{name} is not an operand of this node; a value used in an attribute must also "
                "be listed as a positional operand",
                col,
            )

        walker.on_ref = ref
        fields = {f.alias or f.name: f for f in attrs.fields(cls) if f.init}
        kwargs: dict[str, Any] = {}
        for kw in tree.keywords:
            if kw.arg is None:
                raise walker.error(kw.value, "'**' unpacking is not allowed")
            if kw.arg not in fields:
                known = ", ".join(fields) or "none"
                raise walker.error(
                    kw.value,
                    f"op {cls.name!r} has no attribute {kw.arg!r}{_close(kw.arg, fields)} (attributes: {known})",
                )
            if kw.arg in kwargs:
                raise walker.error(kw.value, f"attribute {kw.arg!r} given twice")
            kwargs[kw.arg] = walker.value(kw.value)
        missing = [n for n, f in fields.items() if f.default is attrs.NOTHING and n not in kwargs]
        if missing:
            raise ln.error(f"op {cls.name!r} needs attribute(s) {', '.join(missing)}", op_col)
        self.check_names(cls, tree, walker, kwargs)
        try:
            return cls(**kwargs)
        except Exception as e:
            raise ln.error(f"invalid attributes for op {cls.name!r}: {type(e).__name__}: {e}", op_col) from None

    def check_names(self, cls: type[Op], tree: ast.Call, walker: _Walker, kwargs: dict[str, Any]) -> None:
        """Refuse call targets and attribute names outside the allowlist (qir.ir.call_targets)."""
        where = {kw.arg: kw.value for kw in tree.keywords}
        if cls.name == "call" and isinstance(kwargs.get("target"), str):
            target, kind = kwargs["target"], kwargs.get("kind")
            if kind == "function" and lookup_call_target(target, self.objects) is None:
                raise walker.error(where["target"], refusal(target))
            if kind == "method" and not method_allowed(target):
                raise walker.error(
                    where["target"],
                    f"method {target!r} is not allowed: IR text may call public torch.Tensor methods that "
                    "only compute (not numpy, untyped_storage, register_hook, apply_, ...); for a method of "
                    f"another type you trust, call qir.ir.register_call_method({target!r}) first",
                )
        if cls.name == "getattr" and isinstance(kwargs.get("attr"), str) and not attribute_allowed(kwargs["attr"]):
            raise walker.error(
                where["attr"],
                f"attribute {kwargs['attr']!r} cannot be read from IR text: only public attributes "
                "(no leading '_') that do not reach tensor storage",
            )

    # -- output and constants --------------------------------------------------
    def output(self, graph: Graph, ln: _Line) -> None:
        ln.expect("return")
        start, end, refs = ln.span("")
        if start == end:
            raise ln.error("expected the output after 'return' (write 'return None' for no output)")
        tree, walker = ln.expr(start, end, refs)
        walker.on_ref = lambda name, col: self.lookup(ln, name, col)
        graph.set_output(walker.value(tree))
        if not ln.done():
            raise ln.error(f"unexpected text after the output: {ln.found()}")

    def bind_constants(self, graph: Graph) -> None:
        for n in graph.nodes:
            if n.op.name != "constant":
                continue
            key = n.op.key  # type: ignore[attr-defined]
            ln = self.lines[self.defined_at[n.name] - 1]
            if isinstance(n.type, TensorType) and n.type.has_unknown_dims:
                raise ln.error(
                    f"constant {key!r} (%{n.name}) is declared {n.type}: "
                    "a constant's sizes are known, write them (no '?')",
                    ln.text.find("%"),
                )
            if self.constants is not None and key in self.constants:
                t = self.constants[key]
                if isinstance(n.type, TensorType) and tuple(t.shape) != n.type.shape:
                    raise ln.error(
                        f"constant {key!r} (%{n.name}) is declared {n.type} but the tensor given "
                        f"has shape {tuple(t.shape)}",
                        ln.text.find("%"),
                    )
            elif self.allow_unbound and isinstance(n.type, TensorType):
                nbytes = n.type.numel * n.type.dtype.to_torch().itemsize if _all_nonneg(n.type.shape) else 0
                if nbytes > self.max_constant_bytes:
                    raise ln.error(
                        f"constant {key!r} (%{n.name}) is declared {n.type}: {nbytes:,} bytes of zeros "
                        f"exceeds the limit of {self.max_constant_bytes:,} bytes; pass its tensor in "
                        "constants= or raise max_constant_bytes=",
                        ln.text.find("%"),
                    )
                try:
                    t = mark_stand_in(torch.zeros(n.type.shape, dtype=n.type.dtype.to_torch()))
                except RuntimeError as e:  # negative dimensions
                    raise ln.error(f"cannot bind zeros for constant {key!r}: {e}", ln.text.find("%")) from None
            else:
                where = "pass it in constants=" if self.constants is not None else "pass constants={...}"
                raise ln.error(
                    f"constant {key!r} (%{n.name}) has no tensor; {where} or allow_unbound=True to bind zeros",
                    ln.text.find("%"),
                )
            graph.constants[key] = t


def parse_graph(
    text: str,
    constants: Mapping[str, torch.Tensor] | None = None,
    objects: Mapping[str, Any] | None = None,
    *,
    allow_unbound: bool = False,
    source: str = "<text>",
    max_constant_bytes: int = MAX_CONSTANT_BYTES,
) -> Graph:
    """Parse one graph written by :func:`~qir.ir.printer.print_graph`.

    ``constants`` maps each ``constant`` node's key to its tensor (extra keys are ignored);
    a missing key is an error unless ``allow_unbound`` binds zeros of the declared type;
    a zero-filled constant larger than ``max_constant_bytes`` (default
    :data:`MAX_CONSTANT_BYTES`, 256 MiB) is a :class:`ParseError`, not an allocation.
    ``objects`` becomes :attr:`Graph.objects`. ``source`` names the text in errors.
    The result is not verified; call :func:`qir.ir.verify` when it should be.
    """
    parser = _Parser(text, constants, objects, allow_unbound, source)
    parser.max_constant_bytes = max_constant_bytes
    return parser.parse()


def parse_value(text: str) -> Any:
    """Parse one attribute expression without ``%`` references (``(1, 2)``, ``torch.int8``)."""
    ln = _Line(_Parser(text, None, None, False, "<value>"), 1, text)
    start, end, refs = ln.span("")
    if start == end:
        raise ln.error("expected an expression")
    tree, walker = ln.expr(start, end, refs)
    return walker.value(tree)
