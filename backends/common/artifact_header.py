"""The artifact header's schema: every field's type and range, checked before anything is built.

:func:`check_tensor_table` and :func:`check_program_header` take the decoded JSON of a
header and raise :class:`HeaderError` naming the field (``tensors[3].shape[1]``,
``program.instructions[5].attrs.scale``) and the rule it breaks. They only read: nothing is
allocated from a value before its range is known.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from backends.common.program import CONST_DTYPES

__all__ = [
    "MAX_DIM",
    "MAX_NAME_CHARS",
    "MAX_RANK",
    "MAX_SEQUENCE_ITEMS",
    "HeaderError",
    "TensorEntry",
    "check_program_header",
    "check_scales",
    "check_tensor_table",
    "is_int",
]

#: Largest dimension of a stored tensor (int32 range; no real weight comes near it).
MAX_DIM = 2**31 - 1
#: Largest rank of a stored tensor.
MAX_RANK = 16
#: Most elements of one list / tuple input (``program.meta.input_shapes[i].items``).
MAX_SEQUENCE_ITEMS = 4096
#: Longest value / tensor / kernel name.
MAX_NAME_CHARS = 1024

_ITEMSIZE = {"int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "float32": 4}
assert set(_ITEMSIZE) == set(CONST_DTYPES)
_TENSOR_KEYS = {"name", "dtype", "shape", "offset", "nbytes"}
_PROGRAM_KEYS = {"march", "inputs", "outputs", "instructions", "meta"}
_INSTRUCTION_KEYS = {"op", "inputs", "outputs", "attrs", "consts", "source"}


class HeaderError(ValueError):
    """A header field breaks its rule: ``field`` is its path, the message says the rule."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


def is_int(v: Any) -> bool:
    """A JSON integer (``bool`` is an ``int`` subclass in Python, but not an integer here)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _kind(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number"
    )


def _expect(v: Any, typ: type, field: str, what: str) -> None:
    if typ is int:
        ok = is_int(v)
    elif typ is float:
        ok = (isinstance(v, (int, float))) and not isinstance(v, bool)
    else:
        ok = isinstance(v, typ)
    if not ok:
        raise HeaderError(field, f"must be {what}, got {_kind(v)}")


def _keys(d: Mapping[str, Any], required: set[str], field: str, optional: Iterable[str] = ()) -> None:
    missing = sorted(required - set(d))
    if missing:
        raise HeaderError(field, f"missing key(s) {', '.join(missing)}")
    extra = sorted(set(d) - required - set(optional))
    if extra:
        raise HeaderError(field, f"unknown key(s) {', '.join(repr(k) for k in extra[:5])}: not part of format 1")


def _name(v: Any, field: str) -> str:
    _expect(v, str, field, "a string")
    if not v or len(v) > MAX_NAME_CHARS:
        raise HeaderError(field, f"a name must have 1 to {MAX_NAME_CHARS} characters, got {len(v)}")
    return str(v)


def _int_in(v: Any, field: str, lo: int, hi: int) -> int:
    _expect(v, int, field, "an integer")
    if not lo <= v <= hi:
        raise HeaderError(field, f"{v} is outside [{lo}, {hi}]")
    return int(v)


@dataclass(frozen=True)
class TensorEntry:
    """One checked row of the tensor table."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def check_tensor_table(table: Any, data_bytes: int) -> list[TensorEntry]:
    """The tensor table, checked: names unique, dtypes known, each dim in [0, MAX_DIM], byte size
    equal to elements x item size, byte range inside the ``data_bytes`` of the data section and
    disjoint from every other tensor's."""
    _expect(table, list, "tensors", "an array")
    out: list[TensorEntry] = []
    seen: set[str] = set()
    for i, e in enumerate(table):
        f = f"tensors[{i}]"
        _expect(e, dict, f, "an object")
        _keys(e, _TENSOR_KEYS, f)
        name = _name(e["name"], f"{f}.name")
        if name in seen:
            raise HeaderError(f"{f}.name", f"tensor name {name!r} appears twice: names must be unique")
        seen.add(name)
        dtype = e["dtype"]
        if not isinstance(dtype, str) or dtype not in CONST_DTYPES:
            raise HeaderError(f"{f}.dtype", f"{dtype!r} is not one of {', '.join(CONST_DTYPES)}")
        _expect(e["shape"], list, f"{f}.shape", "an array of integers")
        if len(e["shape"]) > MAX_RANK:
            raise HeaderError(f"{f}.shape", f"rank {len(e['shape'])} is over the limit of {MAX_RANK}")
        shape = tuple(_int_in(d, f"{f}.shape[{j}]", 0, MAX_DIM) for j, d in enumerate(e["shape"]))
        offset = _int_in(e["offset"], f"{f}.offset", 0, 2**63 - 1)
        nbytes = _int_in(e["nbytes"], f"{f}.nbytes", 0, 2**63 - 1)
        numel = math.prod(shape)
        if numel * _ITEMSIZE[dtype] != nbytes:
            raise HeaderError(
                f"{f}.nbytes",
                f"{nbytes} bytes do not hold {dtype}{list(shape)} ({numel} elements x {_ITEMSIZE[dtype]} bytes)",
            )
        if offset + nbytes > data_bytes:
            raise HeaderError(
                f"{f}.offset",
                f"tensor {name!r} does not fit the data section: bytes [{offset}, {offset + nbytes}) "
                f"end past its {data_bytes} bytes",
            )
        out.append(TensorEntry(name, dtype, shape, offset, nbytes))
    # disjoint byte ranges: a shared range would make two tensors alias one another's bytes
    spans = sorted((t.offset, t.offset + t.nbytes, i) for i, t in enumerate(out) if t.nbytes)
    for (_, end_a, a), (start_b, _, b) in pairwise(spans):
        if start_b < end_a:
            raise HeaderError(
                f"tensors[{b}].offset",
                f"bytes of tensor {out[b].name!r} overlap those of tensors[{a}] ({out[a].name!r}): "
                "every tensor needs its own byte range",
            )
    return out


