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


def test_sums_noted_by_quantize_are_the_codes_sums() -> None:
    """``quantize(..., note_abs_sums=True)`` sums the rounded values before the cast: the answers
    abs_sums then gives from its cache equal the codes' own, per axis, saturated codes and ties included,
    and a tensor whose sums are not float32-exact (qint16 rows of 512 entries) is read from the data."""
    from qir.ir import numerics

    g = torch.Generator().manual_seed(1)
    for shape, axis, dtype in [((8, 4, 3, 3), 0, "qint8"), ((4, 6, 3, 3), 1, "qint8"), ((5, 512), 0, "qint16")]:
        w = torch.randn(shape, generator=g) * 3
        w.view(-1)[:4] = torch.tensor([1e9, -1e9, 0.5, -0.5])  # saturated codes and half-way ties
        s = torch.rand(shape[axis], generator=g) * 0.02 + 0.01
        codes = numerics.quantize(w, s, dtype, axis=axis, note_abs_sums=True)
        assert torch.equal(codes, numerics.quantize(w, s, dtype, axis=axis))
        assert torch.equal(abs_sums(codes, axis), _reference(codes, axis))
    nan = torch.full((2, 3), float("nan"))
    codes = numerics.quantize(nan, torch.ones(2), "qint8", axis=0, note_abs_sums=True)
    assert torch.equal(abs_sums(codes, 0), _reference(codes, 0))
