"""qir.nn.quantized.one_thread: conversion's weight arithmetic runs on one intra-op thread, and the
process's thread count comes back after it, also when blocks nest, run in several threads or raise."""

from __future__ import annotations

import threading

import pytest
import torch

from qir.nn.quantized.conv import integer_conv_state, observed_weight_scale
from qir.nn.quantized.one_thread import one_intra_op_thread


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


def test_conversion_functions_run_on_one_thread(two_threads, monkeypatch):
    import qir.nn.quantized.conv as conv
    from qir.quantization import get_default_qat_qconfig
    from qir.quantization.fake_quantize import FakeQuantize

    counts: list[int] = []
    real_quantize, real_observe = conv.numerics.quantize, FakeQuantize.observe

    def quantize(*a, **k):
        counts.append(torch.get_num_threads())
        return real_quantize(*a, **k)

    def observe(self, x):
        counts.append(torch.get_num_threads())
        return real_observe(self, x)

    monkeypatch.setattr(conv.numerics, "quantize", quantize)
    monkeypatch.setattr(FakeQuantize, "observe", observe)
    w = torch.randn(4, 3, 3, 3)
    s_w, w_dtype = observed_weight_scale(get_default_qat_qconfig().weight(), w, "QATConv2d")
    assert counts == [1] and torch.get_num_threads() == 2
    cls = conv.CONV_CLASS_OF[("Conv2d", False, None)]
    out = (torch.tensor([0.2]), w_dtype)
    st = integer_conv_state(cls, w, None, 4, (s_w, w_dtype), [torch.tensor([0.1])], out, "bayes")
    assert len(counts) > 1 and set(counts) == {1}
    assert torch.get_num_threads() == 2
    assert st.weight.dtype == torch.int8