def _outputs(v: Any, field: str) -> None:
    if isinstance(v, str):
        _name(v, field)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _outputs(x, f"{field}[{i}]")
    elif isinstance(v, dict) and set(v) == {"$tuple"} and isinstance(v["$tuple"], list):
        for i, x in enumerate(v["$tuple"]):
            _outputs(x, f"{field}.$tuple[{i}]")
    elif isinstance(v, dict) and set(v) == {"$dict"} and isinstance(v["$dict"], list):
        keys: set[str] = set()
        for i, pair in enumerate(v["$dict"]):
            f = f"{field}.$dict[{i}]"
            if not (isinstance(pair, list) and len(pair) == 2):
                raise HeaderError(f, f"must be a [key, value] pair, got {_kind(pair)}")
            key = _name(pair[0], f"{f}[0]")
            if key in keys:
                raise HeaderError(f"{f}[0]", f"the key {key!r} appears twice: every output key must be unique")
            keys.add(key)
            _outputs(pair[1], f"{f}[1]")
    else:
        raise HeaderError(field, f"must be a value name or an array / $tuple / $dict of them, got {_kind(v)}")


def _shape(s: Any, field: str) -> None:
    _expect(s, list, field, 'an array of integers, null, or {"items": [...]} for a list input')
    if len(s) > MAX_RANK:
        raise HeaderError(field, f"rank {len(s)} is over the limit of {MAX_RANK}")
    for j, d in enumerate(s):
        _int_in(d, f"{field}[{j}]", 0, MAX_DIM)


