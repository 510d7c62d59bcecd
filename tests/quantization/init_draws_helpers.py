"""The oracle of the tests of the QAT convs' skipped random initialization (tests/nn/test_qat_init_draws.py,
test_prepare_init_draws.py): ``from_float`` through the constructor, and module equality."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

import qir.nn.qat.conv as conv_module


@contextlib.contextmanager
def constructor_path() -> Iterator[None]:
    """from_float through the QAT class's constructor and copies (what it did before the prototypes)."""
    saved = conv_module._built_without_init_draw
    conv_module._built_without_init_draw = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        yield
    finally:
        conv_module._built_without_init_draw = saved


def assert_same_module(mine: nn.Module, theirs: nn.Module) -> None:
    """The same modules, attributes, tensors (bits, dtype, strides, Parameter-ness, requires_grad) and repr."""
    assert repr(mine) == repr(theirs)
    for (name, a), (oname, b) in zip(mine.named_modules(), theirs.named_modules(), strict=True):
        assert name == oname and type(a) is type(b) and a.training == b.training, name
        assert list(vars(a)) == list(vars(b)), name
        for slots in ("_parameters", "_buffers"):
            ta, tb = getattr(a, slots), getattr(b, slots)
            assert list(ta) == list(tb), (name, slots)
            for key, t in ta.items():
                u = tb[key]
                if t is None or u is None:
                    assert t is None and u is None, (name, key)
                    continue
                assert type(t) is type(u) and t.requires_grad == u.requires_grad, (name, key)
                assert t.dtype == u.dtype and t.stride() == u.stride() and torch.equal(t, u), (name, key)
