"""Strict JSON for artifact headers: the subset :func:`json.dumps` writes, and nothing that can
exhaust the reader.

Python's :mod:`json` accepts more than a compiled-model header ever holds, and some of it is
hostile: a 5,000-digit integer raises ``ValueError`` (the int-conversion limit), 50,000 nested
brackets raise ``RecursionError``, ``NaN`` / ``Infinity`` / ``1e999`` decode to non-finite
floats, and a key given twice silently keeps the last value (a second ``"march"`` wins).
:func:`loads_strict` refuses all of these with :class:`JSONLimitError` before or while decoding.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_FLOAT_CHARS", "MAX_INT_DIGITS", "JSONLimitError", "loads_strict"]

#: Nesting depth of arrays / objects a header may have (real headers: about 8).
MAX_DEPTH = 64
#: Digits of an integer literal (int64 and uint64 need at most 20).
MAX_INT_DIGITS = 20
#: Characters of a float literal (``repr`` of a float64 needs at most 24).
MAX_FLOAT_CHARS = 40

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class JSONLimitError(ValueError):
    """The header is not strict JSON or exceeds a limit; the message names the rule."""


def _depth(text: str) -> int:
    # strings may hold brackets: drop them first; what remains is brackets only
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(1 if c in "[{" else -1 for c in brackets), default=0)


def _int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise JSONLimitError(f"integer literal of {len(s)} characters: at most {MAX_INT_DIGITS} digits are allowed")
    return int(s)


def _float(s: str) -> float:
    if len(s) > MAX_FLOAT_CHARS:
        raise JSONLimitError(f"number literal of {len(s)} characters: at most {MAX_FLOAT_CHARS} are allowed")
    v = float(s)
    if not math.isfinite(v):
        raise JSONLimitError(f"number {s} is not finite: headers hold finite numbers only")
    return v


def _constant(s: str) -> Any:
    raise JSONLimitError(f"{s} is not allowed: headers hold finite numbers only")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            keys = ", ".join(repr(x) for x in list(out)[:6])
            raise JSONLimitError(f"duplicate key {k!r} in one object (keys {keys}): each key may appear once")
        out[k] = v
    return out


def loads_strict(text: str) -> Any:
    """Decode ``text`` like :func:`json.loads`, refusing duplicate keys, non-finite numbers,
    integers over :data:`MAX_INT_DIGITS` digits and nesting over :data:`MAX_DEPTH`."""
    depth = _depth(text)
    if depth > MAX_DEPTH:
        raise JSONLimitError(f"nesting depth {depth} is over the limit of {MAX_DEPTH}")
    try:
        return json.loads(text, object_pairs_hook=_object, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except JSONLimitError:
        raise
    except (json.JSONDecodeError, ValueError) as e:
        raise JSONLimitError(f"not valid JSON: {e}") from None