def check_program_header(h: Any, marches: Iterable[str], kernels: Iterable[str], tensors: Iterable[str]) -> None:
    """The program part of the header: march known, names well formed, every instruction an object
    with the six fields of the right types, calling a known kernel, naming stored constants."""
    _expect(h, dict, "program", "an object")
    _keys(h, _PROGRAM_KEYS - {"meta"}, "program", optional=("meta",))
    known = sorted(marches)
    march = h["march"]
    if not isinstance(march, str) or march not in known:
        raise HeaderError("program.march", f"{march!r} is not a known march; known: {', '.join(known)}")
    _expect(h["inputs"], list, "program.inputs", "an array of value names")
    ins = [_name(v, f"program.inputs[{i}]") for i, v in enumerate(h["inputs"])]
    if len(set(ins)) != len(ins):
        raise HeaderError("program.inputs", "an input name appears twice")
    _outputs(h["outputs"], "program.outputs")
    if "meta" in h:
        _expect(h["meta"], dict, "program.meta", "an object")
        if "input_shapes" in h["meta"]:
            shapes = h["meta"]["input_shapes"]
            f = "program.meta.input_shapes"
            _expect(shapes, list, f, "an array with one shape per input")
            if len(shapes) != len(ins):
                raise HeaderError(f, f"has {len(shapes)} entries for {len(ins)} input(s)")
            for i, s in enumerate(shapes):
                if s is None:
                    continue
                if isinstance(s, dict):  # a list / tuple input: {"items": [shape, ...]}
                    _keys(s, {"items"}, f"{f}[{i}]")
                    _expect(s["items"], list, f"{f}[{i}].items", "an array of shapes, one per element")
                    if not 0 < len(s["items"]) <= MAX_SEQUENCE_ITEMS:
                        raise HeaderError(
                            f"{f}[{i}].items", f"has {len(s['items'])} shapes; 1 to {MAX_SEQUENCE_ITEMS} are allowed"
                        )
                    for k, item in enumerate(s["items"]):
                        _shape(item, f"{f}[{i}].items[{k}]")
                    continue
                _shape(s, f"{f}[{i}]")
        if "exact_input_shapes" in h["meta"]:
            _expect(h["meta"]["exact_input_shapes"], bool, "program.meta.exact_input_shapes", "true or false")
        if "specialized" in h["meta"]:
            lines = h["meta"]["specialized"]
            _expect(lines, list, "program.meta.specialized", "an array of strings")
            for i, line in enumerate(lines):
                _expect(line, str, f"program.meta.specialized[{i}]", "a string")
    _expect(h["instructions"], list, "program.instructions", "an array")
    ops, consts = set(kernels), set(tensors)
    for i, d in enumerate(h["instructions"]):
        f = f"program.instructions[{i}]"
        _expect(d, dict, f, "an object")
        _keys(d, _INSTRUCTION_KEYS, f)
        op = d["op"]
        if not isinstance(op, str) or op not in ops:
            raise HeaderError(f"{f}.op", f"{op!r} is not a kernel of this qir")
        for key in ("inputs", "outputs"):
            _expect(d[key], list, f"{f}.{key}", "an array of value names")
            for j, v in enumerate(d[key]):
                _name(v, f"{f}.{key}[{j}]")
        _expect(d["attrs"], dict, f"{f}.attrs", "an object")
        _expect(d["consts"], dict, f"{f}.consts", "an object")
        for role, c in d["consts"].items():
            _name(c, f"{f}.consts.{role}")
            if c not in consts:
                raise HeaderError(f"{f}.consts.{role}", f"names constant {c!r}, which the tensor table does not hold")
        _expect(d["source"], str, f"{f}.source", "a string")


def check_scales(h: Mapping[str, Any], constants: Mapping[str, torch.Tensor]) -> None:
    """Every scale finite and positive: the ``scale`` attr of ``quantize`` and the float32
    ``scale`` constant of ``dequantize`` (the only floats a program computes with)."""
    for i, d in enumerate(h["instructions"]):
        f = f"program.instructions[{i}]"
        if d["op"] == "quantize":
            s = d["attrs"].get("scale")
            _expect(s, float, f"{f}.attrs.scale", "a number")
            if not (math.isfinite(s) and s > 0):
                raise HeaderError(f"{f}.attrs.scale", f"{s!r} is not a finite positive scale")
        elif d["op"] == "dequantize" and "scale" in d["consts"]:
            t = constants[d["consts"]["scale"]]
            bad = ~(torch.isfinite(t) & (t > 0)) if t.is_floating_point() else t <= 0
            if t.numel() == 0 or bool(bad.any()):
                what = "is empty" if t.numel() == 0 else f"holds {t[bad].reshape(-1)[0].item()!r}"
                raise HeaderError(
                    f"{f}.consts.scale", f"constant {d['consts']['scale']!r} {what}: scales must be finite and positive"
                )
