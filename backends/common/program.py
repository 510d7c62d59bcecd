"""The Program: a schedule of integer kernel calls, independent of torch modules.

A :class:`Program` names its values (model inputs, intermediate tensors, Python ints from
shape queries) and runs :class:`Instruction` s in order. Each instruction calls one kernel
(``op``) on values (``inputs``), binds ``outputs``, and carries JSON-plain ``attrs``
(ints, bools, strings, lists of them) plus ``consts``: role -> name of an integer constant
array in :attr:`Program.constants`. The only floats anywhere are the boundary scales: the
``scale`` attr of ``quantize`` and the float32 ``scale`` constant of ``dequantize``.

Everything is plain data, so a Program serialises to the artifact format
(:mod:`backends.common.artifact`) and back without pickle or code.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CONST_DTYPES", "Instruction", "Program", "ProgramError", "ValueRef", "build_outputs", "output_names"]

#: dtype name in the artifact -> torch dtype of a constant array.
CONST_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "float32": torch.float32,
}


class ProgramError(ValueError):
    """A Program is malformed (the message names the instruction or value)."""


@dataclass(frozen=True)
class ValueRef:
    """A reference to a named value inside an instruction's nested ``attrs`` (shape-op arguments)."""

    name: str

    def to_json(self) -> dict[str, str]:
        return {"$v": self.name}


