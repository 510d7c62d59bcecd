"""skip_uniform_draws leaves a generator byte for byte where torch's uniform_ leaves it, on the
native skip and on every fallback (backends/common/kernels/random_skip.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.common.kernels import random_skip
from backends.common.kernels.random_skip import skip_uniform_draws

CPU = torch.device("cpu")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
#: within one block of 624 outputs, at its edges, across several blocks
SIZES = (0, 1, 2, 311, 312, 623, 624, 625, 1247, 1248, 1249, 5000)


def _started(seed: int, warm: int) -> torch.Generator:
    """A generator part-way through a block: seeded, then ``warm`` float32 draws and one normal
    sample cached (the state holds it too)."""
    gen = torch.Generator().manual_seed(seed)
    torch.empty(warm).uniform_(generator=gen)
    torch.randn(1, generator=gen, dtype=torch.float64)
    return gen


def _same_as_uniform(n: int, dtype: torch.dtype, gen: torch.Generator, skip: Callable[[], None]) -> None:
    start = gen.get_state()
    torch.empty(n, dtype=dtype).uniform_(generator=gen)
    want, want_next = gen.get_state(), torch.rand(5, generator=gen)
    gen.set_state(start)
    skip()
    assert torch.equal(gen.get_state(), want), (n, dtype)
    assert torch.equal(torch.rand(5, generator=gen), want_next)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_skip_equals_uniform_(dtype: torch.dtype) -> None:
    for warm in (0, 5, 623):
        gen = _started(3, warm)
        for n in SIZES:
            _same_as_uniform(n, dtype, gen, partial(skip_uniform_draws, n, dtype, CPU, gen))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 3000), st.integers(0, 20000), st.sampled_from(DTYPES))
def test_the_skip_equals_uniform_from_any_state(seed: int, warm: int, n: int, dtype: torch.dtype) -> None:
    gen = _started(seed, warm)
    _same_as_uniform(n, dtype, gen, lambda: skip_uniform_draws(n, dtype, CPU, gen))


def test_the_default_generator_is_the_one_uniform_uses_without_one() -> None:
    torch.manual_seed(5)
    torch.rand(17)
    start = torch.get_rng_state()
    torch.empty(3001).uniform_()
    want = torch.get_rng_state()
    torch.set_rng_state(start)
    skip_uniform_draws(3001, torch.float32, CPU)
    assert torch.equal(torch.get_rng_state(), want)


def test_the_native_skip_is_in_use_here() -> None:
    """This machine has a C compiler: the skip is the twist, not a draw (the fallbacks are tested below)."""
    assert "skipping" in random_skip.status(), random_skip.status()
    skip_uniform_draws(10, torch.float32, CPU)
    skip_uniform_draws(10, torch.float64, CPU)
    assert random_skip._checked == {1: True, 2: True}


def test_an_invalid_state_is_refused_unchanged() -> None:
    state = torch.Generator().manual_seed(1).get_state()
    random_skip.status()
    bad = state.clone()
    bad[random_skip._LEFT : random_skip._LEFT + 4] = 0  # left = 0: the engine's is_valid refuses it
    kept = bad.clone()
    assert not random_skip._advance(bad, 100)
    assert torch.equal(bad, kept)
    assert not random_skip._advance(state[:-8].clone(), 100)  # not the state's size


@pytest.mark.parametrize("why", ["no library", "check failed", "state refused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_fallback_draws_the_same_stream(why: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    random_skip.status()
    monkeypatch.setattr(random_skip, "_status", random_skip._status)
    if why == "no library":
        monkeypatch.setattr(random_skip, "_skip", None)
    elif why == "check failed":
        monkeypatch.setattr(random_skip, "_checked", {})
        monkeypatch.setattr(random_skip, "_matches_uniform", lambda dtype: False)
    else:
        monkeypatch.setattr(random_skip, "_advance", lambda state, outputs: False)
    monkeypatch.setattr(random_skip, "_SLICE", 1000)  # several slices of the scratch buffer
    monkeypatch.setattr(random_skip, "_scratch", {})
    gen = _started(9, 17)
    for n in (1, 999, 1000, 1001, 4321):
        _same_as_uniform(n, dtype, gen, partial(skip_uniform_draws, n, dtype, CPU, gen))
    assert random_skip._scratch[dtype].numel() == 1000


def test_a_check_that_fails_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    random_skip.status()
    monkeypatch.setattr(random_skip, "_checked", {})
    monkeypatch.setattr(random_skip, "_status", random_skip._status)
    monkeypatch.setattr(random_skip, "_matches_uniform", lambda dtype: False)
    skip_uniform_draws(5, torch.float32, CPU)
    assert "did not match" in random_skip.status()


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QIR_NATIVE", "0")
    monkeypatch.setattr(random_skip, "_skip", None)
    monkeypatch.setattr(random_skip, "_status", None)
    assert "QIR_NATIVE=0" in random_skip.status()
    gen = _started(2, 0)
    _same_as_uniform(700, torch.float32, gen, lambda: skip_uniform_draws(700, torch.float32, CPU, gen))


def test_a_dtype_it_does_not_cover_is_drawn() -> None:
    """complex64: uniform_ draws both halves of each element; the fallback draws them."""
    gen = _started(4, 3)
    _same_as_uniform(333, torch.complex64, gen, lambda: skip_uniform_draws(333, torch.complex64, CPU, gen))


def test_meta_draws_nothing_and_bad_arguments_are_refused() -> None:
    state = torch.get_rng_state()
    skip_uniform_draws(10**9, torch.float32, torch.device("meta"))
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(ValueError, match="n must be >= 0"):
        skip_uniform_draws(-1, torch.float32, CPU)
    with pytest.raises(ValueError, match="cannot draw on meta"):
        skip_uniform_draws(1, torch.float32, torch.device("meta"), torch.Generator())
