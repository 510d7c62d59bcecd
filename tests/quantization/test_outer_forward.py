"""OuterForward: the context of the outermost forward, entered and left once however the calls nest."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from qir.quantization.outer_forward import OuterForward


class _Log:
    events: list[tuple[str, str]] = []
    seen: list[str] = []  # the active context's root at each inner call

    def __init__(self, root: nn.Module) -> None:
        self.root = root

    def __enter__(self) -> _Log:
        _Log.events.append(("enter", type(self.root).__name__))
        return self

    def __exit__(self, *exc: Any) -> None:
        _Log.events.append(("exit", type(self.root).__name__))


_OUTER = OuterForward(_Log)


def _pre(root: nn.Module, args: Any) -> None:
    _OUTER.enter(root)


def _post(root: nn.Module, args: Any, out: Any) -> None:
    _OUTER.leave(root)


class Inner(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert _OUTER.active is not None
        _Log.seen.append(type(_OUTER.active.root).__name__)
        if bool((x < 0).any()):
            raise ValueError("negative input")
        return x + 1


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.inner(x))


def _hooked() -> Outer:
    m = Outer()
    for root in (m, m.inner):  # the inner model is a root of its own too: called inside, it finds the outer context
        root.register_forward_pre_hook(_pre)
        root.register_forward_hook(_post, always_call=True)
    return m


def test_nested_roots_share_the_outer_context() -> None:
    _Log.events.clear()
    _Log.seen.clear()
    m = _hooked()
    assert torch.equal(m(torch.zeros(2)), torch.full((2,), 2.0))
    assert _Log.events == [("enter", "Outer"), ("exit", "Outer")]
    assert _Log.seen == ["Outer", "Outer"]
    assert _OUTER.active is None
    m.inner(torch.zeros(1))  # called alone, the inner root has its own context
    assert _Log.events[2:] == [("enter", "Inner"), ("exit", "Inner")]
    assert _Log.seen[2:] == ["Inner"]


def test_a_raising_forward_leaves_the_context() -> None:
    _Log.events.clear()
    m = _hooked()
    with pytest.raises(ValueError, match="negative input"):
        m(-torch.ones(2))
    assert _Log.events == [("enter", "Outer"), ("exit", "Outer")]
    assert _OUTER.active is None
