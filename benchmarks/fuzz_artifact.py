"""Mutation fuzzer for compiled artifacts: what a hostile or careless file does to ``load_compiled``.

Compiles a few small models (both marches; convolutions, pooling, linear, add, lookup
tables, layout functions; on Bayes, qint16 segmented tables, self-attention and LSTM cells from
benchmarks/fuzz_ir_converted.py), then writes seeded mutations of their files (header values and
structure, raw header text, data bytes, the container) and loads each with a memory bound
(``load_compiled(path, max_memory=MAX_MEMORY)``, 1 GiB) and runs it under an address-space
limit (``RLIMIT_AS``, 2 GiB above the start-up mapping), so a huge allocation fails fast and is
counted instead of swapping. Every case ends in one class:

* ``refused at load (ArtifactError)`` / ``refused at run (input check)`` / ``refused at run (data
  check)`` / ``loads and runs``: fine;
* ``load: <Exception>`` / ``run: <Exception>``: any other exception is a bug (at run: a kernel
  refusing operands that the loader's shape inference let through);
* ``... huge allocation``: the allocator refused a request under the limit (a bug: the loader
  should have bounded it), ``... hang``: over ``--timeout`` seconds twice (a bug; a case over it
  once runs again, since a hang repeats and a stall of a loaded machine does not).

    python benchmarks/fuzz_artifact.py --cases 10000 --seed 0 [--corpus lut16-bayes] [--txt out.txt] [--json out.json]

On a file with ``lut16`` instructions (``lut16-bayes``), 30% of the cases break its segmented
tables one rule at a time (:func:`m_table16`).

Exit status 1 when any case is a bug.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import random
import resource
import signal
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.ao.quantization import DeQuantStub

try:
    from benchmarks.table16_mutation import RULES, break_rule
except ImportError:  # run as a script: benchmarks/ is on sys.path, not the repository root
    from table16_mutation import RULES, break_rule  # type: ignore[no-redef]

OK_CLASSES = (
    "loads and runs",
    "refused at load (ArtifactError)",
    "refused at run (input check)",
    "refused at run (data check)",
)
#: the memory bound every case is loaded with
MAX_MEMORY = 2**30


# ----------------------------------------------------------------------------- corpus


class _Small(nn.Module):
    """conv-relu, maxpool, a residual add, avgpool, a lookup table (sigmoid), flatten, linear."""

    def __init__(self) -> None:
        super().__init__()
        from qir.quantization import QuantStub

        self.quant = QuantStub()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.act = nn.Sigmoid()
        self.fc = nn.Linear(8, 4)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(self.relu(self.conv1(self.quant(x))))
        y = self.relu(self.conv2(y) + y)
        y = self.act(self.avg(y)).reshape(-1, 8)
        return self.dequant(self.fc(y))


class _Digits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from qir.examples import DigitsNet
        from qir.quantization import QuantStub

        self.quant = QuantStub()
        self.body = DigitsNet(width=4)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.body(self.quant(x)))


@dataclass
class Seed:
    """One real compiled artifact: its decoded header, data section, and an input that runs it."""

    name: str
    header: dict[str, Any]
    section: bytes
    inputs: tuple[torch.Tensor, ...]


def build_corpus(out: Path, only: frozenset[str] = frozenset()) -> list[Seed]:
    """Compile the corpus models (a few seconds; ``only``: these names, default all) and split their
    files into header and data."""
    from qir.march import march_scope
    from qir.quantization import compile_model, convert_fx, get_default_qat_qconfig, prepare_qat_fx

    try:
        from benchmarks.fuzz_ir_converted import _Lut16, _one, _Sequence, _sequence_inputs
    except ImportError:  # run as a script: benchmarks/ is on sys.path, not the repository root
        from fuzz_ir_converted import _Lut16, _one, _Sequence, _sequence_inputs  # type: ignore[no-redef]

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    seeds = []
    for name, make, shape, inputs, march, dtype in (
        ("digits-bayes", _Digits, (2, 1, 28, 28), _one, "bayes", "qint8"),
        ("small-bayes", _Small, (2, 3, 16, 16), _one, "bayes", "qint8"),
        ("small-bernoulli2", _Small, (2, 3, 16, 16), _one, "bernoulli2", "qint8"),
        # self-attention and LSTM cells (with state from QuantStubs, and without): Bayes only
        ("sequence-bayes", _Sequence, (2, 5, 8), _sequence_inputs, "bayes", "qint8"),
        # qint16 table lookups (segmented tables): Bayes only
        ("lut16-bayes", _Lut16, (2, 64), _one, "bayes", "qint16"),
    ):
        if only and name not in only:
            continue
        with march_scope(march):
            qconfig = get_default_qat_qconfig(dtype=dtype)
            prepared = prepare_qat_fx(make(), {"": qconfig}, example_inputs=inputs(shape, gen))
            with torch.no_grad():
                for _ in range(3):
                    prepared(*inputs(shape, gen))
            prepared.eval()
            converted = convert_fx(prepared)
        xs = inputs(shape, gen)
        path = out / f"{name}.hbm"
        compile_model(converted, list(xs), hbm=path, opt=1, march=march, check=False)
        data = path.read_bytes()
        (hlen,) = struct.unpack_from("<Q", data, 12)
        start = 20 + hlen + (-(20 + hlen)) % 64
        seeds.append(Seed(name, json.loads(data[20 : 20 + hlen]), data[start:-32], xs))
    return seeds


def assemble(header: bytes, section: bytes, version: int = 1, fix_digest: bool = True) -> bytes:
    head = struct.pack("<8sIQ", b"QIRPROG\x00", version, len(header)) + header
    body = head + b"\x00" * ((-len(head)) % 64) + section
    return body + (hashlib.sha256(body).digest() if fix_digest else bytes(32))


# ----------------------------------------------------------------------------- mutators

_HOSTILE: list[Any] = [
    0, -1, 1, 3, 255, 2**31, -(2**31), 2**63 - 1, -(2**63), 10**6, 10**12, 1.5, -0.0, 1e-300, 1e300,
    "", "x", "qint64", "conv2d", None, True, False, [], {}, [1, 2, 3], [10**6] * 4, [[[[1]]]],
    {"$v": "nope"}, {"$slice": [1]}, {"$tuple": 5}, {"$ellipsis": True}, {"a": 1},
]  # fmt: skip


def _nodes(v: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield path, v
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _nodes(x, (*path, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _nodes(x, (*path, i))


def _set(root: Any, path: tuple[Any, ...], value: Any) -> None:
    node = root
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


def _pick(rng: random.Random, h: dict[str, Any], want: Callable[[Any], bool]) -> tuple[tuple[Any, ...], Any] | None:
    nodes = [(p, v) for p, v in _nodes(h) if p and want(v)]
    return rng.choice(nodes) if nodes else None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def m_value(rng: random.Random, h: dict[str, Any]) -> str:
    p, _ = _pick(rng, h, lambda v: True) or ((), None)
    if p:
        _set(h, p, copy.deepcopy(rng.choice(_HOSTILE)))
    return "value"


def m_int(rng: random.Random, h: dict[str, Any]) -> str:
    hit = _pick(rng, h, _is_int)
    if hit:
        p, v = hit
        _set(h, p, rng.choice([v * 10**3, v * 10**6, -v, 0, v + 1, v - 1, 2**40, 20000, -20000]))
    return "int"


def m_attrs_all(rng: random.Random, h: dict[str, Any]) -> str:
    """Every integer attribute of one instruction set to one big (or negative) value."""
    inst = rng.choice(h["program"]["instructions"])
    big = rng.choice([10**6, 20000, -3, 0, 2**31])
    for p, v in list(_nodes(inst["attrs"])):
        if p and _is_int(v):
            _set(inst["attrs"], p, big)
    return "attrs-all-ints"


def m_delete_key(rng: random.Random, h: dict[str, Any]) -> str:
    hit = _pick(rng, h, lambda v: isinstance(v, dict) and bool(v))
    if hit:
        del hit[1][rng.choice(list(hit[1]))]
    return "delete-key"


def m_add_key(rng: random.Random, h: dict[str, Any]) -> str:
    hit = _pick(rng, h, lambda v: isinstance(v, dict))
    if hit:
        hit[1][rng.choice(["zz", "engine", "axis", "scale", "dtype", "$v"])] = copy.deepcopy(rng.choice(_HOSTILE))
    return "add-key"


def m_list(rng: random.Random, h: dict[str, Any]) -> str:
    hit = _pick(rng, h, lambda v: isinstance(v, list) and bool(v))
    if hit:
        lst = hit[1]
        i = rng.randrange(len(lst))
        op = rng.choice(["drop", "dup", "shuffle", "reverse"])
        if op == "drop":
            del lst[i]
        elif op == "dup":
            lst.insert(i, copy.deepcopy(lst[i]))
        elif op == "shuffle":
            rng.shuffle(lst)
        else:
            lst.reverse()
    return "list"


def m_instructions(rng: random.Random, h: dict[str, Any]) -> str:
    ins = h["program"]["instructions"]
    i, j = rng.randrange(len(ins)), rng.randrange(len(ins))
    op = rng.choice(["swap", "drop", "dup", "op"])
    if op == "swap":
        ins[i], ins[j] = ins[j], ins[i]
    elif op == "drop":
        del ins[i]
    elif op == "dup":
        ins.insert(j, copy.deepcopy(ins[i]))
    else:  # call another kernel with this instruction's operands and attributes
        ins[i]["op"] = ins[j]["op"]
    return "instructions"


def m_rename(rng: random.Random, h: dict[str, Any]) -> str:
    """A string replaced by another string of the header: a value, constant, op or enum name."""
    strings = [v for _, v in _nodes(h) if isinstance(v, str)]
    hit = _pick(rng, h, lambda v: isinstance(v, str))
    if hit and strings:
        _set(h, hit[0], rng.choice(strings))
    return "rename"


def m_shape_args(rng: random.Random, h: dict[str, Any]) -> str:
    """The integer arguments of a layout function made huge (repeat 20000 x 10000)."""
    fns = [d for d in h["program"]["instructions"] if d["op"] == "shape_fn"]
    if fns:
        d = rng.choice(fns)
        d["attrs"]["fn"] = rng.choice([d["attrs"]["fn"], "repeat", "expand", "tile", "reshape", "view"])
        for p, v in list(_nodes(d["attrs"])):
            if p and _is_int(v):
                _set(d["attrs"], p, rng.choice([20000, 10000, -1, 0, 2**31]))
    return "shape-fn-args"


def m_tensor_table(rng: random.Random, h: dict[str, Any]) -> str:
    t = rng.choice(h["tensors"])
    key = rng.choice(["shape", "offset", "nbytes", "dtype", "name"])
    if key == "shape":
        t["shape"] = rng.choice([[0, 2**40], [2**31 - 1, 0], list(reversed(t["shape"])), t["shape"] + [1], []])
    elif key in ("offset", "nbytes"):
        t[key] = rng.choice([0, 64, t[key] + 1, t[key] * 2, 2**62, -64])
    elif key == "dtype":
        t["dtype"] = rng.choice(["int8", "int16", "int32", "int64", "uint8", "float32", "bool"])
    else:
        t["name"] = rng.choice(h["tensors"])["name"]
    return "tensor-table"


HEADER_MUTATORS: list[Callable[[random.Random, dict[str, Any]], str]] = [
    m_value, m_int, m_int, m_attrs_all, m_delete_key, m_add_key, m_list, m_instructions, m_rename,
    m_shape_args, m_tensor_table,
]  # fmt: skip


def m_table16(rng: random.Random, h: dict[str, Any], section: bytes) -> tuple[str, bytes]:
    """A ``lut16`` instruction's segmented table broken one rule at a time (its knot codes out of
    order, a width that is not a power of two, the ends moved, a value outside the output range),
    its ``version`` attribute changed or dropped, or its table's declared shape changed (the byte
    size kept); ``h`` is edited in place, the new data section returned."""
    insts = [i for i in h["program"]["instructions"] if i["op"] == "lut16"]
    if not insts:
        return "table16(none)", section
    inst = rng.choice(insts)
    entry = next(t for t in h["tensors"] if t["name"] == inst["consts"]["table"])
    b = bytearray(section)
    start, n = entry["offset"], entry["nbytes"] // 4
    values = list(struct.unpack_from(f"<{n}i", b, start))
    op = rng.choice([*RULES, "value", "random", "version", "shape"])
    two_rows = len(entry["shape"]) == 2
    half = n // 2 if two_rows else n
    if op in RULES:
        knots = values[:half]
        row = values[half:] if two_rows else knots
        break_rule(rng, knots, row, op)
        values = knots + row if two_rows else knots
    elif op == "random":  # every value at once, random in a wide range
        first = half if two_rows else 0
        values[first:] = [rng.randint(-(2**20), 2**20) for _ in range(n - first)]
    elif op == "version":
        choice = rng.choice([0, 1, 2, 3, -1, "2", None, 2.0, "drop"])
        if choice == "drop":
            inst["attrs"].pop("version", None)
        else:
            inst["attrs"]["version"] = choice
    else:
        entry["shape"] = rng.choice([[n], [n // 2, 2] if two_rows else [n, 1], [1, n], [2, n // 2], [4, n // 4]])
    struct.pack_into(f"<{n}i", b, start, *values)
    return f"table16-{op}", bytes(b)


def m_raw_text(rng: random.Random, text: bytes) -> tuple[str, bytes]:
    """Mutations below the JSON level: what a text editor or a hand-written file does."""
    op = rng.choice(["dup-key", "digits", "nesting", "nan", "flip", "truncate"])
    if op == "dup-key":
        return op, text.replace(b'"march":', b'"march":"bayes","march":', 1)
    if op == "digits":
        return op, text.replace(b'"offset":0', b'"offset":' + b"7" * rng.choice([21, 5000]), 1)
    if op == "nesting":
        n = rng.choice([65, 50_000])
        return op, text.replace(b'"meta":', b'"meta":' + b"[" * n + b"]" * n + b',"m2":', 1)
    if op == "nan":
        lit = rng.choice([b"NaN", b"Infinity", b"-Infinity", b"1e999"])
        return op, text.replace(b'"scale":', b'"scale":' + lit + b',"s2":', 1)
    if op == "flip":
        b = bytearray(text)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return op, bytes(b)
    return op, text[: rng.randrange(len(text))]


def m_data(rng: random.Random, section: bytes) -> tuple[str, bytes]:
    """Data bytes: random flips, or an integer field set to an extreme (weights, multipliers, shifts)."""
    b = bytearray(section)
    if not b:
        return "data", bytes(b)
    if rng.random() < 0.5:
        for _ in range(rng.randint(1, 16)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return "data-flip", bytes(b)
    pos = rng.randrange(0, max(1, len(b) - 8), 4)
    b[pos : pos + 8] = rng.choice([b"\xff" * 8, b"\x7f" * 8, b"\x80" * 8, struct.pack("<q", 200), b"\x00" * 8])
    return "data-extreme", bytes(b)


# ----------------------------------------------------------------------------- running a case


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise _Timeout


def _is_alloc(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "allocate" in str(e) or "out of memory" in str(e)


def classify(path: Path, inputs: tuple[torch.Tensor, ...], timeout: float) -> str:
    """Load and run one file; the class of what happened."""
    from backends.common.artifact import ArtifactError
    from backends.common.runtime import DataError, InputError
    from qir.quantization import load_compiled

    stage = "load"
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        model = load_compiled(path, num_threads=1, max_memory=MAX_MEMORY)
        stage = "run"
        model(*inputs)
        return "loads and runs"
    except ArtifactError:
        return f"refused at {stage} (ArtifactError)"
    except InputError:  # a forged input shape: the call is refused before any kernel runs
        return "refused at run (input check)"
    except DataError:  # a value from the data a kernel would index with (a gather index, RoI boxes)
        return "refused at run (data check)"
    except _Timeout:
        return f"{stage}: hang (> {timeout:g} s)"
    except Exception as e:
        cause = e.__cause__ if isinstance(e, RuntimeError) and e.__cause__ is not None else e
        if isinstance(cause, _Timeout):
            return f"{stage}: hang (> {timeout:g} s)"
        if _is_alloc(e) or _is_alloc(cause):
            return f"{stage}: huge allocation"
        return f"{stage}: {type(e).__name__}" + (f" <- {type(cause).__name__}" if cause is not e else "")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def mutate(rng: random.Random, seed: Seed) -> tuple[str, bytes]:
    """One mutated file's bytes and the mutator's name."""
    r = rng.random()
    text = json.dumps(seed.header, separators=(",", ":")).encode()
    if r < 0.3 and any(i["op"] == "lut16" for i in seed.header["program"]["instructions"]):
        h = copy.deepcopy(seed.header)
        name, section = m_table16(rng, h, seed.section)
        return name, assemble(json.dumps(h, separators=(",", ":")).encode(), section)
    if r < 0.65:
        h = copy.deepcopy(seed.header)
        names = []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            fn = rng.choice(HEADER_MUTATORS)
            try:
                names.append(fn(rng, h))
            except (TypeError, KeyError, IndexError, AttributeError, ValueError):
                # an earlier mutation in this case removed what this mutator edits: it does nothing
                names.append(f"{fn.__name__[2:]}(skipped)")
        return "+".join(names), assemble(json.dumps(h, separators=(",", ":")).encode(), seed.section)
    if r < 0.8:
        name, t = m_raw_text(rng, text)
        return f"raw-{name}", assemble(t, seed.section)
    if r < 0.95:
        name, section = m_data(rng, seed.section)
        return name, assemble(text, section)
    data = assemble(text, seed.section, version=rng.choice([0, 1, 2]), fix_digest=rng.random() < 0.5)
    return "container", data[: rng.choice([len(data), len(data) - 1, 19, 52, len(data) // 2])]


def fuzz(
    seeds: list[Seed], cases: int, seed: int, work: Path, timeout: float = 10.0
) -> tuple[Counter[str], dict[str, list[str]], int]:
    """Run ``cases`` mutations; the count of each class, per bug class a few example mutators, and
    how many cases went over the timeout once but not when loaded and run again.

    A case is deterministic: a hang repeats, a stall of a loaded shared machine does not, so a
    case over the timeout runs once more and the retry's class counts (the stalls are reported)."""
    rng = random.Random(seed)
    counts: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}
    stalls = 0
    signal.signal(signal.SIGALRM, _alarm)
    path = work / "case.hbm"
    for _ in range(cases):
        s = rng.choice(seeds)
        name, data = mutate(rng, s)
        path.write_bytes(data)
        cls = classify(path, s.inputs, timeout)
        if "hang" in cls:
            cls = classify(path, s.inputs, timeout)
            stalls += "hang" not in cls
        counts[cls] += 1
        if cls not in OK_CLASSES and len(examples.setdefault(cls, [])) < 5:
            examples[cls].append(f"{s.name}: {name}")
    return counts, examples, stalls


