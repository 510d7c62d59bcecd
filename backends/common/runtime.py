"""Run a :class:`~backends.common.program.Program` on the CPU.

``CompiledModel(program)`` prepares every kernel's state once (weights in engine layout,
float64 requantization factors), then each call walks the instruction list, freeing each
value after its last use. Inputs are float tensors (the program's ``quantize``
instructions apply the compiled input scales); outputs are what the converted model
returns: float after a DeQuantStub, integer codes otherwise.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from backends.common.kernels import native
from backends.common.kernels.base import get_kernel
from backends.common.kernels.data_checks import DataError
from backends.common.program import Instruction, Program, build_outputs, output_names, refs_in

__all__ = ["DEFAULT_THREADS", "CompiledModel", "DataError", "InputError"]


class InputError(ValueError):
    """A call's inputs do not match what the program was compiled for (the message names the input)."""


#: Intra-op threads a compiled model runs with unless told otherwise.
DEFAULT_THREADS = 2

#: Kernels that either run in the native library (when it is loaded) or only touch small tensors
#: (shape changes, the final dequantize of a model's output).
_LIGHT_OPS = frozenset({"quantize", "dequantize", "maxpool2d", "adaptive_avgpool2d", "shape_fn"})


class CompiledModel:
    """A callable over a Program. ``num_threads``: threads during a call (None: torch's intra-op count
    as it is): the native kernels' pool splits each call across that many, and torch's intra-op
    threads are set to it too, unless every instruction runs in the native library or is light
    (``torch_threads``), in which case torch runs on one thread so that its OpenMP workers,
    which spin after each parallel region, do not compete with the pool for the same cores."""

    def __init__(self, program: Program, num_threads: int | None = DEFAULT_THREADS, source: str = "") -> None:
        program.validate()
        self.program = program
        self.num_threads = num_threads
        self.source = source
        self._lock = threading.Lock()
        self._steps: list[tuple[Instruction, Any, Any, list[str]]] = []
        last_use: dict[str, int] = {}
        for i, inst in enumerate(program.instructions):
            for v in (*inst.inputs, *refs_in(dict(inst.attrs))):
                last_use[v] = i
        keep = set(output_names(program.outputs))
        frees: list[list[str]] = [[] for _ in program.instructions]
        for v, i in last_use.items():
            if v not in keep:
                frees[i].append(v)
        for inst, free in zip(program.instructions, frees, strict=True):
            kernel = get_kernel(inst.op)
            self._steps.append((inst, kernel.run, kernel.prepare(inst, program.constants), free))
        self._all_native = native.library() is not None and all(
            inst.op in _LIGHT_OPS or getattr(state, "native", False) for inst, _, state, _ in self._steps
        )

    @property
    def torch_threads(self) -> int | None:
        """Torch's intra-op threads during a call (None: left as they are)."""
        if self.num_threads is None:
            return None
        return 1 if self._all_native else self.num_threads

    @property
    def march(self) -> str:
        return self.program.march

    @property
    def input_scales(self) -> dict[str, float]:
        """Scale of each ``quantize`` instruction fed directly by a program input."""
        ins = set(self.program.inputs)
        return {
            i.inputs[0]: float(i.attrs["scale"])
            for i in self.program.instructions
            if i.op == "quantize" and i.inputs and i.inputs[0] in ins
        }

    def __call__(self, *inputs: Any) -> Any:
        names = self.program.inputs
        if len(inputs) != len(names):
            raise TypeError(f"compiled model{self._where()} takes {len(names)} input(s), got {len(inputs)}")
        self._check_inputs(inputs)
        with self._lock:  # kernels keep per-instruction work buffers: one call at a time
            return self._call(inputs)

    def _call(self, inputs: tuple[Any, ...]) -> Any:
        names = self.program.inputs
        prev = torch.get_num_threads()
        want = self.torch_threads
        if want is not None and prev != want:
            torch.set_num_threads(want)
        try:
            with torch.no_grad(), native.using_threads(self.num_threads), native.holding_pool():
                env: dict[str, Any] = dict(zip(names, inputs, strict=True))
                for inst, run, state, free in self._steps:
                    try:
                        outs = run(inst, [env[v] for v in inst.inputs], state)
                    except DataError as e:  # a value from the data: the same class, with the place
                        raise DataError(f"compiled model{self._where()}: {inst.op} for '{inst.source}': {e}") from e
                    except Exception as e:
                        raise RuntimeError(
                            f"compiled model{self._where()}: {inst.op} for '{inst.source}' failed: {e}"
                        ) from e
                    for name, val in zip(inst.outputs, outs, strict=True):
                        env[name] = val
                    for v in free:
                        env.pop(v, None)
                result = build_outputs(self.program.outputs, env)
                return _detach_owned(result, self._owned())
        finally:
            if want is not None and prev != want:
                torch.set_num_threads(prev)

    def _owned(self) -> set[int]:
        """Storages of the buffers kernels reuse from call to call (``state.owned_buffers()``)."""
        ptrs: set[int] = set()
        for _, _, state, _ in self._steps:
            owned = getattr(state, "owned_buffers", None)
            if owned is not None:
                ptrs.update(b.untyped_storage().data_ptr() for b in owned())
        return ptrs

    def _check_inputs(self, inputs: tuple[Any, ...]) -> None:
        """Each input a tensor of the compiled rank whose sizes equal the compiled ones in all
        dimensions but at most one: the batch, wherever the model keeps it (dim 0 for NCHW, dim 1
        for sequence-first inputs)."""
        declared = self.program.meta.get("input_shapes")
        if not isinstance(declared, list):
            return  # a file from before input shapes were recorded
        # a program recorded from a forward that read sizes holds for exactly these shapes (qir.frontend.record)
        free = 0 if self.program.meta.get("exact_input_shapes") is True else 1
        for i, (x, want) in enumerate(zip(inputs, declared, strict=False)):
            if want is None:
                continue
            if isinstance(want, dict):  # a list / tuple input: its length was fixed when the forward was traced
                items = want.get("items", [])
                if not isinstance(x, (list, tuple)):
                    raise InputError(
                        f"compiled model{self._where()}: input {i} must be a list or tuple of {len(items)} tensors, "
                        f"got {type(x).__name__}"
                    )
                if len(x) != len(items):
                    raise InputError(
                        f"compiled model{self._where()}: input {i} has {len(x)} elements, but the model was compiled "
                        f"for {len(items)} (its traced forward read that many): pass {len(items)}, or compile again"
                    )
                for k, (t, shape) in enumerate(zip(x, items, strict=True)):
                    self._check_tensor(t, shape, free, f"input {i}[{k}]")
                continue
            self._check_tensor(x, want, free, f"input {i}")

    def _check_tensor(self, x: Any, want: list[int], free: int, what: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise InputError(
                f"compiled model{self._where()}: {what} must be a tensor of shape {want}, got {type(x).__name__}"
            )
        got = list(x.shape)
        if len(got) != len(want) or sum(g != w for g, w in zip(got, want, strict=True)) > free:
            which = (
                "only the batch dimension may differ"
                if free
                else "exactly: its forward's Python code read sizes, see program.meta['specialized']"
            )
            raise InputError(
                f"compiled model{self._where()}: {what} has shape {got}; it was compiled for {want} "
                f"({which}): compile again for this shape"
            )

    def _where(self) -> str:
        return f" '{self.source}'" if self.source else ""

    def __repr__(self) -> str:
        return (
            f"CompiledModel(march={self.march}, {len(self.program.instructions)} instructions, "
            f"{len(self.program.constants)} constants{', from ' + self.source if self.source else ''})"
        )


def _detach_owned(o: Any, owned: set[int]) -> Any:
    """``o`` with every tensor that lives in a kernel's reused buffer copied out (the next call overwrites it)."""
    if isinstance(o, torch.Tensor):
        return o.clone() if owned and o.untyped_storage().data_ptr() in owned else o
    if isinstance(o, tuple):
        return tuple(_detach_owned(x, owned) for x in o)
    if isinstance(o, list):
        return [_detach_owned(x, owned) for x in o]
    if isinstance(o, dict):
        return {k: _detach_owned(x, owned) for k, x in o.items()}
    return o
