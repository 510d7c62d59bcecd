"""Observers under torch.distributed: two gloo ranks on the CPU end with identical scales.

Each rank sees different data; the scales must match each other and a single process
that saw all of it. Ranks are forked (torch.multiprocessing, start_method="fork") rather
than spawned: a spawned rank re-imports torch, which alone takes seconds on a busy machine.
"""

from __future__ import annotations

import math
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qir.quantization import (
    FakeQuantize,
    KLObserver,
    MinMaxObserver,
    MixObserver,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
    MSEObserver,
    ObserverBase,
    PercentileObserver,
)

pytestmark = pytest.mark.ddp


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(4, 3, 5, generator=g) * (rank + 1) * (step + 1) for step in range(3)]
    # A rank with nothing to observe (no RoIs this step) must still join the collective.
    batches.append(torch.randn(2, 3, 5, generator=g) * 9 if rank == 0 else torch.empty(0, 3, 5))
    # A rank's non-finite batch is left out of the reduction: the others' data still counts, ranges agree.
    bad = torch.randn(4, 3, 5, generator=g) * 20
    if rank == 1:
        bad[2, 1, 0] = math.nan
    batches.append(bad)
    return batches


def _finite(x: torch.Tensor) -> torch.Tensor:
    return x if torch.isfinite(x).all() else x[:0]


def _observers() -> dict[str, FakeQuantize | ObserverBase]:
    return {
        "ema": FakeQuantize(observer=MovingAveragePerTensorMinMaxObserver, averaging_constant=0.3),
        "per_channel": FakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, ch_axis=1),
        "minmax": MinMaxObserver(dtype="qint16"),
        "percentile": PercentileObserver(percentile=99.0, bins=64),
        "mse": MSEObserver(bins=64),
        "kl": KLObserver(bins=512),
        "mix": MixObserver(bins=512),
    }


def _run(observers: dict[str, FakeQuantize | ObserverBase], batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    for x in batches:
        for obs in observers.values():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the non-finite batch's skip notice
                obs(x)
    return {name: obs.scale.clone() for name, obs in observers.items()}


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.save(_run(_observers(), _batches(rank)), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_rank_scales_are_identical_and_match_the_pooled_data(tmp_path: Path) -> None:
    mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    # Pooled reference: each step's batch is the two ranks' batches together.
    pooled = [torch.cat([_finite(a), _finite(b)]) for a, b in zip(_batches(0), _batches(1), strict=True)]
    ref = _run(_observers(), pooled)
    for name in ref:
        assert torch.equal(r0[name], r1[name]), name
        assert torch.allclose(r0[name], ref[name], rtol=1e-6, atol=0), name
