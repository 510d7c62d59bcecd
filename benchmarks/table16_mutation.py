"""Breaking one rule of a qint16 segmented table: the mutation the artifact fuzzer
(``fuzz_artifact.m_table16``, on a file's data bytes) and the IR fuzzer (``fuzz_ir.mutate_table16``,
on IR constants) share. A table is a row of knot codes and a row of values (a one-row table passes
the same row twice)."""

from __future__ import annotations

import random
from collections.abc import MutableSequence

__all__ = ["BAD_VALUES", "END_CODES", "RULES", "break_rule"]

#: the rules a table must keep: knot codes in order, power-of-two interval widths, the int16 ends, values
#: in the output range
RULES = ("swap", "bump", "ends", "value")
#: knot codes for a table's first or last knot: off the int16 ends, or inside them
END_CODES = (-32769, -32767, 32767, 32769, 40000, 0)
#: values outside a qint8 or qint16 output range, or past int32's (and a few in range)
BAD_VALUES = (32768, -32769, 128, -129, 2**24 + 1, 2**31 - 1, -(2**31), 0, 1)


def break_rule(rng: random.Random, knots: MutableSequence[int], values: MutableSequence[int], rule: str) -> None:
    """Break ``rule`` (one of :data:`RULES`) in place: two neighbouring knots swapped, an inner knot
    moved off its power-of-two spacing, an end knot moved, a value out of range. A table too short
    for a swap or a bump is left as it is."""
    n = len(knots)
    if rule == "swap" and n > 3:
        i = rng.randrange(1, n - 2)
        a, b = int(knots[i]), int(knots[i + 1])
        knots[i], knots[i + 1] = b, a
    elif rule == "bump" and n > 2:
        knots[rng.randrange(1, n - 1)] += rng.choice([1, -1, 3])
    elif rule == "ends":
        knots[rng.choice([0, n - 1])] = rng.choice(END_CODES)
    elif rule == "value":
        values[rng.randrange(len(values))] = rng.choice(BAD_VALUES)
