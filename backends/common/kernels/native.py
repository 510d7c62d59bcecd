"""Fused native kernels (``native.c``): requantization, the fused conv + add rule, the
depthwise conv, im2col, max pool and (on CPUs with AVX-512 VNNI) the int8 matrix product with
the requantization fused, each one pass over memory, built with the system C compiler on first use.

Torch's elementwise ops make one pass over the tensor per operation; requantizing an int32
accumulator exactly takes five or six of them in float64 (cast, multiply-add, floor, clamp,
cast), which on thin layers (1x1 and depthwise convs) costs more than the matrix product.
The C loops here read the int32 accumulator once and write the int8 / int16 codes once, with
the same int64 arithmetic as the reference rules (``qir.ir.numerics.requantize``).

The library is compiled once per source, compiler flags and CPU (``-O3 -march=native
-fwrapv``, plus ``$QIR_NATIVE_CFLAGS``) into ``$QIR_CACHE_DIR`` (default ``~/.cache/qir``) and
loaded with ctypes. Without a C compiler, or with ``QIR_NATIVE=0``, :func:`library` returns None and the kernels use
their torch paths, which compute the same results (tests compare both against the int64
reference). :func:`status` says which and why.

:func:`run` splits the rows of one call across :func:`threads` threads (the compiled model's
``num_threads`` during a call, else torch's intra-op count) in C (``native_pool.c``: persistent
pthreads that spin between the kernels of a compiled-model call, :func:`holding_pool`, and sleep
after it); every kernel writes only its own rows, so the codes do not depend on the split.

Memory safety: the C functions trust the sizes they are given. Every caller checks them against
the tensors first, in Python (the ``_check_*`` helpers here and in the kernels); docs/security.md
lists what each function reads and writes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = [
    "Call",
    "Epilogue",
    "channel_groups",
    "compiled",
    "float_bits",
    "gemm_parts",
    "has_vnni",
    "holding_pool",
    "library",
    "pack_dw",
    "pack_vnni",
    "ptr",
    "run",
    "status",
    "threads",
    "using_threads",
]

_SRC = Path(__file__).with_name("native.c")
#: compiled together (the header is part of the cache key)
_SOURCES = (_SRC, *(_SRC.with_name(f"native_{n}.c") for n in ("pool", "dw", "grid", "weights")))
_HEADERS = tuple(_SRC.with_name(f"native_{n}.h") for n in ("pool", "simd", "dw", "requant", "grid", "weights"))
# -fno-trapping-math -fno-math-errno let floor() vectorise; neither changes an IEEE result (no fast-math)
_FLAGS = [
    "-O3",
    "-march=native",
    "-fwrapv",
    "-fno-trapping-math",
    "-fno-math-errno",
    "-shared",
    "-fPIC",
    "-std=c11",
    "-pthread",
]
#: below this much work (``run``'s estimate) a call stays on the calling thread: the pool's hand-off
#: costs a few microseconds while its threads spin, tens when they have to be woken
_SPLIT_MIN = 1 << 16
#: parts per thread of a split call: the threads claim them one at a time, so a thread that the
#: (shared) machine runs late leaves its parts to the others instead of holding up the call
PARTS_PER_THREAD = 3

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_status: str | None = None
_tasks: dict[str, tuple[int, int]] = {}  # entry point -> (qir_run's task id, number of arguments)
_local = threading.local()  # this Python thread's pool size, set by the runtime during a call

_I64 = ctypes.c_int64
_P = ctypes.c_void_p
_SIGNATURES: dict[str, list[type]] = {
    # acc, lda, n, rq, fast, out, r0, r1
    **{f"qir_requant_rows_{t}": [_P, _I64, _I64, _P, _I64, _P, _I64, _I64] for t in ("i8", "i16")},
    # acc, lda, n, addend, bias, mult, half, shift, add_mult, add_half, add_shift, p, lo, hi, out, r0, r1
    **{
        f"qir_fused_add_rows_{a}_{o}": [_P, _I64, _I64, *[_P] * 5, *[_I64] * 4, *[_P] * 3, _I64, _I64]
        for a in ("i8", "i16")
        for o in ("i8", "i16")
    },
    # x, h, w, c, wt, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, rq, fast, out, r0, r1
    **{f"qir_dw_rows_{t}": [_P, *[_I64] * 3, _P, *[_I64] * 10, _P, _I64, _P, _I64, _I64] for t in ("i8", "i16")},
    # x, h, w, c, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, wpk, comp, nrows, gcb, rq, fast, out, u0, u1
    **{f"qir_dw_vnni_{t}": [_P, *[_I64] * 13, _P, _P, _I64, _I64, _P, _I64, _P, _I64, _I64] for t in ("i8", "i16")},
    # x, h, w, c, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, cols, ldc, r0, r1
    "qir_im2col_i8": [_P, *[_I64] * 13, _P, _I64, _I64, _I64],
    # x, h, w, c, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, out, r0, r1
    **{f"qir_maxpool_rows_{t}": [_P, *[_I64] * 13, _P, _I64, _I64] for t in ("i8", "i16")},
    # a, lda, bp, kq, nblocks, comp, epilogue, r0, r1
    "qir_gemm_vnni": [_P, _I64, _P, _I64, _I64, _P, _P, _I64, _I64],
    # a, lda, m, bp, kq, nblocks, comp, epilogue, j0, j1 (panels, not rows)
    "qir_gemm_vnni_cols": [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64],
    # x, h, w, c, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, bp, kq, nblocks, comp, epilogue, r0, r1
    "qir_conv_vnni": [_P, *[_I64] * 13, _P, _I64, _I64, _P, _P, _I64, _I64],
    "qir_caps": [],
    # x, hw, c, out, r0, r1
    **{f"qir_sum_pixels_{t}": [_P, _I64, _I64, _P, _I64, _I64] for t in ("i8", "i16")},
    # id, argv, nargs, rows, nt, grain, per
    "qir_run": [_I64, _P, _I64, _I64, _I64, _I64, _I64],
    "qir_task_name": [_I64],
    "qir_pool_threads": [],
    "qir_pool_spin_us": [_I64],
    "qir_pool_hold": [_I64],
    "qir_pool_parked": [],
    "qir_pool_moved": [],
    # x, c, hw, scale, out, r0, r1
    **{f"qir_quantize_pixels_{t}": [_P, _I64, _I64, ctypes.c_float, _P, _I64, _I64] for t in ("i8", "i16")},
    # acc, hw, c, ratio, offset, acc_grad, lo, hi, out_scale, out, gain, r0, r1 (native_grid.c)
    "qir_grid_requant_rows": [_P, _I64, _I64, _P, _P, _P, _I64, _I64, ctypes.c_float, _P, _P, _I64, _I64],
    # x, n, len, inv, out, r0, r1
    "qir_grid_codes_rows": [_P, _I64, _I64, ctypes.c_float, _P, _I64, _I64],
    # w, k, c, scale, fac, qmin, qmax, out, factor, r0, r1
    "qir_grid_weight_codes_rows": [_P, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _I64],
    # w, k, mode, scale, old_lo, old_hi, den, eps, scale_out, codes, sums, r0, r1 (native_weights.c)
    **{
        f"qir_weight_codes_rows_{t}": [_P, *[_I64] * 2, *[_P] * 3, *[_I64] * 2, *[_P] * 3, _I64, _I64]
        for t in ("i8", "i16")
    },
    # acc, addend, hw, c, acc_lo, acc_hi, r1, off1, r2, inv_add, extra_bits, lo, hi, out_scale, out, keep, r0, r1
    "qir_grid_fused_add_rows": [
        *[_P, _P, _I64, _I64, _P, _P, _P, _P, _P, ctypes.c_float],
        *[_I64, _I64, _I64, ctypes.c_float, _P, _P, _I64, _I64],
    ],
    # q, k, r0, r1
    "qir_grid_abs_row_max": [_P, _I64, _I64, _I64],
}
_RETURNS_INT = ("qir_dw_", "qir_gemm_vnni", "qir_conv_vnni", "qir_caps")  # qir_gemm_vnni_cols too
_RETURNS_I64 = ("qir_quantize_pixels", "qir_run", "qir_pool_", "qir_weight_codes", "qir_grid_abs_row_max")


class Epilogue(ctypes.Structure):
    """``qir_epilogue`` in native.c: what follows ``qir_gemm_vnni``'s int32 accumulator (pointers are
    ``data_ptr()`` s of tensors the caller keeps alive during the call)."""

    _fields_ = [
        ("kind", _I64),  # 1: requantize, 2: the fused conv + add
        ("out_bits", _I64),
        ("add_bits", _I64),
        ("n", _I64),
        ("rq", _P),  # the requantization's parameters, packed per 16 channels (native_requant.h)
        ("fast", _I64),  # their mode
        *[(f, _P) for f in ("addend", "bias", "mult", "half", "shift")],
        *[(f, _I64) for f in ("add_mult", "add_half", "add_shift", "p")],
        *[(f, _P) for f in ("lo_i", "hi_i", "out")],
        # the fused add's requantizations onto the intermediate grid, packed (None: the scalar loop)
        *[(f, _P) for f in ("rq_mid", "rq_add")],
        *[(f, _I64) for f in ("fast_mid", "fast_add")],
    ]


def _cpu_key() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as fh:
            lines = [ln for ln in fh if ln.startswith(("flags", "model name"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def compiled(sources: tuple[Path, ...], headers: tuple[Path, ...], stem: str) -> tuple[ctypes.CDLL | None, str]:
    """``sources`` compiled with the kernels' flags into ``$QIR_CACHE_DIR/<stem>_<key>.so`` (once per
    source text, compiler, flags and CPU) and loaded; None and the reason when the compiler is
    missing or fails, or ``QIR_NATIVE=0``."""
    if os.environ.get("QIR_NATIVE", "1") == "0":
        return None, "disabled (QIR_NATIVE=0)"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler found (set CC)"
    src = b"".join(p.read_bytes() for p in (*sources, *headers))
    # QIR_NATIVE_CFLAGS: extra compiler flags, e.g. -mno-avx512vbmi or -mno-avx512f to build (and test)
    # the paths a CPU without those instructions takes
    flags = [*_FLAGS, *os.environ.get("QIR_NATIVE_CFLAGS", "").split()]
    key = hashlib.sha256(src + " ".join([cc, *flags]).encode() + _cpu_key().encode()).hexdigest()[:16]
    cache = Path(
        os.environ.get("QIR_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qir"
    )
    so = cache / f"{stem}_{key}.so"
    if not so.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            # build beside the target and rename: concurrent processes never load a half-written file
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            cmd = [cc, *flags, *(str(p) for p in sources), "-o", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                os.unlink(tmp)
                return None, f"{cc} failed on {sources[0].name}: {proc.stderr.strip()[:300]}"
            os.replace(tmp, so)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"building {sources[0].name} in {cache} failed ({e})"
    try:
        return ctypes.CDLL(str(so)), str(so)
    except OSError as e:
        return None, f"loading {so} failed ({e})"


def _build() -> tuple[ctypes.CDLL | None, str]:
    lib, where = compiled(_SOURCES, _HEADERS, "qir_native")
    if lib is None:
        return None, f"{where}: torch kernels"
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int if name.startswith(_RETURNS_INT) else None
        if name.startswith(_RETURNS_I64):
            fn.restype = ctypes.c_int64
    lib.qir_task_name.restype = ctypes.c_char_p
    _tasks.clear()
    for i in range(64):
        task = lib.qir_task_name(i).decode()
        if not task:
            break
        _tasks[task] = (i, len(_SIGNATURES[task]) - 2)  # the parameters before r0, r1
    return lib, f"native kernels from {where}"


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None when unavailable (see :func:`status`)."""
    global _lib, _status
    if _status is None:
        with _lock:
            if _status is None:
                _lib, _status = _build()
    return _lib


