"""Shape inference over a loaded program: every value's shape and dtype at the declared input
shapes, every kernel's operands checked against its shape declaration, and the memory the
program needs bounded, all before a kernel is prepared or run.

Each kernel declares its output shapes beside its schema (``KernelSchema(shape=...)``, see
:mod:`backends.common.kernels.infer`); this module walks the instructions in order with
abstract values (meta tensors, plain Python ints and tuples for shape queries) starting from
``program.meta.input_shapes`` (float32 inputs, as the program's ``quantize`` instructions take),
frees each value after its last use as the runtime does, and adds up the bytes alive at each
instruction plus that kernel's work space (``KernelSchema.work``; by default two float64
buffers of its largest tensor). The peak is the program's memory at its declared shapes.

Every failure is a :class:`~backends.common.artifact_header.HeaderError` naming the
instruction (``program.instructions[i]``), the kernel and the model node, and the rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from backends.common.artifact_header import HeaderError
from backends.common.kernels.base import get_kernel
from backends.common.kernels.infer import ShapeError
from backends.common.program import Program, output_names, refs_in

__all__ = ["DEFAULT_MAX_MEMORY", "MemoryPlan", "infer_program"]

#: The memory a loaded program may need at its declared input shapes unless the caller raises it
#: (``load_compiled(path, max_memory=...)``, ``qir run --max-memory``): 2 GiB.
DEFAULT_MAX_MEMORY = 2**31

#: Python exceptions a shape declaration may raise on operands it does not expect (a forged
#: attribute of the right type but the wrong structure): a refusal, like ShapeError.
_REFUSALS = (ShapeError, ValueError, TypeError, IndexError, KeyError, ZeroDivisionError, OverflowError)


@dataclass(frozen=True)
class MemoryPlan:
    """What shape inference found: the peak bytes (values alive plus work space) and where."""

    peak_bytes: int
    peak_instruction: int
    input_shapes: list[Any]


def _tensors(v: Any) -> Iterator[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _tensors(x)


def _nbytes(v: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(v))


def _abstract(v: Any, where: str) -> Any:
    """A declaration's result must be abstract: meta tensors and plain Python values only."""
    for t in _tensors(v):
        if t.device.type != "meta":
            raise AssertionError(f"{where}: a shape declaration returned a real tensor")
    return v


def input_shapes(program: Program) -> list[Any] | None:
    """One declared shape per input: a list of ints for a tensor, a tuple of such lists for a list /
    tuple input (``{"items": [...]}`` in the header); None when an input has none."""
    shapes = program.meta.get("input_shapes")
    if not isinstance(shapes, list) or len(shapes) != len(program.inputs):
        return None
    out: list[Any] = []
    for s in shapes:
        if isinstance(s, dict) and isinstance(s.get("items"), list):
            if not all(isinstance(item, list) for item in s["items"]):
                return None
            out.append(tuple([int(d) for d in item] for item in s["items"]))
        elif isinstance(s, list):
            out.append([int(d) for d in s])
        else:
            return None
    return out


def _each_shape(declared: Any) -> list[list[int]]:
    return list(declared) if isinstance(declared, tuple) else [declared]


def _meta_input(declared: Any, dtype: torch.dtype) -> Any:
    if isinstance(declared, tuple):
        return [torch.empty(s, dtype=dtype, device="meta") for s in declared]
    return torch.empty(declared, dtype=dtype, device="meta")


def infer_program(
    program: Program,
    max_memory: int | None = DEFAULT_MAX_MEMORY,
    values: dict[str, Any] | None = None,
    input_dtypes: list[torch.dtype] | None = None,
) -> MemoryPlan | None:
    """Infer every value of ``program`` at its declared input shapes; refuse operands that do not
    fit a kernel and, with ``max_memory``, a peak above it. Without declared input shapes (a file
    from before they were recorded, or an input that is not a tensor) nothing can be inferred:
    refused when ``max_memory`` is set, else None. ``values``: filled with every value's abstract
    value (meta tensors, Python values) by name. ``input_dtypes``: the inputs' dtypes (default
    float32, what a compiled model takes; a program built by hand may take codes)."""
    shapes = input_shapes(program)
    if shapes is None:
        if max_memory is None:
            return None
        raise HeaderError(
            "program.meta.input_shapes",
            "missing, or not one shape per input: the memory the program needs is computed from its input "
            "shapes; recompile the model with this qir, or load it without the bound (max_memory=None) if you "
            "trust the file",
        )
    last_use: dict[str, int] = {}
    for i, inst in enumerate(program.instructions):
        for v in (*inst.inputs, *refs_in(dict(inst.attrs))):
            last_use[v] = i
    keep = set(output_names(program.outputs))
    frees: dict[int, list[str]] = {}
    for v, i in last_use.items():
        if v not in keep:
            frees.setdefault(i, []).append(v)
    for i, declared in enumerate(shapes):
        n = sum(math.prod(s) * 4 for s in _each_shape(declared))
        s = declared if isinstance(declared, list) else [list(x) for x in declared]
        if n > (max_memory if max_memory is not None else 2**62):
            raise HeaderError(
                f"program.meta.input_shapes[{i}]",
                f"a float32 input of shape {s} takes {_human(n)}, over the limit of "
                f"{_human(max_memory if max_memory is not None else 2**62)}",
            )
    env: dict[str, Any] = {
        name: _meta_input(shape, dt)
        for name, shape, dt in zip(program.inputs, shapes, input_dtypes or [torch.float32] * len(shapes), strict=True)
    }
    live = sum(_nbytes(v) for v in env.values())
    peak, peak_at = live, -1
    consts: Mapping[str, torch.Tensor] = program.constants
    for i, inst in enumerate(program.instructions):
        field = f"program.instructions[{i}]"
        where = f"{inst.op} for '{inst.source}'"
        schema = get_kernel(inst.op).schema
        assert schema.shape is not None  # register_kernel requires one
        args = [env[v] for v in inst.inputs]
        try:
            outs = schema.shape(inst, args, consts)
            if len(outs) != len(inst.outputs):
                raise ShapeError(f"makes {len(outs)} value(s) for {len(inst.outputs)} output name(s)")
            outs = _abstract(outs, where)
            sizes = [t.numel() for t in _tensors([args, outs])]
            work = schema.work(inst, args, outs) if schema.work is not None else 16 * max(sizes, default=0)
        except _REFUSALS as e:
            msg = str(e) if isinstance(e, ShapeError) else f"{type(e).__name__}: {e}"
            raise HeaderError(
                field, f"{where}: its operands do not fit at the declared input shapes {shapes}: {msg}"
            ) from None
        made = _nbytes(outs)
        if live + made + work > peak:
            peak, peak_at = live + made + work, i
        if max_memory is not None and peak > max_memory:
            raise HeaderError(
                field,
                f"{where}: the program needs {_human(peak)} at the declared input shapes {shapes} (values alive "
                f"plus this kernel's work space), over the limit of {_human(max_memory)}; raise max_memory "
                "(load_compiled(path, max_memory=...), qir run --max-memory) if you trust the file",
            )
        for name, val in zip(inst.outputs, outs, strict=True):
            env[name] = val
            if values is not None:
                values[name] = val
        live += made
        for v in frees.get(i, ()):
            live -= _nbytes(env.pop(v, None))
    return MemoryPlan(peak, peak_at, shapes)


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"