@dataclass(frozen=True)
class Instruction:
    """One kernel call: ``outputs = op(inputs; attrs, consts)``. ``source``: the model node it came from."""

    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    consts: Mapping[str, str] = field(default_factory=dict)
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "attrs": _attrs_to_json(dict(self.attrs)),
            "consts": dict(self.consts),
            "source": self.source,
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Instruction:
        if not isinstance(d.get("attrs"), dict) or set(d["attrs"]) in ({"$v"}, {"$slice"}, {"$ellipsis"}, {"$tuple"}):
            raise ProgramError(f"instruction attrs must be an object of named attributes, got {d.get('attrs')!r:.80}")
        try:
            return Instruction(
                op=str(d["op"]),
                inputs=tuple(str(v) for v in d["inputs"]),
                outputs=tuple(str(v) for v in d["outputs"]),
                attrs=_attrs_from_json(d["attrs"]),
                consts={str(k): str(v) for k, v in d["consts"].items()},
                source=str(d["source"]),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ProgramError(f"malformed instruction {d!r:.200}: {e}") from None


def _attrs_to_json(v: Any) -> Any:
    if isinstance(v, ValueRef):
        return v.to_json()
    if isinstance(v, slice):
        return {"$slice": [_attrs_to_json(v.start), _attrs_to_json(v.stop), _attrs_to_json(v.step)]}
    if v is Ellipsis:
        return {"$ellipsis": True}
    if isinstance(v, tuple):
        return {"$tuple": [_attrs_to_json(x) for x in v]}
    if isinstance(v, list):
        return [_attrs_to_json(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _attrs_to_json(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise ProgramError(f"attribute value {v!r} of type {type(v).__name__} is not plain data")


def _attrs_from_json(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) == {"$v"}:
            if not isinstance(v["$v"], str):
                raise ProgramError(f"a value reference {{'$v': ...}} must hold a value name, got {v['$v']!r:.60}")
            return ValueRef(v["$v"])
        if set(v) == {"$slice"}:
            if not (isinstance(v["$slice"], list) and len(v["$slice"]) == 3):
                raise ProgramError(f"a slice {{'$slice': ...}} must hold [start, stop, step], got {v['$slice']!r:.60}")
            a, b, c = (_attrs_from_json(x) for x in v["$slice"])
            return slice(a, b, c)
        if set(v) == {"$ellipsis"}:
            return Ellipsis
        if set(v) == {"$tuple"}:
            if not isinstance(v["$tuple"], list):
                raise ProgramError(f"a tuple {{'$tuple': ...}} must hold an array, got {v['$tuple']!r:.60}")
            return tuple(_attrs_from_json(x) for x in v["$tuple"])
        return {k: _attrs_from_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_attrs_from_json(x) for x in v]
    return v


def refs_in(v: Any) -> Iterator[str]:
    """Names of every :class:`ValueRef` nested in ``v``."""
    if isinstance(v, ValueRef):
        yield v.name
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from refs_in(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from refs_in(x)
    elif isinstance(v, slice):
        yield from refs_in([v.start, v.stop, v.step])


@dataclass
class Program:
    """A lowered model. ``outputs`` is the output structure: a value name, or nested lists / tuples
    / dicts with string keys of them (``{"$tuple": [...]}`` and ``{"$dict": [[key, ...], ...]}``
    in JSON; a dict keeps its key order, as the model's ``forward`` returned it)."""

    march: str
    inputs: list[str]
    outputs: Any
    instructions: list[Instruction]
    constants: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Every value is defined before use, every constant exists and is an allowed dtype."""
        defined = set(self.inputs)
        if len(defined) != len(self.inputs):
            raise ProgramError(f"duplicate program input names: {self.inputs}")
        for name, t in self.constants.items():
            if t.dtype not in CONST_DTYPES.values():
                raise ProgramError(f"constant '{name}' has dtype {t.dtype}; allowed: {', '.join(CONST_DTYPES)}")
        for i, inst in enumerate(self.instructions):
            for v in (*inst.inputs, *refs_in(dict(inst.attrs))):
                if v not in defined:
                    raise ProgramError(
                        f"instruction {i} ({inst.op}, from '{inst.source}') uses '{v}' before it is defined"
                    )
            for role, c in inst.consts.items():
                if c not in self.constants:
                    raise ProgramError(
                        f"instruction {i} ({inst.op}, from '{inst.source}') names constant '{c}' "
                        f"({role}) that the program does not hold"
                    )
            for v in inst.outputs:
                if v in defined:
                    raise ProgramError(
                        f"instruction {i} ({inst.op}, from '{inst.source}') binds '{v}', which is already defined"
                    )
                defined.add(v)
        for v in refs_in(_outputs_as_refs(self.outputs)):
            if v not in defined:
                raise ProgramError(f"program output '{v}' is never defined")

    def header(self) -> dict[str, Any]:
        """The JSON-plain part (everything but the constant arrays)."""
        return {
            "march": self.march,
            "inputs": list(self.inputs),
            "outputs": _outputs_to_json(self.outputs),
            "instructions": [i.to_json() for i in self.instructions],
            "meta": _attrs_to_json(self.meta),
        }

    @staticmethod
    def from_header(h: Mapping[str, Any], constants: dict[str, torch.Tensor]) -> Program:
        try:
            prog = Program(
                march=str(h["march"]),
                inputs=[str(v) for v in h["inputs"]],
                outputs=_outputs_from_json(h["outputs"]),
                instructions=[Instruction.from_json(d) for d in h["instructions"]],
                constants=constants,
                meta=_attrs_from_json(h.get("meta", {})),
            )
        except (KeyError, TypeError) as e:
            raise ProgramError(f"malformed program header: missing or wrong field {e}") from None
        prog.validate()
        return prog

    def summary(self) -> str:
        """One line per instruction: ``outputs = op(inputs) [engine] # source``."""
        lines = [f"program march={self.march} inputs={self.inputs} outputs={self.outputs}"]
        for inst in self.instructions:
            eng = inst.attrs.get("engine")
            tag = f" [{eng}]" if eng else ""
            lines.append(f"  {', '.join(inst.outputs)} = {inst.op}({', '.join(inst.inputs)}){tag}  # {inst.source}")
        return "\n".join(lines)


def _outputs_as_refs(o: Any) -> Any:
    if isinstance(o, str):
        return ValueRef(o)
    if isinstance(o, (list, tuple)):
        return [_outputs_as_refs(x) for x in o]
    if isinstance(o, dict):
        bad = [k for k in o if not isinstance(k, str)]
        if bad:
            raise ProgramError(f"program output dict keys must be strings, got {bad[0]!r:.60}")
        return [_outputs_as_refs(x) for x in o.values()]
    raise ProgramError(f"program outputs must be value names or lists/tuples/dicts of them, got {o!r:.80}")


def output_names(o: Any) -> list[str]:
    """Every value name in an output structure, in order (dicts in their key order)."""
    return list(refs_in(_outputs_as_refs(o)))


def build_outputs(o: Any, env: Mapping[str, Any]) -> Any:
    """The output structure ``o`` with every value name replaced by its value in ``env``."""
    if isinstance(o, str):
        return env[o]
    if isinstance(o, tuple):
        return tuple(build_outputs(x, env) for x in o)
    if isinstance(o, dict):
        return {k: build_outputs(x, env) for k, x in o.items()}
    return [build_outputs(x, env) for x in o]


def _outputs_to_json(o: Any) -> Any:
    # a dict becomes a list of [key, value] pairs under "$dict", so a key can never be read as a
    # "$tuple" / "$v" marker and the order survives any JSON reader
    if isinstance(o, dict):
        return {"$dict": [[k, _outputs_to_json(x)] for k, x in o.items()]}
    if isinstance(o, tuple):
        return {"$tuple": [_outputs_to_json(x) for x in o]}
    if isinstance(o, list):
        return [_outputs_to_json(x) for x in o]
    return o


def _outputs_from_json(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"$dict"} and isinstance(v["$dict"], list):
        pairs = v["$dict"]
        if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
            raise ProgramError(f"a dict output {{'$dict': ...}} must hold [key, value] pairs, got {pairs!r:.60}")
        out = {p[0]: _outputs_from_json(p[1]) for p in pairs}
        if len(out) != len(pairs):
            raise ProgramError(f"a dict output {{'$dict': ...}} repeats a key: {[p[0] for p in pairs]!r:.80}")
        return out
    if isinstance(v, dict) and set(v) == {"$tuple"} and isinstance(v["$tuple"], list):
        return tuple(_outputs_from_json(x) for x in v["$tuple"])
    if isinstance(v, list):
        return [_outputs_from_json(x) for x in v]
    if isinstance(v, str):
        return v
    raise ProgramError(f"program outputs must be value names or arrays / $tuple / $dict of them, got {v!r:.60}")
