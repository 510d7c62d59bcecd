"""The qint16 segmented-table rule (``lut_int16_apply``, the converted modules' interpolation, and the
artifact's ``lut16`` kernel, whose per-interval integers are prepared at load) against a
Python-integer reference, on
random valid tables of both formats and both output dtypes: version 1's uniform knots with
values up to 2**24, version 2's aligned power-of-two intervals of every width."""

from __future__ import annotations

import bisect

import torch
from hypothesis import given
from hypothesis import strategies as st

from backends.common.kernels import get_kernel
from backends.common.lut_segmented import lut_int16_apply
from backends.common.program import Instruction
from qir.ir.table16 import table16_problem
from qir.ir.types import DType


@st.composite
def _tables(draw: st.DrawFn) -> tuple[int, str, list[int], list[int]]:
    """(version, out dtype, knot codes, knot values) of a table its format accepts."""
    version = draw(st.sampled_from([1, 2]))
    out = draw(st.sampled_from(["qint8", "qint16"]))
    lo, hi = DType.parse(out).qrange
    if version == 1:
        limit = draw(st.sampled_from([hi, 1 << 24]))  # version 1 values are not saturated
        knots = [-32768 + 128 * j for j in range(513)]
        return version, out, knots, draw(st.lists(st.integers(-limit, limit), min_size=513, max_size=513))
    knots, pos = [-32768], -32768
    while pos < 32768:
        offset = pos + 32768
        widest = min(offset & -offset if offset else 1 << 16, 32768 - pos)  # aligned, inside the range
        # mostly wide intervals (a table of a few hundred knots), some down to one code
        pos += 1 << draw(st.integers(max(0, widest.bit_length() - 1 - 9), widest.bit_length() - 1))
        knots.append(pos)
    return version, out, knots, draw(st.lists(st.integers(lo, hi), min_size=len(knots), max_size=len(knots)))


def _reference(knots: list[int], values: list[int], code: int, lo: int, hi: int) -> int:
    j = min(bisect.bisect_right(knots, code), len(knots) - 1) - 1  # the last interval starting at or below
    w, r = knots[j + 1] - knots[j], code - knots[j]
    return min(hi, max(lo, values[j] + ((values[j + 1] - values[j]) * r + w // 2) // w))


@given(_tables(), st.lists(st.integers(-32768, 32767), min_size=1, max_size=64))
def test_the_segmented_table_rule_matches_integer_arithmetic(
    table: tuple[int, str, list[int], list[int]], codes: list[int]
) -> None:
    version, out, knots, values = table
    entries = torch.tensor(values if version == 1 else [knots, values], dtype=torch.int32)
    assert table16_problem(entries, version, DType.parse(out)) is None
    lo, hi = DType.parse(out).qrange
    codes = [-32768, 32767, *codes]
    q = torch.tensor(codes, dtype=torch.int16)
    want = [_reference(knots, values, c, lo, hi) for c in codes]
    got = lut_int16_apply(entries, q, out, version)
    assert got.dtype == DType.parse(out).to_torch() and got.tolist() == want
    inst = Instruction("lut16", ("x",), ("y",), {"out_dtype": out, "version": version}, {"table": "t"})
    kernel = get_kernel("lut16")
    got = kernel.run(inst, [q], kernel.prepare(inst, {"t": entries}))[0]
    assert got.dtype == DType.parse(out).to_torch() and got.tolist() == want
