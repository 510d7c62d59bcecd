"""Plain-text tables for the CLI's printouts."""

from __future__ import annotations

from collections.abc import Sequence


def table(rows: Sequence[Sequence[str]], right: Sequence[int] = (), indent: str = "  ") -> str:
    """Rows (the first is the header) in aligned columns; ``right``: right-aligned column indexes."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append(indent + "  ".join(cells).rstrip())
        if k == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def seconds_table(stages: Sequence[tuple[str, float]]) -> str:
    rows = [["stage", "seconds"]] + [[name, f"{secs:.2f}"] for name, secs in stages]
    return table(rows, right=(1,))
