"""How many ``prepare_qat_fx`` / ``convert_fx`` calls of the real-user and seed scripts take the pass path.

Runs the scripts' tests (tests/real_users/, tests/seeds/ by default) under pytest with both
functions wrapped where the scripts import them (the test modules and the public ``qir`` /
``qir.quantization`` names; calls qir makes internally, such as exact validation's integer twin,
are not counted), records ``meta["qir.prepare_path"]`` / ``meta["qir.convert_path"]`` of every
result, and prints the counts and the reasons the rest were swapped, most frequent first.

    python benchmarks/path_census.py                 # from the repository root
    python benchmarks/path_census.py tests/real_users -k yolo

Run it from another checkout's root (``cd /work/main && python <this file>``) to count that
checkout's code: the tests and the ``qir`` it imports are the current directory's.
"""

from __future__ import annotations

import collections
import functools
import os
import re
import sys
from typing import Any

import pytest

_KEYS = {"prepare_qat_fx": "qir.prepare_path", "convert_fx": "qir.convert_path"}
_PASS = {"prepare_qat_fx": "insert-observers pass", "convert_fx": "quantize pass"}


class Census:
    """A pytest plugin: wraps the two functions after collection and records each result's path."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[str, str]]] = {name: [] for name in _KEYS}
        self.test = ""

    def _wrap(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            path = getattr(out, "meta", {}).get(_KEYS[name], "(no path recorded)")
            self.calls[name].append((self.test, str(path)))
            return out

        wrapper.__wrapped_by_census__ = True  # type: ignore[attr-defined]
        return wrapper

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session: Any, config: Any, items: list[Any]) -> None:
        import qir.quantization as q

        for name in _KEYS:
            original = getattr(q, name)
            wrapper = self._wrap(name, original)
            for mod in list(sys.modules.values()):
                modname = getattr(mod, "__name__", "") or ""
                public = modname in ("qir", "qir.quantization")
                if not public and (modname.startswith("qir.") or modname.startswith("torch")):
                    continue
                for attr, value in list(vars(mod).items()):
                    if value is original:
                        setattr(mod, attr, wrapper)

    def pytest_runtest_setup(self, item: Any) -> None:
        self.test = item.nodeid

    def report(self) -> None:
        for name, calls in self.calls.items():
            by_pass = sum(1 for _, p in calls if p == _PASS[name])
            print(f"{name}: {by_pass}/{len(calls)} calls take the pass path ({len({t for t, _ in calls})} tests)")
            reasons = collections.Counter(_short(p) for _, p in calls if p != _PASS[name])
            for why, count in reasons.most_common():
                print(f"  {count:3d}  {why}")
                for test in sorted({t for t, p in calls if p != _PASS[name] and _short(p) == why}):
                    print(f"         {test}")


def _short(path: str) -> str:
    """A swap reason without the node names and module paths that make every model's reason unique."""
    head = re.sub(r"%[\w.]+", "%…", path.split(" (and ", 1)[0])
    head = re.sub(r"(at|module) '[^']*'", r"\1 '…'", head)
    head = re.sub(r"\(module [^)]*\)", "(module …)", head)
    head = re.sub(r"call of '[^']*\.(\w+)'", r"call of '….\1'", head)
    return head if len(head) <= 160 else head[:157] + "..."


def main(argv: list[str]) -> int:
    census = Census()
    args = argv or ["tests/real_users", "tests/seeds"]
    os.environ.setdefault("HYPOTHESIS_PROFILE", "ci")
    code = pytest.main(["-q", "-p", "no:cacheprovider", *args], plugins=[census])
    census.report()
    return int(code)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