def limit_address_space(extra_gib: float) -> int:
    """Cap this process's address space at what it maps now plus ``extra_gib``; the cap in bytes."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    cap = vm + int(extra_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return cap


def table(counts: Counter[str], examples: dict[str, list[str]], stalls: int = 0) -> str:
    total = sum(counts.values())
    lines = [f"{'class':<50} {'cases':>7} {'%':>7}", f"{'-' * 50} {'-' * 7} {'-' * 7}"]
    for cls, n in sorted(counts.items(), key=lambda kv: (kv[0] not in OK_CLASSES, -kv[1])):
        tag = "" if cls in OK_CLASSES else "  BUG"
        lines.append(f"{cls:<50} {n:>7} {100 * n / total:>6.2f}%{tag}")
    bugs = sum(n for c, n in counts.items() if c not in OK_CLASSES)
    lines.append(f"{'total':<50} {total:>7}   bugs: {bugs}")
    if stalls:
        lines.append(f"over the timeout once, within it when run again (machine load; counted by the retry): {stalls}")
    for cls, ex in examples.items():
        lines.append(f"  {cls}: e.g. {'; '.join(ex)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per case before it counts as a hang")
    ap.add_argument("--limit-gib", type=float, default=2.0, help="address space allowed above the start-up mapping")
    ap.add_argument("--corpus", default="", help="comma-separated corpus names to fuzz (default: all)")
    ap.add_argument("--txt", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        seeds = build_corpus(Path(tmp), frozenset(filter(None, args.corpus.split(","))))
        cap = limit_address_space(args.limit_gib)
        t1 = time.perf_counter()
        counts, examples, stalls = fuzz(seeds, args.cases, args.seed, Path(tmp), args.timeout)
    t2 = time.perf_counter()
    head = (
        f"fuzz_artifact: {args.cases} cases, seed {args.seed}, corpus {', '.join(s.name for s in seeds)} "
        f"(built in {t1 - t0:.1f} s), address space capped at {cap / 2**30:.1f} GiB, "
        f"{t2 - t1:.1f} s ({1e3 * (t2 - t1) / max(1, args.cases):.1f} ms/case), torch {torch.__version__}"
    )
    report = head + "\n" + table(counts, examples, stalls)
    print(report)
    if args.txt:
        args.txt.write_text(report + "\n")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "cases": args.cases,
                    "seed": args.seed,
                    "counts": dict(counts),
                    "timeouts_not_repeated": stalls,
                    "examples": examples,
                },
                indent=1,
            )
        )
    return 1 if any(c not in OK_CLASSES for c in counts) else 0


if __name__ == "__main__":
    sys.exit(main())
