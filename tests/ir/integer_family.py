"""Shared checks for the integer-op families: the family traced as opaque module calls (as before
its ops existed) and ``check_model``'s report compared between the two."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import attrs
from torch import nn

from qir.frontend import trace
from qir.ir.op import bump_registry_version
from qir.quantization import check_model


@contextlib.contextmanager
def opaque(family: Iterable[Any]) -> Iterator[None]:
    """Trace the modules of ``family`` (integer op classes) as opaque calls inside the block."""
    saved = {c: c.module_types for c in family}
    for c in saved:
        c.module_types = ()
    bump_registry_version()
    try:
        yield
    finally:
        for c, types in saved.items():
            c.module_types = types
        bump_registry_version()


def assert_check_model_unchanged(
    converted: nn.Module,
    x: Any,
    march: str,
    family: Iterable[Any],
    expect: Collection[str],
    gone: Collection[str],
) -> None:
    """``check_model`` reports the same findings with the family's integer ops as with the opaque
    calls they replaced; only the op a finding names is the integer op now, not ``call``."""
    report = check_model(converted, x, march=march)
    ops = {n.op.name for n in trace(converted, x).nodes}
    assert set(expect) <= ops
    with opaque(family):
        assert not set(gone) & {n.op.name for n in trace(converted, x).nodes}
        before = check_model(converted, x, march=march)
    assert str(report) == str(before)
    for now, was in ((report.violations, before.violations), (report.unknown, before.unknown)):
        assert [attrs.evolve(v, op="call") if v.op in ops else v for v in now] == list(was)