def status() -> str:
    """Whether the native kernels are in use, and from where or why not."""
    library()
    assert _status is not None
    return _status


def has_vnni() -> bool:
    """Whether the loaded library holds the AVX-512 VNNI matrix product (built for a CPU that has it)."""
    lib = library()
    return lib is not None and bool(lib.qir_caps() & 1)


def pack_vnni(b: torch.Tensor, k_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``b`` (K, N) int8 as ``qir_gemm_vnni`` reads it: ``ceil(N/16)`` panels of (kq, 16, 4) bytes with
    ``kq = ceil(k_rows/4)`` (rows past K and columns past N zero), and ``128 * column sums`` (int32,
    one per padded column) that undo the kernel's a + 128 flip."""
    k, n = b.shape
    if b.dtype != torch.int8 or k > k_rows:
        raise ValueError(f"pack_vnni: takes int8 (K, N) with K <= {k_rows}, got {b.dtype} {tuple(b.shape)}")
    kq, nb = -(-k_rows // 4), -(-n // 16)
    full = torch.zeros(kq * 4, nb * 16, dtype=torch.int8)
    full[:k, :n] = b
    panels = full.view(kq, 4, nb, 16).permute(2, 0, 3, 1).contiguous()
    comp = (full.to(torch.int32).sum(0) * 128).to(torch.int32).contiguous()
    return panels, comp


def pack_dw(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A depthwise filter ``w`` (KH, KW, C) int8 as ``qir_dw_vnni`` reads it: ``ceil(C/16)`` blocks of
    (KH, ceil(KW/4), 16, 4) bytes (byte t of channel k: column 4g + t of the kernel row; zero past KW
    and past C), and (KH + 1, 16 ceil(C/16)) int32 that undo the kernel's a + 128 flip: row i < KH is
    128 * the sum of kernel row i's weights per channel, row KH is -128 * the sum of all."""
    if w.dtype != torch.int8 or w.dim() != 3:
        raise ValueError(f"pack_dw: takes an int8 (KH, KW, C) filter, got {w.dtype} {tuple(w.shape)}")
    kh, kw, c = w.shape
    g4, ncb = -(-kw // 4), -(-c // 16)
    full = torch.zeros(kh, g4 * 4, ncb * 16, dtype=torch.int8)
    full[:, :kw, :c] = w
    packed = full.view(kh, g4, 4, ncb, 16).permute(3, 0, 1, 4, 2).contiguous()
    rows = full.to(torch.int32).sum(1) * 128
    comp = torch.cat([rows, -rows.sum(0, keepdim=True)]).to(torch.int32).contiguous()
    return packed, comp


def threads() -> int:
    """Threads :func:`run` splits a call across: the compiled model's ``num_threads`` during its call
    (:func:`using_threads`), else torch's intra-op thread count."""
    n = getattr(_local, "threads", None)
    return int(n) if n is not None else torch.get_num_threads()


@contextmanager
def using_threads(n: int | None) -> Iterator[None]:
    """Within the block, :func:`run` on this Python thread uses ``n`` threads (None: torch's count)."""
    prev = getattr(_local, "threads", None)
    _local.threads = n
    try:
        yield
    finally:
        _local.threads = prev


@contextmanager
def holding_pool() -> Iterator[None]:
    """Within the block (a compiled model's call), the pool's idle threads spin between kernels
    however long the gap, instead of sleeping after ``qir_pool_spin_us``; they sleep as soon as it
    ends. The kernels of one call follow each other within tens of microseconds, a wake-up costs
    about 12 us (more on a loaded machine), and a batch-1 layer's share of the work is a few hundred.
    Nothing to hold where the block runs on one thread or without the library."""
    lib = library() if threads() > 1 else None
    if lib is None:
        yield
        return
    lib.qir_pool_hold(1)
    try:
        yield
    finally:
        lib.qir_pool_hold(-1)


def gemm_parts(m: int) -> int:
    """Parts per thread for an int8 product over ``m`` rows: each part streams the whole packed
    weight through the cache once, so parts keep at least 4 register tiles (24 rows) each."""
    return max(1, min(PARTS_PER_THREAD, m // (24 * max(1, threads()))))


def channel_groups(rows: int, blocks: int, work: int) -> tuple[int, int]:
    """How a call over ``rows`` output rows of ``blocks`` independent channel blocks splits across
    the threads: ``(blocks per group, grain)`` for a task whose units are (group, row) pairs, group-major.
    Groups of channels first (a part that splits rows rebuilds the input rows its first output rows
    share with the previous part; one that splits channels repeats nothing), as many as the call has
    parts; rows as well where there are fewer blocks than parts. ``grain`` keeps each part within
    one group where there are enough groups. One group when the call stays on one thread."""
    nt = threads() if work >= _SPLIT_MIN else 1
    if nt <= 1 or blocks <= 1:
        return max(1, blocks), 1
    parts = nt * PARTS_PER_THREAD
    per_group = -(-blocks // min(blocks, parts))
    groups = -(-blocks // per_group)
    return per_group, (rows if groups >= parts else 1)


def ptr(t: torch.Tensor) -> int:
    return int(t.data_ptr())


def float_bits(v: float) -> int:
    """``v`` rounded to float32, as the integer of its bits (how :func:`run` passes a float argument)."""
    return int(struct.unpack("<I", struct.pack("<f", v))[0])


class Call:
    """A call of entry point ``name`` with its arguments packed once (see :func:`run`): a layer whose
    inputs and outputs stay where they were (the same buffers, call after call) repeats it without
    rebuilding the argument array. Calling it runs the task on :func:`threads` threads at that time.
    ``keep``: objects the arguments point into (an epilogue structure, buffers), kept alive with it."""

    __slots__ = ("_lib", "argv", "grain", "keep", "name", "nargs", "per", "rows", "tid", "work")

    def __init__(
        self,
        name: str,
        args: tuple[int, ...],
        rows: int,
        work: int,
        grain: int = 1,
        per: int = PARTS_PER_THREAD,
        keep: object = None,
    ) -> None:
        lib = _lib or library()  # the loaded library even where a test stubs library() out for new states
        if lib is None:
            raise RuntimeError(f"native kernel {name}: the library is not available ({status()})")
        task = _tasks.get(name)
        if task is None:
            raise ValueError(f"native kernel {name}: not a row-range entry point of {_SRC.name}")
        self.tid, self.nargs = task
        if len(args) != self.nargs:
            raise ValueError(f"native kernel {name}: takes {self.nargs} arguments before r0, r1, got {len(args)}")
        self._lib, self.name = lib, name
        self.argv = (ctypes.c_int64 * self.nargs)(*args)
        self.rows, self.work, self.grain, self.per, self.keep = rows, work, grain, per, keep

    def __call__(self) -> int:
        nt = threads() if self.work >= _SPLIT_MIN else 1
        res = int(self._lib.qir_run(self.tid, self.argv, self.nargs, self.rows, nt, self.grain, self.per))
        if res < 0:
            raise RuntimeError(
                f"native kernel {self.name}: qir_run refused task {self.tid} with {self.nargs} arguments"
            )
        return res


def run(name: str, args: tuple[int, ...], rows: int, work: int, grain: int = 1, per: int = PARTS_PER_THREAD) -> int:
    """Entry point ``name`` of the loaded library over rows ``[0, rows)`` with ``args`` (its
    parameters before ``r0, r1``: integers, pointers as integers, floats through :func:`float_bits`),
    on :func:`threads` threads (``per`` parts each, cut at multiples of ``grain`` rows)
    when ``work`` (about the multiply-adds or bytes the call moves) pays for the hand-off. Returns
    the sum of the parts' results (a failure flag or count for the kernels that return one, else 0)."""
    return Call(name, args, rows, work, grain, per)()
