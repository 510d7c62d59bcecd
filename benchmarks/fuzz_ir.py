"""Mutation fuzzer over IR text: hostile or careless edits must be ParseErrors or VerifyErrors.

Seeds are real graphs: the golden files under tests/golden that parse, verify and run, the
text of small models traced by qir's front end (conv-bn-relu-pool-linear, a residual
block with cat / interpolate / sigmoid gating, an attention-style block with matmul,
softmax and layer norm), and the integer IR of three converted models (two on both marches,
one with self-attention and LSTM cells on Bayes; benchmarks/fuzz_ir_converted.py: qconv, qadd,
qlut, qsoftmax, qlayer_norm, qcat, qmatmul, qmultihead_attention, qlstm_cell, ... with their
weights, multipliers, shifts and tables as constants). Each case applies one to three seeded
mutations to one seed's text (numbers and dimensions set to edge values, dtypes
and op names swapped, operands rewired, kwargs dropped or replaced, lines deleted, duplicated, swapped or spliced from
another seed, NUL / unicode / bracket noise, hostile call targets, truncation, deep
nesting). On a seed with constants (the converted models), half the cases also set the values
of one to three constants its nodes read to edge values (a shift of 63 or 99, a multiplier of 2**40, a NaN,
zero or negative scale, a table entry of -1, one entry or all of them), the text left as it is
or mutated too: the verifier must refuse what the integer kernels cannot run. On a seed with
a qint16 segmented table (``table16``), 30% of the cases break one of the table's rules instead
(:func:`mutate_table16`: knot order, interval widths, ends, value range, ``table16_version``). Then

1. parses it (``allow_unbound=True``, under ``max_constant_bytes``) and binds its constants:
   the seed's own tensor where the key and declared type still match, otherwise seeded random
   values of the declared type,
2. verifies it (with those constants bound: what verify sees is what runs),
3. runs it on seeded random inputs of the declared input types.

Outcomes: ``parse-error`` and ``verify-error`` are correct refusals, ``ran`` is a graph
that verified and ran, ``no-inputs`` a verified graph whose inputs have no random
generator (objects), ``unbound-module`` a verified graph that calls a module the text
cannot carry, refused by ``run_graph`` before any node runs, ``stand-in`` a verified graph
that still holds a zero stand-in constant (5% of the cases leave one, where the text has
constants), refused by ``run_graph`` before any node runs; every other class is a bug:
an exception other than ParseError at parse time or other than VerifyError in verify,
``verified-but-run-failed`` (a verifier gap), ``memory`` (an allocation over the address-space limit, set with
``resource.setrlimit(RLIMIT_AS)`` to the process size plus ``--mem-gib``), ``timeout`` (a case
over ``--timeout`` wall seconds twice: a case that times out once runs again, since a hang
repeats and a stall of a loaded machine does not; the table reports how many did not repeat).
Bugs are printed with the first mutated text that produced them.

    python benchmarks/fuzz_ir.py [--cases 10000] [--seed 0] [--mem-gib 2] [--timeout 5]
        [--json benchmarks/results/fuzz_ir.json] [--txt benchmarks/results/fuzz_ir.txt]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import platform
import random
import re
import resource
import signal
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qir.frontend import trace
from qir.ir import (
    OP_REGISTRY,
    Graph,
    ParseError,
    StandInError,
    TensorType,
    UnboundModuleError,
    VerifyError,
    parse_graph,
    print_graph,
    run_graph,
    verify,
)
from qir.ir.types import UNKNOWN_DIM, DType

try:
    from benchmarks.fuzz_ir_converted import converted_seeds
    from benchmarks.table16_mutation import RULES as TABLE16_RULES
    from benchmarks.table16_mutation import break_rule as break_table16_rule
except ImportError:  # run as a script: benchmarks/ is on sys.path, not the repository root
    from fuzz_ir_converted import converted_seeds  # type: ignore[no-redef]
    from table16_mutation import RULES as TABLE16_RULES  # type: ignore[no-redef]
    from table16_mutation import break_rule as break_table16_rule  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
OK_CLASSES = ("parse-error", "verify-error", "ran", "no-inputs", "unbound-module", "stand-in")
MAX_CONSTANT_BYTES = 64 * 2**20
#: share of the cases on a seed with constants (the converted models) whose constant values are mutated
CONSTANT_MUTATION_RATE = 0.5
#: share of the cases on a seed with a qint16 segmented table whose table breaks one of its rules
TABLE16_MUTATION_RATE = 0.3
#: share of the cases that leave one zero stand-in constant unbound (run must refuse it)
STAND_IN_RATE = 0.05


# ----------------------------------------------------------------------------- seeds


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(torch.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(y, 1))


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 1)
        self.gate = nn.Conv2d(8, 8, 1, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x)) + x
        z = torch.cat([y, self.b(x)], dim=1)
        z = z * torch.sigmoid(self.gate(z))
        z = nn.functional.avg_pool2d(z, 2)
        return nn.functional.interpolate(z, scale_factor=2.0, mode="nearest")


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        att = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.35, dim=-1)
        return torch.matmul(att, v).reshape(x.shape[0], -1).mean(dim=1)


SEED_MODELS: tuple[tuple[str, Callable[[], nn.Module], tuple[int, ...]], ...] = (
    ("frontend:convnet", _ConvNet, (2, 3, 8, 8)),
    ("frontend:residual", _Residual, (1, 4, 6, 6)),
    ("frontend:attention", _Attention, (2, 5, 8)),
)


def _body(text: str) -> str:
    """The graph text of a golden file (its ``//`` directive and CHECK lines dropped)."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("//")]
    out: list[str] = []
    for ln in lines:
        out.append(ln)
        if ln.strip() == "}":
            break
    return "\n".join(out)


Seed = tuple[str, str, dict[str, torch.Tensor]]


@functools.cache
def seed_texts() -> tuple[Seed, ...]:
    """(name, text, constants) of every seed that parses, verifies and runs unmutated."""
    seeds: list[Seed] = []
    for path in sorted(GOLDEN.rglob("*.qir")):
        seeds.append((f"golden:{path.relative_to(GOLDEN)}", _body(path.read_text()), {}))
    torch.manual_seed(0)
    for name, make, shape in SEED_MODELS:
        model = make().eval()
        seeds.append((name, print_graph(trace(model, (torch.randn(shape),))), {}))
    seeds.extend(converted_seeds())
    return tuple((n, t, c) for n, t, c in seeds if run_case(t, 0, constants=c)[0] == "ran")


# ----------------------------------------------------------------------------- mutations

_NUM = re.compile(r"(?<![\w.%])-?\d+(?:\.\d+)?(?:e-?\d+)?(?![\w.])")
_DIMS = re.compile(r"(?<=tensor<)[0-9?x]*?(?=[a-z]+\d*[,>])")
_DTYPE = re.compile(r"(?<=[<x])(f32|f64|f16|bf16|i64|i32|i16|i8|u8|bool|qi8|qi16|qi32|qbool)(?=[,>])")
_OPCALL = re.compile(r"(?<== )([A-Za-z_][A-Za-z0-9_.]*)(?=\()")
_VALUE = re.compile(r"%[A-Za-z_][A-Za-z0-9_]*")
_KWARG = re.compile(r", [a-z_]+=(?:\"[^\"]*\"|[^,()]+|\([^()]*\)|\[[^\[\]]*\])")
_STRING = re.compile(r"\"[^\"]*\"")
_DECL = re.compile(r"(%[A-Za-z_][A-Za-z0-9_]*): [^=]+ = ")

EDGE_NUMBERS = (
    "0",
    "1",
    "-1",
    "2",
    "3",
    "7",
    "-2",
    "255",
    "65536",
    "2147483648",
    "9223372036854775807",
    "18446744073709551617",
    "1" + "0" * 30,
    "1" * 5000,
    "0.0",
    "-0.0",
    "1e308",
    "1e-320",
    "inf",
    "-inf",
    "nan",
)
EDGE_DIMS = ("0", "1", "2", "3", "5", "7", "64", "30000", "1000000", "4611686018427387904", "99999999999999999999")
DTYPES = tuple(d.value for d in DType)
NOISE = (
    "\x00",
    "\u2028",
    "\u00e9",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    '"',
    "'",
    "%",
    "@",
    "//",
    "\\",
    ",",
    "=",
    "<",
    ">",
    " ",
)
HOSTILE_STRINGS = (
    '"os.system"',
    '"builtins.eval"',
    '"torch.load"',
    '"torch.os.system"',
    '"__class__"',
    '"__globals__"',
    '"numpy"',
    '"untyped_storage"',
    '"subprocess.Popen"',
    '"\\x00"',
    '"\\N{bad}"',
    '"' + "A" * 1000 + '"',
)


def _sub_one(rx: re.Pattern[str], text: str, rng: random.Random, repl: Callable[[str], str]) -> str:
    ms = list(rx.finditer(text))
    if not ms:
        return text
    m = rng.choice(ms)
    return text[: m.start()] + repl(m.group(0)) + text[m.end() :]


def _lines(text: str) -> list[str]:
    return text.split("\n")


def _body_range(lines: list[str]) -> tuple[int, int]:
    """Indices of the node lines (between the header and ``return``)."""
    end = next((i for i, ln in enumerate(lines) if ln.strip().startswith("return")), len(lines) - 1)
    return 1, max(end, 1)


def _bump(s: str, by: int) -> str:
    """The integer part of the number ``s`` plus ``by`` (a 5,000-digit literal too; an infinite one as is)."""
    try:
        return str(int(s) + by)
    except ValueError:
        v = float(s)
        return str(int(v) + by) if math.isfinite(v) else s


def _mutate_once(text: str, rng: random.Random, pool: list[str]) -> str:
    kind = rng.randrange(19)
    lines = _lines(text)
    lo, hi = _body_range(lines)
    if kind == 0:
        return _sub_one(_NUM, text, rng, lambda _: rng.choice(EDGE_NUMBERS))
    if kind == 1:
        return _sub_one(_NUM, text, rng, lambda s: _bump(s, rng.choice((-1, 1))))
    if kind == 2:

        def dims(s: str) -> str:
            parts = s.split("x")[:-1]
            if not parts:
                return rng.choice(EDGE_DIMS) + "x"
            i = rng.randrange(len(parts))
            # an earlier mutation may have left an empty dimension ("2xxqi16"): read it as 0
            d = int(parts[i]) if parts[i].isdigit() else 0
            parts[i] = rng.choice((*EDGE_DIMS, str(max(d - 1, 0)), str(d + 1)))
            if rng.random() < 0.2:
                del parts[rng.randrange(len(parts))]
            return "".join(p + "x" for p in parts)

        return _sub_one(_DIMS, text, rng, dims)
    if kind == 3:
        return _sub_one(_DTYPE, text, rng, lambda _: rng.choice(DTYPES))
    if kind == 4:
        return _sub_one(_OPCALL, text, rng, lambda _: rng.choice(sorted(OP_REGISTRY)))
    if kind == 5:  # rewire an operand to another value defined earlier (or later)
        names = sorted(set(_VALUE.findall(text)))
        return _sub_one(_VALUE, text, rng, lambda _: rng.choice(names))
    if kind == 6:  # drop a keyword attribute
        return _sub_one(_KWARG, text, rng, lambda _: "")
    if kind == 7:  # copy a keyword attribute from anywhere in the pool onto a node
        donors = [m.group(0) for t in pool for m in _KWARG.finditer(t)]
        if not donors or hi <= lo:
            return text
        i = rng.randrange(lo, hi)
        lines[i] = re.sub(r"\)(?=( @[^ ]+)?\s*$)", rng.choice(donors) + ")", lines[i], count=1)
        return "\n".join(lines)
    if kind == 8 and hi > lo:
        del lines[rng.randrange(lo, hi)]
        return "\n".join(lines)
    if kind == 9 and hi > lo:
        i = rng.randrange(lo, hi)
        lines.insert(rng.randrange(lo, hi + 1), lines[i])
        return "\n".join(lines)
    if kind == 10 and hi - lo >= 2:
        i, j = rng.sample(range(lo, hi), 2)
        lines[i], lines[j] = lines[j], lines[i]
        return "\n".join(lines)
    if kind == 11:  # splice a node line from another seed
        donor = _lines(rng.choice(pool))
        dlo, dhi = _body_range(donor)
        if dhi > dlo:
            lines.insert(rng.randrange(lo, hi + 1), donor[rng.randrange(dlo, dhi)])
        return "\n".join(lines)
    if kind == 12:
        pos = rng.randrange(len(text) + 1)
        return text[:pos] + rng.choice(NOISE) + text[pos:]
    if kind == 13:
        pos = rng.randrange(len(text)) if text else 0
        return text[:pos] + text[pos + 1 :]
    if kind == 14:
        return _sub_one(_STRING, text, rng, lambda _: rng.choice(HOSTILE_STRINGS))
    if kind == 15:  # let the parser infer the type
        return _sub_one(_DECL, text, rng, lambda s: s.split(":")[0] + " = ")
    if kind == 16:  # deep nesting inside an attribute
        depth = rng.choice((10, 100, 199, 250, 1000))
        return _sub_one(_NUM, text, rng, lambda s: "(" * depth + s + ",)" + ")" * (depth - 1))
    if kind == 17:
        return text[: rng.randrange(len(text) + 1)]
    if kind == 18:  # unknown dimensions: one size of a type (or all of them) becomes '?'

        def unknown(s: str) -> str:
            parts = s.split("x")[:-1]
            if not parts:
                return s
            if rng.random() < 0.3:
                return "?x" * len(parts)
            parts[rng.randrange(len(parts))] = "?"
            return "".join(p + "x" for p in parts)

        return _sub_one(_DIMS, text, rng, unknown)
    return text


EDGE_INT_VALUES = (
    0,
    1,
    -1,
    2,
    31,
    32,
    62,
    63,
    64,
    99,
    -99,
    127,
    128,
    -129,
    255,
    256,
    32767,
    32768,
    -32769,
    2**31 - 1,
    2**31,
    -(2**31),
    2**40,
    2**62,
    2**63 - 1,
    -(2**63),
)
EDGE_FLOAT_VALUES = (0.0, -0.0, -1.0, -1e-3, 1e-45, 1e-30, 1e30, 3e38, math.inf, -math.inf, math.nan)


def read_constants(text: str) -> list[str]:
    """The keys of the constants a graph text's nodes read (a constant no node uses runs nothing)."""
    keys = []
    for m in re.finditer(r'^\s*(%[A-Za-z_][A-Za-z0-9_]*)\b[^=]*= constant\(key="([^"]*)"', text, re.M):
        if len(re.findall(re.escape(m.group(1)) + r"\b", text)) > 1:
            keys.append(m.group(2))
    return keys


def mutate_constants(
    constants: dict[str, torch.Tensor], rng: random.Random, read: list[str] | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    """A copy of ``constants`` with one to three tensors' values (of the keys in ``read``, default
    all) set to edge values (one entry, or all of them), clamped into each tensor's dtype; and a
    description of what changed."""
    out = dict(constants)
    pick = constants if read is None else read
    keys = sorted(k for k in pick if k in constants and constants[k].numel() and constants[k].dtype != torch.bool)
    changes = []
    for _ in range(rng.choice((1, 1, 2, 3)) if keys else 0):
        key = rng.choice(keys)
        t = out[key].clone()
        if t.dtype.is_floating_point:
            v: float = rng.choice(EDGE_FLOAT_VALUES)
            if math.isfinite(v):
                v = max(min(v, torch.finfo(t.dtype).max), -torch.finfo(t.dtype).max)
        else:
            info = torch.iinfo(t.dtype)
            v = max(info.min, min(info.max, rng.choice(EDGE_INT_VALUES)))
        if rng.random() < 0.5:
            i = rng.randrange(t.numel())
            t.view(-1)[i] = v
            changes.append(f"{key}[{i}]={v}")
        else:
            t.fill_(v)
            changes.append(f"{key}[:]={v}")
        out[key] = t
    return out, ", ".join(changes)


def mutate_table16(
    text: str, constants: dict[str, torch.Tensor], rng: random.Random
) -> tuple[str, dict[str, torch.Tensor], str]:
    """One rule of a segmented table broken: its knot codes out of order, a width that is not a
    power of two, the ends moved, a value outside the output range, the table's ``table16_version``
    changed in the text (with the values as they are). The text, a copy of ``constants``, and what changed."""
    out = dict(constants)
    keys = sorted(k for k, t in constants.items() if k.endswith("table16") and t.numel())
    if not keys:
        return text, out, ""
    key = rng.choice(keys)
    t = out[key].clone()
    op = rng.choice([*TABLE16_RULES, "version", "rows"])
    if t.dim() != 2 or op == "version":
        v = rng.choice(["1", "3", "0", "-1", "2.0", '"2"', "None"])
        return re.sub(r"table16_version=2\b", f"table16_version={v}", text, count=1), out, f"table16_version={v}"
    if op in TABLE16_RULES:
        break_table16_rule(rng, t[0], t[1], op)  # the rows are views: t changes in place
    else:
        t = t.flip(0)  # values where the knot codes belong
    out[key] = t
    return text, out, f"{key}: {op}"


def mutate(text: str, rng: random.Random, pool: list[str]) -> str:
    for _ in range(rng.choice((1, 1, 2, 3))):
        text = _mutate_once(text, rng, pool)
    return text


# ----------------------------------------------------------------------------- one case


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    if seconds <= 0 or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise _Timeout

    try:
        old = signal.signal(signal.SIGALRM, fire)
    except ValueError:  # not the main thread: no deadline
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


#: the size an unknown input dimension takes when the seed has none for it (the seed's own size otherwise)
UNKNOWN_INPUT_SIZE = 4


def _input_size(t: TensorType, seed_shape: tuple[int, ...] | None) -> tuple[int, ...]:
    """``t``'s shape with its unknown dimensions at the seed's sizes for this input: the text's other
    types were written for those (a flatten declared ``1x64``), so the run is the one verify vouched for."""
    if seed_shape is None or len(seed_shape) != t.rank:
        seed_shape = (UNKNOWN_DIM,) * t.rank
    return tuple(
        d if d != UNKNOWN_DIM else (s if s != UNKNOWN_DIM else UNKNOWN_INPUT_SIZE)
        for d, s in zip(t.shape, seed_shape, strict=True)
    )


def input_shapes(text: str) -> dict[str, tuple[int, ...]]:
    """Input name -> tensor shape of a seed's graph."""
    graph = parse_graph(text, allow_unbound=True, max_constant_bytes=MAX_CONSTANT_BYTES)
    return {a.name: a.type.shape for a in graph.inputs if isinstance(a.type, TensorType)}


def _random_value(t: Any, g: torch.Generator, seed_shape: tuple[int, ...] | None = None) -> Any:
    from qir.ir.types import ScalarType, SequenceType

    if isinstance(t, TensorType):
        t = t.with_shape(_input_size(t, seed_shape))
        dt = t.dtype.to_torch()
        if dt.is_floating_point:
            return torch.randn(t.shape, generator=g).to(dt)
        if dt == torch.bool:
            return torch.randint(0, 2, t.shape, generator=g).bool()
        lo, hi = t.dtype.qrange if t.dtype.is_quantized else (-8, 8)
        return torch.randint(max(lo, -8), min(hi, 7) + 1, t.shape, generator=g, dtype=dt)
    if isinstance(t, ScalarType):
        return {"int": int(torch.randint(1, 4, (), generator=g)), "float": 0.5, "bool": True}[t.kind]
    if isinstance(t, SequenceType):
        items = [_random_value(e, g) for e in t.elements]
        return torch.Size(items) if t.kind == "size" else (list(items) if t.kind == "list" else tuple(items))
    raise LookupError(f"no random value of type {t}")


def _bind_constants(graph: Graph, g: torch.Generator, seed: dict[str, torch.Tensor], keep_stand_in: bool) -> None:
    """The seed's tensor where key, shape and dtype match the text's constant, else random values;
    with ``keep_stand_in`` the last constant keeps the zero stand-in the parser bound."""
    keys = list(graph.constants)
    for key in keys[:-1] if keep_stand_in else keys:
        t = graph.constants[key]
        real = seed.get(key)
        if real is not None and real.shape == t.shape and real.dtype == t.dtype:
            graph.constants[key] = real
        elif t.dtype.is_floating_point:
            graph.constants[key] = torch.randn(t.shape, generator=g).to(t.dtype)
        elif t.dtype == torch.bool:
            graph.constants[key] = torch.randint(0, 2, t.shape, generator=g).bool()
        else:
            graph.constants[key] = torch.randint(-8, 8, t.shape, generator=g).to(t.dtype)


def _where(e: BaseException) -> str:
    """The op a run-time error names (``node %x = conv2d failed``), for grouping."""
    m = re.search(r"= ([A-Za-z_][A-Za-z0-9_.]*)(?: \(module [^)]*\))? failed", str(e))
    return m.group(1) if m else "?"


def run_case(
    text: str,
    seed: int,
    timeout: float = 0.0,
    constants: dict[str, torch.Tensor] | None = None,
    keep_stand_in: bool = False,
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> tuple[str, str]:
    """(outcome class, detail) of parsing, verifying and running ``text`` (``constants``: the seed's;
    ``keep_stand_in``: leave the last constant's zero stand-in bound, which run_graph must refuse;
    ``shapes``: the seed's input shapes, the sizes unknown input dimensions take)."""
    stage = "parse"
    try:
        with _deadline(timeout), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                graph = parse_graph(text, allow_unbound=True, max_constant_bytes=MAX_CONSTANT_BYTES, source="<fuzz>")
            except ParseError as e:
                return "parse-error", e.reason
            g = torch.Generator().manual_seed(seed)
            _bind_constants(graph, g, constants or {}, keep_stand_in)
            stage = "verify"
            try:
                verify(graph)
            except VerifyError as e:
                return "verify-error", str(e)
            stage = "inputs"
            try:
                inputs = [
                    _random_value(a.type, g, (shapes or {}).get(a.name)) for a in graph.inputs if not a.has_default
                ]
            except LookupError as e:
                return "no-inputs", str(e)
            stage = "run"
            try:
                run_graph(graph, *inputs)
            except UnboundModuleError as e:
                return "unbound-module", str(e)
            except StandInError as e:
                return "stand-in", str(e)
            except MemoryError:
                raise
            except Exception as e:
                if "can't allocate memory" in str(e) or "not enough memory" in str(e):
                    raise MemoryError(str(e)) from e
                return f"verified-but-run-failed: {_where(e)}: {type(e.__cause__ or e).__name__}", str(e)
            return "ran", ""
    except _Timeout:
        return f"timeout in {stage}", ""
    except MemoryError as e:
        return f"memory in {stage}", str(e)[:200]
    except RecursionError as e:
        return f"{stage}: RecursionError", str(e)[:200]
    except Exception as e:
        return f"{stage}: {type(e).__name__}", str(e)[:300]


# ----------------------------------------------------------------------------- the run


@contextlib.contextmanager
def address_space_limit(extra_bytes: int) -> Iterator[int]:
    """Cap this process's address space at its current size plus ``extra_bytes`` (soft limit)."""
    vm = 0
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                vm = int(line.split()[1]) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm + extra_bytes if vm else extra_bytes * 4
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def fuzz(cases: int, seed: int = 0, mem_bytes: int = 2 * 2**30, timeout: float = 5.0, only: str = "") -> dict[str, Any]:
    """Run ``cases`` mutations of the seeds whose name starts with ``only``; return counts per
    outcome class and the first example of each bug."""
    seeds = [s for s in seed_texts() if s[0].startswith(only)]
    if not seeds:
        raise ValueError(f"no seed name starts with {only!r}: names are {[n for n, _, _ in seed_texts()]}")
    pool = [t for _, t, _ in seeds]
    read = {n: read_constants(t) for n, t, _ in seeds}
    shapes = {n: input_shapes(t) for n, t, _ in seeds}
    rng = random.Random(seed)
    counts: Counter[str] = Counter()
    counts_values: Counter[str] = Counter()  # the cases whose constant values were mutated
    stalls = 0  # cases over the timeout once but not when run again
    examples: dict[str, dict[str, str]] = {}
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with address_space_limit(mem_bytes) as limit:
            for i in range(cases):
                name, text, constants = seeds[rng.randrange(len(seeds))]
                changed = ""
                if any(k.endswith("table16") for k in constants) and rng.random() < TABLE16_MUTATION_RATE:
                    mutated, constants, changed = mutate_table16(text, constants, rng)
                elif constants and rng.random() < CONSTANT_MUTATION_RATE:
                    # the values the text's constants hold, with the text as it is or mutated too
                    constants, changed = mutate_constants(constants, rng, read[name])
                    mutated = mutate(text, rng, pool) if rng.random() < 0.3 else text
                else:
                    mutated = mutate(text, rng, pool)
                keep = rng.random() < STAND_IN_RATE
                outcome, detail = run_case(mutated, seed + i, timeout, constants, keep, shapes[name])
                if outcome.startswith("timeout"):
                    # cases are deterministic: a hang repeats, a stall of a loaded shared machine
                    # does not. The retry's outcome counts; the stall is reported, not hidden.
                    outcome, detail = run_case(mutated, seed + i, timeout, constants, keep, shapes[name])
                    if not outcome.startswith("timeout"):
                        stalls += 1
                counts[outcome] += 1
                if changed:
                    counts_values[outcome] += 1
                if outcome not in OK_CLASSES and outcome not in examples:
                    examples[outcome] = {
                        "seed": name,
                        "case": str(i),
                        "detail": detail,
                        "text": mutated,
                        "constants": changed,
                    }
    finally:
        torch.set_num_threads(threads)
    bugs = sum(n for k, n in counts.items() if k not in OK_CLASSES)
    return {
        "cases": cases,
        "seed": seed,
        "seeds": [n for n, _, _ in seeds],
        "address_space_limit_bytes": limit,
        "seconds": round(time.perf_counter() - t0, 1),
        "counts": dict(counts.most_common()),
        "constant_value_cases": dict(counts_values.most_common()),
        "bugs": bugs,
        "timeouts_not_repeated": stalls,
        "examples": examples,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"fuzz_ir: {result['cases']:,} mutated IR texts from {len(result['seeds'])} seeds, seed {result['seed']}, "
        f"address space limit {result['address_space_limit_bytes'] / 2**30:.2f} GiB, {result['seconds']} s",
        f"  {'outcome':<60} {'cases':>7}  verdict",
        f"  {'-' * 60} {'-' * 7}  -------",
    ]
    for k, n in result["counts"].items():
        lines.append(f"  {k:<60} {n:>7}  {'ok' if k in OK_CLASSES else 'BUG'}")
    lines.append(f"  {'bugs':<60} {result['bugs']:>7}")
    if result.get("timeouts_not_repeated"):
        lines.append(
            f"  over the timeout once, within it when run again (machine load; counted by the retry): "
            f"{result['timeouts_not_repeated']}"
        )
    cv = result.get("constant_value_cases") or {}
    if cv:
        lines.append(
            f"  of which with mutated constant values: {sum(cv.values()):,} ("
            + ", ".join(f"{k} {n}" for k, n in cv.items())
            + ")"
        )
    for k, ex in result["examples"].items():
        lines.append(f"\n[{k}] first at case {ex['case']} (seed {ex['seed']}): {ex['detail'][:300]}")
        if ex.get("constants"):
            lines.append(f"    constants: {ex['constants']}")
        lines.extend("    " + ln for ln in ex["text"].splitlines()[:40])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mem-gib", type=float, default=2.0, help="address space allowed above the process's size")
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds per case")
    ap.add_argument("--only", default="", help="mutate only the seeds whose name starts with this (converted:)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--txt", type=Path)
    args = ap.parse_args(argv)
    result = fuzz(args.cases, args.seed, int(args.mem_gib * 2**30), args.timeout, args.only)
    result["machine"] = f"{platform.machine()}, torch {torch.__version__}, python {platform.python_version()}"
    text = table(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.txt:
        args.txt.write_text(text + "\n")
    return 1 if result["bugs"] else 0


if __name__ == "__main__":
    sys.exit(main())
