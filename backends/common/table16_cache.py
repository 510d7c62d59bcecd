"""A bounded cache of qint16 segmented tables evaluated at every code, for the QAT integer grid.

The grid looks a layer's qint16 input codes up in the table ``convert_fx`` would build from the
current scales (qir.quantization.integer_grid_functional / integer_grid_methods). Building a
version-2 table evaluates ``f`` at all 65,537 codes and places the knots (about 1 ms), and
interpolating a large activation through the knots (a binary search per element) costs more
still. Both depend only on the function, the input and output scales, the output dtype, the
format version and the knot budget, so the grid keeps, per such key, the table evaluated at
every code (:func:`~backends.common.lut_segmented.full_table16`: 65,536 output codes, exactly
what the interpolation gives for each) and a lookup is one gather.

Keys hold the scales as the float32 values the table is built from: when an observer moves a
scale, the key changes and the next lookup builds the table of the new scale. The cache is a
least-recently-used map bounded in bytes (:data:`MAX_BYTES`); ``TABLE16_CACHE.enabled = False``
(or ``with TABLE16_CACHE.disabled():``) builds the knots and interpolates on every call, as
before the cache (benchmarks/table16_grid_cache.py measures both in one run).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch

from backends.common.lut_segmented import full_table16, lut_int16_apply
from qir.ir.types import DType

__all__ = ["MAX_BYTES", "TABLE16_CACHE", "Table16Cache"]

#: the bound of the cache: 256 qint16-output tables (128 KiB each), 512 qint8-output ones
MAX_BYTES = 32 << 20


class Table16Cache:
    """``key -> every code's output`` for qint16 segmented tables, least recently used first out."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"Table16Cache: max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.enabled = True
        self.hits = 0
        self.misses = 0
        self._tables: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # DataParallel replicas run their forwards in threads

    def __len__(self) -> int:
        return len(self._tables)

    @property
    def nbytes(self) -> int:
        """The bytes the cached tables hold."""
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self._bytes = 0
            self.hits = self.misses = 0

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Inside the block every lookup builds its table (the cache is neither read nor written)."""
        was = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = was

    def lookup(
        self,
        key: Hashable | None,
        build: Callable[[], torch.Tensor | None],
        q: torch.Tensor,
        out_dtype: DType,
        version: int,
    ) -> torch.Tensor | None:
        """The output codes of the qint16 codes ``q`` through the table ``build()`` returns (its knots in
        format ``version``, outputs in ``out_dtype``), or None when ``build()`` gives None (no table).

        ``key`` must name everything ``build`` depends on (function, scales, dtypes, version, budget);
        None: not cacheable, build and interpolate for this call."""
        if key is None or not self.enabled:
            entries = build()
            return None if entries is None else lut_int16_apply(entries, q, out_dtype, version)
        with self._lock:
            full = self._tables.get(key)
            if full is not None:
                self._tables.move_to_end(key)
                self.hits += 1
        if full is None:
            entries = build()
            if entries is None:
                return None
            full = full_table16(entries, out_dtype, version)
            self._insert(key, full)
        return full.index_select(0, q.reshape(-1).to(torch.int64) + 32768).reshape(q.shape)

    def _insert(self, key: Hashable, full: torch.Tensor) -> None:
        size = full.numel() * full.element_size()
        with self._lock:
            self.misses += 1
            if size > self.max_bytes:
                return
            old = self._tables.pop(key, None)
            if old is not None:
                self._bytes -= old.numel() * old.element_size()
            while self._tables and self._bytes + size > self.max_bytes:
                _, dropped = self._tables.popitem(last=False)
                self._bytes -= dropped.numel() * dropped.element_size()
            self._tables[key] = full
            self._bytes += size


#: the process-wide cache the integer grid uses
TABLE16_CACHE = Table16Cache()
