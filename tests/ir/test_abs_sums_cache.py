"""``abs_sums`` answers a second question about an unchanged tensor from its cache, and a tensor edited
in place (its version moved), another tensor at the same address, or another axis, from the data."""

from __future__ import annotations

import gc

import torch

from qir.ir.numerics import abs_sum_max, abs_sums


def _reference(codes: torch.Tensor, axis: int) -> torch.Tensor:
    t = codes.to(torch.int64).abs().transpose(0, axis)
    return t.reshape(t.shape[0], -1).sum(dim=1)


def test_repeated_and_edited_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-128, 128, (6, 4, 3, 3), generator=g, dtype=torch.int64).to(torch.int8)
    first = abs_sums(w)
    assert torch.equal(first, _reference(w, 0))
    first.zero_()  # the caller's copy: the cache keeps its own
    assert torch.equal(abs_sums(w), _reference(w, 0))
    assert abs_sum_max(w, 0) == int(_reference(w, 0).max())
    assert torch.equal(abs_sums(w, 1), _reference(w, 1))  # another axis, another answer
    w[2].fill_(-128)  # in place: the version moves
    assert torch.equal(abs_sums(w), _reference(w, 0))
    assert int(abs_sums(w)[2]) == 128 * 36


def test_a_new_tensor_at_a_reused_address_is_read() -> None:
    seen = {}
    for i in range(20):  # fresh tensors, often at an address a dead one had
        t = torch.full((3, 5), i, dtype=torch.int8)
        seen[id(t)] = i
        assert torch.equal(abs_sums(t), torch.full((3,), 5 * i, dtype=torch.int64))
        del t
        gc.collect()
