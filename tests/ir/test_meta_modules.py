"""qir.ir.meta_modules.meta_module: the module torch's constructor builds on the meta device,
as a copy of a cached prototype that shares no state with it or with other copies."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from qir.ir.meta_modules import meta_module
from qir.ir.ops.nn import Conv2d, ConvTranspose2d, Linear

CASES: list[tuple[type[nn.Module], tuple[Any, ...], dict[str, Any]]] = [
    (nn.Conv2d, (8, 16, (3, 3)), {"stride": (2, 2), "padding": (1, 1), "groups": 2, "bias": True}),
    (nn.Conv2d, (8, 16, (1, 1)), {"padding": "same", "bias": False, "padding_mode": "zeros"}),
    (nn.Conv1d, (4, 6, (5,)), {"dilation": (2,), "bias": True, "padding_mode": "reflect"}),
    (nn.ConvTranspose2d, (8, 4, (2, 2)), {"stride": (2, 2), "output_padding": (1, 1), "bias": True}),
    (nn.Linear, (32, 10), {"bias": True}),
    (nn.Linear, (32, 10), {"bias": False}),
]


def _state(m: nn.Module) -> dict[str, Any]:
    """Everything of a module's __dict__ but its tensors, which are compared by shape and flags."""
    out: dict[str, Any] = {}
    for k, v in vars(m).items():
        if k in ("_parameters", "_buffers"):
            out[k] = {
                n: None if t is None else (type(t), t.shape, t.dtype, t.device, t.requires_grad) for n, t in v.items()
            }
        else:
            out[k] = v
    return out


@pytest.mark.parametrize(("cls", "args", "kwargs"), CASES)
def test_same_module_as_the_constructor(cls: type[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    fresh = cls(*args, **kwargs, device="meta")
    first, second = meta_module(cls, *args, **kwargs), meta_module(cls, *args, **kwargs)
    for m in (first, second):
        assert type(m) is cls
        assert _state(m) == _state(fresh)
        assert repr(m) == repr(fresh)
    # nothing mutable is shared between copies: containers, placeholders
    for key, value in vars(first).items():
        if isinstance(value, (dict, set, list)):
            assert value is not vars(second)[key], key
    for name, t in first.named_parameters():
        assert t is not dict(second.named_parameters())[name]
    first.register_forward_hook(lambda *a: None)
    first.weight = nn.Parameter(torch.zeros(first.weight.shape))
    assert not second._forward_hooks and second.weight.device.type == "meta"
    assert not meta_module(cls, *args, **kwargs)._forward_hooks


def test_argument_types_and_default_dtype_are_part_of_the_key() -> None:
    a = meta_module(nn.Conv2d, 4, 4, (1, 1), groups=1)
    b = meta_module(nn.Conv2d, 4, 4, (1, 1), groups=True)  # True == 1 to a dict: still its own prototype
    assert type(a.groups) is int and type(b.groups) is bool
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert meta_module(nn.Linear, 3, 2).weight.dtype == torch.float64
    finally:
        torch.set_default_dtype(old)
    assert meta_module(nn.Linear, 3, 2).weight.dtype == old


@pytest.mark.parametrize(
    ("op", "tensors"),
    [
        (Conv2d(stride=(2, 2), padding=(1, 1), groups=2), {"weight": torch.randn(8, 2, 3, 3), "bias": torch.randn(8)}),
        (
            ConvTranspose2d(stride=(2, 2), padding=(0, 0), output_padding=(0, 0), dilation=(1, 1)),
            {"weight": torch.randn(4, 3, 2, 2), "bias": torch.randn(3)},
        ),
        (Linear(bias=False), {"weight": torch.randn(5, 7)}),
    ],
)
def test_ops_build_modules_holding_their_tensors(op: Any, tensors: dict[str, torch.Tensor]) -> None:
    m = op.to_module(tensors)
    for role, t in tensors.items():
        held = getattr(m, role)
        assert isinstance(held, nn.Parameter) and held.data_ptr() == t.data_ptr()
    if "bias" not in tensors:
        assert m.bias is None
    if op.name == "conv2d":
        x = torch.randn(2, 4, 5, 5)
        assert torch.equal(
            m(x), torch.nn.functional.conv2d(x, tensors["weight"], tensors["bias"], (2, 2), (1, 1), 1, 2)
        )


def test_placeholders_only_for_the_slots_the_caller_leaves_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    import qir.ir.meta_modules as mm

    made: list[tuple[int, ...]] = []
    real = mm._placeholder

    def placeholder(t: torch.Tensor) -> torch.Tensor:
        made.append(tuple(t.shape))
        return real(t)

    monkeypatch.setattr(mm, "_placeholder", placeholder)
    w, b = torch.randn(2, 3), torch.randn(2)
    full = meta_module(nn.Linear, 3, 2, bias=True, tensors={"weight": w, "bias": b})
    assert made == []
    assert full.weight.data_ptr() == w.data_ptr() and full.bias.data_ptr() == b.data_ptr()
    part = meta_module(nn.Linear, 3, 2, bias=True, tensors={"weight": w, "bias": None})
    assert made == [(2,)]  # the bias slot only: None fills nothing
    assert part.bias.device.type == "meta" and part.weight.data_ptr() == w.data_ptr()


def test_given_tensors_follow_the_parameter_wrapping_rule() -> None:
    codes = torch.zeros(2, 3, dtype=torch.int8)
    floats = torch.randn(2)
    extra = torch.ones(1)
    m = meta_module(nn.Linear, 3, 2, bias=True, tensors={"weight": codes, "bias": floats, "scale": extra})
    assert isinstance(m.weight, nn.Parameter) and not m.weight.requires_grad  # integer codes: not trainable
    assert isinstance(m.bias, nn.Parameter) and m.bias.requires_grad
    assert m._buffers["scale"] is extra  # no parameter slot of that name: a buffer
    own = nn.Parameter(torch.randn(2, 3), requires_grad=False)
    assert meta_module(nn.Linear, 3, 2, bias=False, tensors={"weight": own}).weight is own


def test_instance_of_a_subclass_keeps_the_prototypes_state() -> None:
    class Sub(nn.Conv2d):
        pass

    m = meta_module(nn.Conv2d, 3, 4, (3, 3), instance_of=Sub)
    assert type(m) is Sub and _state(m) == _state(meta_module(nn.Conv2d, 3, 4, (3, 3)))
    with pytest.raises(TypeError, match="Linear is not a subclass of Conv2d"):
        meta_module(nn.Conv2d, 3, 4, (3, 3), instance_of=nn.Linear)
