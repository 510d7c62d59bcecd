"""The native kernels split across threads (native_pool.c, ``native.run``): a compiled model gives the
same codes at 1, 2 and 3 threads on odd shapes (every kernel split, however small), row ranges
cut at tile multiples and past the row count, two callers at once, and a forked child."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from bitexact_models import Stubbed, fx_converted, randomize_bn
from torch import nn

import qir
from backends.common.kernels import conv as conv_mod
from backends.common.kernels import native
from backends.common.kernels import pool as pool_mod
from backends.common.kernels.requant_pack import pack_requant
from backends.common.program import Instruction
from backends.common.runtime import CompiledModel
from qir.ir.numerics import requantize
from qir.quantization import compile_model

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels unavailable: {native.status()}")


class _Mixed(nn.Module):
    """A strided stem, max pool, depthwise + pointwise convs, a residual add and a linear head: every
    native kernel the runtime splits (quantize, conv, max pool, depthwise, fused add, matrix product)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 20, 3, stride=2, padding=1), nn.BatchNorm2d(20), nn.ReLU())
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.dw = nn.Sequential(nn.Conv2d(20, 20, 3, padding=1, groups=20), nn.BatchNorm2d(20), nn.ReLU())
        self.pw = nn.Sequential(nn.Conv2d(20, 24, 1), nn.BatchNorm2d(24))
        self.res = nn.Sequential(nn.Conv2d(24, 24, 3, padding=1), nn.BatchNorm2d(24))
        self.relu = nn.ReLU()
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(24, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pw(self.dw(self.pool(self.stem(x))))
        return self.head(self.relu(self.res(y) + y))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    shape = (3, 3, 29, 23)  # odd batch and sizes: no split lands on a tile or row boundary by luck
    converted = fx_converted(Stubbed(randomize_bn(_Mixed())), shape, "bayes", batches=2)
    path = tmp_path_factory.mktemp("threads") / "mixed.hbm"
    compile_model(converted, [torch.randn(*shape)], hbm=path, march="bayes", opt=1, check=False)
    return path, converted


def test_codes_equal_at_one_two_and_three_threads(
    mixed: tuple[Path, nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, converted = mixed
    monkeypatch.setattr(native, "_SPLIT_MIN", 0)  # split every call, however small
    x = torch.randn(3, 3, 29, 23, generator=torch.Generator().manual_seed(1)) * 1.5
    with torch.no_grad():
        want = converted(x)
    engines = set()
    for nt in (1, 2, 3):
        model = qir.load_compiled(path, num_threads=nt)
        engines |= {i.attrs.get("engine") for i in model.program.instructions}
        assert torch.equal(model(x), want), f"{nt} threads"
        assert torch.equal(model(x[:1]), want[:1]), f"{nt} threads, batch 1"
    assert {"dw", "int_mm"} <= engines or {"dw", "int_mm_t"} <= engines
    assert native.library().qir_pool_threads() >= 2  # the 3-thread calls really ran on the pool


def test_row_ranges_cut_at_the_grain_and_past_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requantization rows through ``native.run`` with more threads than rows or grains: equal to one call."""
    monkeypatch.setattr(native, "_SPLIT_MIN", 0)
    g = torch.Generator().manual_seed(3)
    n = 11
    mult = torch.randint(0, 32768, (n,), generator=g)
    shift = torch.randint(10, 32, (n,), generator=g)
    bias = torch.randint(-(2**20), 2**20, (n,), generator=g)
    lo, hi = torch.full((n,), -128), torch.full((n,), 127)
    rq, fast = pack_requant(mult, shift, bias, lo, hi)
    p = native.ptr
    for rows in (1, 2, 5, 7, 13):
        acc = torch.randint(-(2**20), 2**20, (rows, n), generator=g, dtype=torch.int32)
        outs = []
        for nt, grain in ((1, 1), (2, 1), (3, 1), (3, 6), (8, 2)):
            out = torch.full((rows, n), 99, dtype=torch.int8)
            args = (p(acc), n, n, p(rq), int(fast), p(out))
            torch.set_num_threads(nt)
            try:
                assert native.run("qir_requant_rows_i8", args, rows, 1, grain) == 0
            finally:
                torch.set_num_threads(1)
            outs.append(out)
        want = requantize(acc.to(torch.int64) + bias, mult, shift, "qint8", axis=-1)
        for out in outs:
            assert torch.equal(out, want), rows


def test_two_callers_at_once_get_their_own_codes(
    mixed: tuple[Path, nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One pool, two calling threads: the second runs its call alone while the first holds the pool."""
    path, converted = mixed
    monkeypatch.setattr(native, "_SPLIT_MIN", 0)
    xs = [torch.randn(2, 3, 29, 23, generator=torch.Generator().manual_seed(s)) for s in (5, 6)]
    with torch.no_grad():
        want = [converted(x) for x in xs]
    models = [qir.load_compiled(path, num_threads=2) for _ in xs]
    got: list[list[torch.Tensor]] = [[], []]

    def work(i: int) -> None:
        for _ in range(15):
            got[i].append(models[i](xs[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i in range(2):
        assert len(got[i]) == 15 and all(torch.equal(y, want[i]) for y in got[i])


def _child(path: str, x: torch.Tensor, q: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    native._SPLIT_MIN = 0
    q.put(qir.load_compiled(path, num_threads=2)(x).tolist())  # plain data: no shared-memory handle


def test_a_forked_child_restarts_the_pool(mixed: tuple[Path, nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's threads do not survive fork(): the child starts its own instead of waiting on the parent's."""
    path, converted = mixed
    monkeypatch.setattr(native, "_SPLIT_MIN", 0)
    x = torch.randn(1, 3, 29, 23, generator=torch.Generator().manual_seed(7))
    qir.load_compiled(path, num_threads=2)(x)  # the parent's pool is running
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_child, args=(str(path), x, q))
    proc.start()
    got = q.get(timeout=60)
    proc.join(timeout=60)
    with torch.no_grad():
        assert torch.equal(torch.tensor(got), converted(x))
    assert proc.exitcode == 0


def test_run_refuses_unknown_entry_points_and_wrong_arguments() -> None:
    with pytest.raises(ValueError, match="not a row-range entry point"):
        native.run("qir_caps", (), 1, 1)
    with pytest.raises(ValueError, match="takes 6 arguments"):
        native.run("qir_requant_rows_i8", (0, 1), 1, 1)


def test_fused_finish_splits_like_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused conv + add rows at 3 threads equal the 1-thread rows (the int64 path of native.c)."""
    monkeypatch.setattr(native, "_SPLIT_MIN", 0)
    g = torch.Generator().manual_seed(9)
    n, rows = 13, 29
    fr = conv_mod.fused_requant(
        "qint8",
        "relu",
        torch.randint(1 << 14, 1 << 15, (n,), generator=g),
        torch.randint(18, 24, (n,), generator=g),
        torch.randint(-999, 999, (n,), generator=g),
        torch.zeros(n, dtype=torch.int64),
        n,
        (20000, 15, 2),
    )
    assert fr is not None
    acc = torch.randint(-(2**24), 2**24, (rows, n), generator=g, dtype=torch.int32)
    addend = torch.randint(-128, 128, (rows, n), generator=g, dtype=torch.int8)
    outs = []
    for nt in (1, 3):
        torch.set_num_threads(nt)
        try:
            outs.append(conv_mod.fused_finish(acc, addend, fr, rows))
        finally:
            torch.set_num_threads(1)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16])
def test_native_global_sums_equal_torch(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The global average pool's sums (one native pass over NHWC codes) at 1 and 3 threads equal torch's."""
    monkeypatch.setattr(native, "_SPLIT_MIN", 0)
    lo, hi = (-128, 127) if dtype == torch.int8 else (-32768, 32767)
    g = torch.Generator().manual_seed(11)
    for nb, c, h, w in ((1, 1, 1, 1), (3, 37, 7, 5), (5, 130, 3, 9)):
        x = torch.randint(lo, hi + 1, (nb, h, w, c), generator=g, dtype=torch.int64).to(dtype).permute(0, 3, 1, 2)
        x[0, 0] = hi  # a saturated plane: the largest sum
        want = x.to(torch.int64).sum(dim=(-2, -1), keepdim=True)
        for nt in (1, 3):
            torch.set_num_threads(nt)
            try:
                got = pool_mod._global_sums_native(x)
            finally:
                torch.set_num_threads(1)
            assert got is not None and got.dtype == torch.int32
            assert torch.equal(got.to(torch.int64), want)
    assert pool_mod._global_sums_native(torch.zeros(1, 2, 3, 3)) is None  # float input: the torch path


def test_torch_runs_on_one_thread_when_every_kernel_is_native(
    mixed: tuple[Path, nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every instruction native or light, the pool gets num_threads and torch one thread (its
    OpenMP workers would spin against the pool); with a torch-path layer, torch keeps num_threads."""
    path, converted = mixed
    monkeypatch.setattr(native, "_SPLIT_MIN", 0)
    seen: list[tuple[int, int]] = []
    run = native.run

    def spy(*args: object, **kw: object) -> int:
        seen.append((torch.get_num_threads(), native.threads()))
        return run(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "run", spy)
    x = torch.randn(2, 3, 29, 23, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = converted(x)
    model = qir.load_compiled(path, num_threads=2)
    head = [i for i in model.program.instructions if i.op == "linear"]
    assert [i.attrs["engine"] for i in head] == ["f32"]  # opt=1's preference: a torch-path linear
    assert model.torch_threads == 2
    assert torch.equal(model(x), want)
    assert seen and all(s == (2, 2) for s in seen)
    head[0].attrs["engine"] = "int_mm"  # exact too (24 inputs); native with AVX-512 VNNI
    all_native = CompiledModel(model.program, num_threads=2)
    assert all_native.torch_threads == (1 if native.has_vnni() else 2)
    seen.clear()
    assert torch.equal(all_native(x), want)
    assert seen and all(s == (all_native.torch_threads, 2) for s in seen)
    assert torch.get_num_threads() == 1  # restored (the suite runs torch on one thread)
    assert qir.load_compiled(path, num_threads=None).torch_threads is None


def _split_requant(rows: int = 64, n: int = 32) -> None:
    """One requantization call split across the pool (whatever its size)."""
    acc = torch.zeros(rows, n, dtype=torch.int32)
    one, zero = torch.ones(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    rq, fast = pack_requant(one, one, zero, zero - 128, zero + 127)
    out = torch.empty(rows, n, dtype=torch.int8)
    p = native.ptr
    assert native.run("qir_requant_rows_i8", (p(acc), n, n, p(rq), int(fast), p(out)), rows, 1) == 0


def test_a_held_pool_does_not_sleep_between_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within ``holding_pool`` the pool's threads spin through a gap far longer than their spin budget
    (no wake-up for the next kernel); once the hold is released they go to sleep."""
    monkeypatch.setattr(native, "_SPLIT_MIN", 0)
    lib = native.library()
    spin = lib.qir_pool_spin_us(50)
    try:
        with native.using_threads(2):
            _split_requant()  # the pool's thread is running
            with native.holding_pool():
                assert lib.qir_pool_hold(0) == 1
                parked = lib.qir_pool_parked()
                for _ in range(3):
                    time.sleep(0.01)  # 200 spin budgets
                    _split_requant()
                assert lib.qir_pool_parked() == parked
            assert lib.qir_pool_hold(0) == 0
            deadline = time.monotonic() + 10
            while lib.qir_pool_parked() == parked and time.monotonic() < deadline:
                time.sleep(0.001)
            assert lib.qir_pool_parked() > parked
    finally:
        lib.qir_pool_spin_us(spin)


def _pool_thread(name: str) -> int:
    """The thread id of the pool thread called ``name`` (pool threads name themselves qir-pool-<n>)."""
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == name:
                return int(task.name)
        except OSError:  # a thread that just ended
            continue
    raise AssertionError(f"no thread named {name} in this process")


def _last_cpu(tid: int) -> int:
    """The core thread ``tid`` runs (or last ran) on: field 39 of /proc/self/task/<tid>/stat."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[36])


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or not Path("/proc/self/task").is_dir() or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux thread affinities and at least two allowed cores",
)
def test_a_pool_thread_on_the_callers_core_moves_off_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool thread that finds itself on the caller's core when a task comes moves to another core of
    its mask (and keeps its whole mask) instead of sitting the task out call after call: left there,
    a 2-thread call ran at the 1-thread speed for the life of the process."""
    monkeypatch.setattr(native, "_SPLIT_MIN", 0)
    lib = native.library()
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    with native.using_threads(2):
        _split_requant()  # the pool's first thread is running
        helper = _pool_thread("qir-pool-1")
        os.sched_setaffinity(0, {cpu})  # this (the calling) thread
        try:
            with native.holding_pool():  # the helper spins between the calls: no wake-up places it
                os.sched_setaffinity(helper, {cpu})
                # a sleeping thread keeps its old core number until it next runs (the kernel moves it at its
                # wake-up), so call until it has run once on the caller's core, with nowhere to go
                deadline = time.monotonic() + 2
                _split_requant()
                while _last_cpu(helper) != cpu and time.monotonic() < deadline:
                    _split_requant()
                assert _last_cpu(helper) == cpu
                os.sched_setaffinity(helper, allowed)  # free to go, but nothing moves it yet
                moved = lib.qir_pool_moved()
                # calls long enough (about 0.1 ms of work each) that the helper, sharing the core, soon gets a
                # turn during one and sees its task; the load balancer alone took several seconds to move it
                deadline = time.monotonic() + 2
                while _last_cpu(helper) == cpu and time.monotonic() < deadline:
                    _split_requant(rows=4096, n=64)
                assert _last_cpu(helper) != cpu, "the pool thread stayed on the caller's core"
                deadline = time.monotonic() + 5  # the move pins the thread for a moment, then restores its mask
                while os.sched_getaffinity(helper) != allowed and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert os.sched_getaffinity(helper) == allowed  # moved, not pinned
                # on a busy machine the move was the pool's own; on an idle one the scheduler may have been first
                assert lib.qir_pool_moved() >= moved
        finally:
            os.sched_setaffinity(0, allowed)
            os.sched_setaffinity(helper, allowed)


def test_the_hold_ends_with_the_call(mixed: tuple[Path, nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled model holds the pool during its call only, also when the call fails; a one-thread
    call takes no hold, and releasing more holds than were taken leaves none (not a negative count)."""
    path, _ = mixed
    monkeypatch.setattr(native, "_SPLIT_MIN", 0)
    lib = native.library()
    holds: list[int] = []
    run = native.run

    def spy(*args: object, **kw: object) -> int:
        holds.append(int(lib.qir_pool_hold(0)))
        return run(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "run", spy)
    x = torch.randn(1, 3, 29, 23)
    for nt, want in ((2, 1), (1, 0)):
        holds.clear()
        qir.load_compiled(path, num_threads=nt)(x)
        assert holds and set(holds) == {want}, nt
        assert lib.qir_pool_hold(0) == 0
    model = qir.load_compiled(path, num_threads=2)
    monkeypatch.setattr(native, "run", lambda *a, **k: 1 // 0)
    with pytest.raises(RuntimeError, match="by zero"):
        model(x)
    assert lib.qir_pool_hold(0) == 0
    assert lib.qir_pool_hold(-1) == 0 and lib.qir_pool_hold(0) == 0


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
def test_quantize_split_by_pixels_equals_one_call(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quantize kernel's parts are runs of whole pixels (64 at a time), not planes: at 2 and 3
    threads the NHWC codes equal the 1-thread codes, with parts and 64-pixel blocks crossing image
    boundaries (an odd pixel count per image) and more threads than blocks."""
    from backends.common.kernels import quant as quant_mod

    monkeypatch.setattr(native, "_SPLIT_MIN", 0)
    g = torch.Generator().manual_seed(13)
    for shape in ((3, 3, 29, 23), (2, 5, 1, 7), (1, 1, 13, 11), (5, 2, 9, 15)):
        x = torch.randn(shape, generator=g) * 40
        outs = []
        for nt in (1, 2, 3):
            with native.using_threads(nt):
                got = quant_mod._quantize_native(x, 0.37, dtype)
            assert got is not None
            outs.append(got)
        with monkeypatch.context() as m:
            m.setattr(native, "library", lambda: None)  # the torch rule
            inst = Instruction("quantize", ("x",), ("q",), {"scale": 0.37, "dtype": dtype})
            want = quant_mod.quantize(inst, [x], None)
        for got in outs:
            assert torch.equal(got, want[0]), shape


@pytest.mark.parametrize("out_dtype", ["qint8", "qint16"])
def test_native_global_mean_equals_the_float64_rule(out_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The global average pool's native sums + requantization equal its float64 path (the
    divisor's table entry, saturation at both ends), at 1 and 3 threads; a multiplier the native
    kernel cannot take leaves the layer on the float64 path."""
    monkeypatch.setattr(native, "_SPLIT_MIN", 0)
    g = torch.Generator().manual_seed(17)
    for nb, c, h, w in ((1, 512, 7, 7), (3, 37, 5, 3), (2, 20, 1, 1)):
        size = 64
        mult = torch.randint(1, 32768, (size,), generator=g)
        shift = torch.randint(8, 24, (size,), generator=g)
        if c == 20:
            mult[h * w - 1] = 2**31  # past the native kernel's multipliers: the float64 path
        inst = Instruction(
            "adaptive_avgpool2d",
            ("x",),
            ("y",),
            {"output_size": [1, 1], "out_dtype": out_dtype},
            consts={"multipliers": "m", "shifts": "s"},
        )
        x = torch.randint(-128, 128, (nb, h, w, c), generator=g, dtype=torch.int8).permute(0, 3, 1, 2)
        got = []
        for nt in (1, 3):
            state = pool_mod._prepare_adaptive(inst, {"m": mult, "s": shift})
            with native.using_threads(nt):
                got.append(pool_mod.adaptive_avgpool2d(inst, [x], state)[0])
            assert (state.packed[(h * w, c, out_dtype)] is None) == (c == 20)
        with monkeypatch.context() as m:
            m.setattr(native, "library", lambda: None)  # the float64 path
            want = pool_mod.adaptive_avgpool2d(inst, [x], pool_mod._prepare_adaptive(inst, {"m": mult, "s": shift}))[0]
        for y in got:
            assert y.dtype == want.dtype and y.shape == want.shape and torch.equal(y, want), (nb, c, h, w)
