"""Progress bars (tqdm) on stderr, shown only when stderr is a terminal unless forced."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def bar(
    items: Iterable[T], desc: str, enabled: bool | None = None, total: int | None = None, unit: str = "batch"
) -> Iterator[T]:
    """``items`` with a progress bar. ``enabled`` None: only on a terminal (logs stay clean)."""
    show = sys.stderr.isatty() if enabled is None else enabled
    yield from tqdm(
        items, desc=desc, total=total, unit=unit, disable=not show, leave=False, file=sys.stderr, dynamic_ncols=True
    )
