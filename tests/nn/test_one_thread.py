"""passes.one_thread: conversion's weight arithmetic runs on one intra-op thread, and the caller's
thread count comes back after it, also when blocks nest, run in several threads or raise, and a count
set while a block ran stands."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import qir
from passes.one_thread import one_intra_op_thread
from qir.nn.quantized import QUANTIZED_MODULE_MAP
from qir.quantization import DeQuantStub, QuantStub, convert_fx, get_default_qat_qconfig, prepare_qat_fx
from qir.quantization.convert import CONVERT_PATH_KEY
from qir.quantization.fake_quantize import FakeQuantize


@pytest.fixture
def two_threads():
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(prev)


def test_one_thread_inside_and_restored_after(two_threads):
    with one_intra_op_thread():
        assert torch.get_num_threads() == 1
        with one_intra_op_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1  # the inner block does not restore early
    assert torch.get_num_threads() == 2


def test_restored_when_the_block_raises(two_threads):
    with pytest.raises(ValueError, match="inside"), one_intra_op_thread():
        raise ValueError("inside")
    assert torch.get_num_threads() == 2


def test_blocks_in_several_threads_restore_the_count_once_all_close(two_threads):
    inside, release = threading.Barrier(3), threading.Event()
    seen: list[int] = []

    def work() -> None:
        with one_intra_op_thread():
            inside.wait()
            release.wait()
            seen.append(torch.get_num_threads())

    workers = [threading.Thread(target=work) for _ in range(2)]
    for w in workers:
        w.start()
    inside.wait()  # both blocks open: the second saw 1 thread, yet must not restore 1 at its end
    release.set()
    for w in workers:
        w.join()
    assert seen == [1, 1]
    assert torch.get_num_threads() == 2


def test_a_count_set_inside_the_block_stands(two_threads):
    with one_intra_op_thread():
        torch.set_num_threads(3)  # the caller's choice made while the block runs
    assert torch.get_num_threads() == 3


def test_nested_blocks_give_back_the_latest_count(two_threads):
    with one_intra_op_thread():
        torch.set_num_threads(3)
        with one_intra_op_thread():
            assert torch.get_num_threads() == 1  # set again: the inner block's work is on one thread too
        assert torch.get_num_threads() == 3  # the inner block gave back the 3 it found
    assert torch.get_num_threads() == 3  # and the outer one leaves it: it was set after the outer's 1


def test_a_block_open_in_another_thread_does_not_hold_this_ones_count(two_threads):
    """Thread counts are per thread under torch's OpenMP backend: a block open elsewhere must neither
    leave this thread's work on two threads nor keep this thread's count at 1 after its own block."""
    opened, release = threading.Event(), threading.Event()

    def hold() -> None:
        with one_intra_op_thread():
            opened.set()
            release.wait()

    other = threading.Thread(target=hold)
    other.start()
    try:
        opened.wait()
        with one_intra_op_thread():
            assert torch.get_num_threads() == 1
    finally:
        release.set()
        other.join()
    assert torch.get_num_threads() == 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc(self.conv(self.quant(x)).mean((2, 3))))


@pytest.mark.parametrize("mapping", [None, dict(QUANTIZED_MODULE_MAP)], ids=["quantize_pass", "module_swap"])
def test_conversion_runs_on_one_thread_set_once_per_model(two_threads, monkeypatch, mapping):
    """Both convert paths observe and quantize every weight on one thread, the count set once for
    the model (not per layer) and restored after."""
    import qir.nn.quantized.conv as conv

    qir.set_march("bayes")  # the conftest fixture restores it
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    qat = prepare_qat_fx(_Net(), {"": get_default_qat_qconfig()}, x)
    qat(x)
    qat.eval()
    counts: list[int] = []
    sets: list[int] = []
    real_quantize, real_observe, real_set = conv.numerics.quantize, FakeQuantize.observe, torch.set_num_threads

    def quantize(*a, **k):
        counts.append(torch.get_num_threads())
        return real_quantize(*a, **k)

    def observe(self, x):
        counts.append(torch.get_num_threads())
        return real_observe(self, x)

    def set_num_threads(n: int) -> None:
        sets.append(n)
        real_set(n)

    monkeypatch.setattr(conv.numerics, "quantize", quantize)
    monkeypatch.setattr(FakeQuantize, "observe", observe)
    monkeypatch.setattr(torch, "set_num_threads", set_num_threads)
    out = convert_fx(qat, mapping=mapping)
    want = "quantize pass" if mapping is None else "module swap: a custom mapping="
    assert out.meta[CONVERT_PATH_KEY].startswith(want)
    assert len(counts) >= 4 and set(counts) == {1}  # two weights, each observed and quantized
    assert sets == [1, 2]  # once down for the model, once back
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("mapping", [None, dict(QUANTIZED_MODULE_MAP)], ids=["quantize_pass", "module_swap"])
def test_the_users_thread_count_is_respected_after_convert(mapping):
    """A count the user set before convert_fx is the count after it, also when convert_fx raises."""
    qir.set_march("bayes")  # the conftest fixture restores it
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    qat = prepare_qat_fx(_Net(), {"": get_default_qat_qconfig()}, x)
    qat(x)
    qat.eval()
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        convert_fx(qat, mapping=mapping)
        assert torch.get_num_threads() == 3
        qat.conv.weight_fake_quant.scale.fill_(float("nan"))  # convert refuses a NaN weight scale
        qat.conv.weight_fake_quant.disable_observer()
        with pytest.raises(Exception, match="positive and finite"):
            convert_fx(qat, mapping=mapping)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(prev)
