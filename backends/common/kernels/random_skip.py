"""Uniform draws a random generator is advanced past without making them (``mt19937_skip.c``).

A module constructor's random initialization (torch's ``reset_parameters``) draws from the global
random stream, and a seeded script's numbers after it depend on how many it drew. Where the drawn
values are overwritten at once (a QAT conv / linear built by ``from_float`` gets the float
weight), :func:`skip_uniform_draws` leaves the generator exactly where ``uniform_`` would, without
the draw: torch's CPU ``uniform_`` takes one 32-bit mt19937 output per float32 / float16 / bfloat16
element (its float opmath) and two per float64 element (``random64``), serially in element order
(ATen/native/cpu/DistributionTemplates.h, core/DistributionsHelper.h, CPUGeneratorImpl.cpp), so the
skip is the generator's state twisted forward (:func:`status` says whether it is in use).

Every other case draws for real, giving the same stream: a dtype not listed, a generator that is
not a CPU generator (a CUDA generator's offset depends on how torch launches the draw: one draw of
``n`` elements, as the constructor makes), no C compiler or ``QIR_NATIVE=0``, or a skip that did
not match ``uniform_`` on a copy of the generator when first used for a dtype. The CPU draws go
into one reused scratch buffer, a slice at a time (per element, so the stream is the same).

The skip reads the state, advances it and writes it back: a draw another Python thread makes from
the same generator in between is overwritten (skips from this module are serialized).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from backends.common.kernels import native

__all__ = ["DRAWS_PER_ELEMENT", "skip_uniform_draws", "status"]

_SRC = Path(__file__).with_name("mt19937_skip.c")
#: mt19937 outputs per element of a CPU ``uniform_``, by dtype
DRAWS_PER_ELEMENT: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 1, torch.bfloat16: 1, torch.float64: 2}
#: CPUGeneratorImplState (CPUGeneratorImpl.cpp), as get_state() returns it: left (int32) at byte 8,
#: next (uint64) at 16, the 624 state words (one uint64 each) from 24, 5056 bytes in all
_STATE_BYTES, _LEFT, _NEXT, _WORDS = 5056, 8, 16, 24
#: elements per slice of a real CPU draw into the scratch buffer (4 MiB of float32)
_SLICE = 1 << 20
#: draw sizes the first-use check compares: within one block of 624 outputs, across one and several
_CHECK_SIZES = (1, 5, 623, 624, 625, 1249, 4099)

_lock = threading.Lock()
_skip: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
_status: str | None = None
_checked: dict[int, bool] = {}  # draws per element -> the skip matched uniform_
_scratch: dict[torch.dtype, torch.Tensor] = {}


def _load() -> None:
    global _skip, _status
    lib, where = native.compiled((_SRC,), (), "qir_mt19937_skip")
    if lib is None:
        _status = f"{where}: real draws into a scratch buffer"
        return
    fn = lib.qir_mt19937_skip
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = ctypes.c_int
    _skip, _status = fn, f"skipping by twisting the state ({where})"


def status() -> str:
    """Whether CPU draws are skipped, and from where, or why they are drawn."""
    with _lock:
        if _status is None:
            _load()
    assert _status is not None
    return _status


def _advance(state: torch.Tensor, outputs: int) -> bool:
    """Advance the byte state ``state`` (get_state()'s layout) by ``outputs`` mt19937 outputs in place."""
    assert _skip is not None
    if state.numel() != _STATE_BYTES or state.dtype != torch.uint8 or not state.is_contiguous():
        return False
    base = state.data_ptr()
    return int(_skip(base + _WORDS, base + _LEFT, base + _NEXT, outputs)) == 0


def _matches_uniform(dtype: torch.dtype) -> bool:
    """The skip leaves a copy of the default generator, and a freshly seeded one, byte for byte
    where ``uniform_`` of ``dtype`` leaves them."""
    per = DRAWS_PER_ELEMENT[dtype]
    for start in (torch.default_generator.get_state(), None):
        gen = torch.Generator()
        if start is None:
            gen.manual_seed(20240531)
        else:
            gen.set_state(start)
        for n in _CHECK_SIZES:
            state = gen.get_state()
            torch.empty(n, dtype=dtype).uniform_(generator=gen)
            if not _advance(state, n * per) or not torch.equal(state, gen.get_state()):
                return False
    return True


def _can_skip(dtype: torch.dtype) -> bool:
    global _status
    if _status is None:
        _load()
    if _skip is None:
        return False
    per = DRAWS_PER_ELEMENT[dtype]
    ok = _checked.get(per)
    if ok is None:
        ok = _checked[per] = _matches_uniform(dtype)
        if not ok:
            _status = f"the skip did not match torch's uniform_ ({dtype}): real draws into a scratch buffer"
    return ok


def _draw(n: int, dtype: torch.dtype, device: torch.device, generator: torch.Generator | None) -> None:
    if device.type != "cpu":
        # one draw of n elements, as the constructor makes (an accelerator generator's offset follows the launch)
        torch.empty(n, dtype=dtype, device=device).uniform_(generator=generator)
        return
    buf = _scratch.get(dtype)
    if buf is None:
        buf = _scratch[dtype] = torch.empty(_SLICE, dtype=dtype)
    for start in range(0, n, _SLICE):
        buf[: min(_SLICE, n - start)].uniform_(generator=generator)


def skip_uniform_draws(
    n: int, dtype: torch.dtype, device: torch.device, generator: torch.Generator | None = None
) -> None:
    """Advance ``generator`` (default: ``device``'s default generator, which ``uniform_`` uses
    without one) as ``torch.empty(n, dtype=dtype, device=device).uniform_(generator=generator)``
    would, without making the draw where that is possible (module docstring). Nothing on the meta
    device, where no draw is made."""
    if n < 0:
        raise ValueError(f"skip_uniform_draws: n must be >= 0, got {n}")
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"skip_uniform_draws: a {generator.device} generator cannot draw on {device}")
    if device.type == "meta" or n == 0:
        return
    with _lock:
        if device.type == "cpu" and dtype in DRAWS_PER_ELEMENT and _can_skip(dtype):
            gen = torch.default_generator if generator is None else generator
            state = gen.get_state()
            if _advance(state, n * DRAWS_PER_ELEMENT[dtype]):
                gen.set_state(state)
                return
        _draw(n, dtype, device, generator)
