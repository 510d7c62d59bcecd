"""fuse_fx: seed 001's printout, every seed fusion combination, no mutation, stable names, checkpoints."""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from flow_models import Block, ModelForFusion, ResNetish, randomize_bn
from torch import nn

import qir.nn.quantized
from qir.nn.intrinsic import FusedModule
from qir.quantization import fuse_fx

SEED_001_TREE = """ModelForFusion(
  (quantx): QuantStub()
  (quanty): QuantStub()
  (conv): Identity()
  (bn): Identity()
  (relu): Identity()
  (dequant): DeQuantStub()
  (_generated_add_0): ConvAddReLU2d(
    (conv): Conv2d(3, 3, kernel_size=(3, 3), stride=(1, 1))
    (relu): ReLU()
  )
)"""


def module_tree(m: nn.Module) -> str:
    """The module printout without GraphModule's generated code."""
    return nn.Module.__repr__(m)


def test_seed_001_printout() -> None:
    fused = fuse_fx(ModelForFusion())
    assert module_tree(fused) == SEED_001_TREE
    code = fused.code
    assert "self._generated_add_0(quantx, quanty)" in code
    assert "self.conv(" not in code and "self.bn(" not in code


def test_fused_model_computes_the_same_in_eval() -> None:
    model = randomize_bn(ModelForFusion()).eval()
    fused = fuse_fx(model).eval()
    x, y = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(fused(x, y), model(x, y), rtol=1e-5, atol=1e-5)


def test_does_not_mutate_or_share() -> None:
    model = randomize_bn(ModelForFusion())
    before = copy.deepcopy(model.state_dict())
    fused = fuse_fx(model)
    assert module_tree(model).count("BatchNorm2d") == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    ours = {t.data_ptr() for t in model.state_dict().values()}
    assert not ours & {t.data_ptr() for t in fused.state_dict().values()}
    with torch.no_grad():
        next(fused.parameters()).add_(1.0)
    assert torch.equal(model.conv.weight, before["conv.weight"])


# ---------------------------------------------------------------------------------------------
# the seeds' combinations: conv x bn x add spelling x relu spelling, conv on either side


class _Combo(nn.Module):
    def __init__(self, conv: nn.Module, bn: nn.Module | None, add: str, relu: str, conv_first: bool) -> None:
        super().__init__()
        self.conv = conv
        self.bn = bn if bn is not None else nn.Identity()
        self.use_bn = bn is not None
        self.add_kind = add
        self.relu_kind = relu
        self.conv_first = conv_first
        if add == "torch_ff":
            self.ff = torch.ao.nn.quantized.FloatFunctional()
        elif add == "qir_ff":
            self.ff = qir.nn.quantized.FloatFunctional()
        if relu == "ReLU":
            self.act = nn.ReLU()
        elif relu == "ReLU6":
            self.act = nn.ReLU6()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = self.conv(x)
        if self.use_bn:
            z = self.bn(z)
        a, b = (z, y) if self.conv_first else (y, z)
        if self.add_kind in ("torch_ff", "qir_ff"):
            s = self.ff.add(a, b)
        elif self.add_kind == "torch.add":
            s = torch.add(a, b)
        else:
            s = operator.add(a, b)
        if self.relu_kind in ("ReLU", "ReLU6"):
            return self.act(s)  # type: ignore[no-any-return]
        return F.relu(s) if self.relu_kind == "F.relu" else F.relu6(s)


_CONVS: dict[str, tuple[Callable[[], nn.Module], Callable[[], nn.Module], tuple[int, ...], str]] = {
    "Conv2d": (lambda: nn.Conv2d(3, 4, 3, padding=1), lambda: nn.BatchNorm2d(4), (2, 3, 5, 5), "ConvAddReLU"),
    "ConvTranspose2d": (
        lambda: nn.ConvTranspose2d(3, 4, 3, padding=1),
        lambda: nn.BatchNorm2d(4),
        (2, 3, 5, 5),
        "ConvTransposeAddReLU",
    ),
    "Conv3d": (lambda: nn.Conv3d(3, 4, 3, padding=1), lambda: nn.BatchNorm3d(4), (2, 3, 4, 4, 4), "ConvAddReLU"),
    "Linear": (lambda: nn.Linear(3, 4), lambda: nn.BatchNorm1d(4), (2, 3), "LinearAddReLU"),
}
_OUT = {"Conv2d": (2, 4, 5, 5), "ConvTranspose2d": (2, 4, 5, 5), "Conv3d": (2, 4, 4, 4, 4), "Linear": (2, 4)}


def _combo_cases() -> list[Any]:
    """Every conv x add x relu spelling (64 cases); the batch norm kind and the conv's side of the
    add cycle through their values, so each appears with every conv (a full product would be 6x
    slower for no new code path)."""
    cases = []
    bns = ("bn", None, "sync")
    i = 0
    for conv in _CONVS:
        for add in ("torch_ff", "qir_ff", "torch.add", "+"):
            for relu in ("ReLU", "ReLU6", "F.relu", "F.relu6"):
                bn = bns[i % 3]
                if bn == "sync" and conv == "Linear":
                    bn = "bn"  # SyncBatchNorm wants (N, C, *spatial) input
                conv_first = (i // 3) % 2 == 0
                i += 1
                cases.append(
                    pytest.param(
                        conv, bn, add, relu, conv_first, id=f"{conv}-{bn}-{add}-{relu}-{'L' if conv_first else 'R'}"
                    )
                )
    return cases


@pytest.mark.parametrize(("conv", "bn", "add", "relu", "conv_first"), _combo_cases())
def test_every_seed_combination_fuses(conv: str, bn: str | None, add: str, relu: str, conv_first: bool) -> None:
    make_conv, make_bn, shape, stem = _CONVS[conv]
    bn_mod: nn.Module | None = None
    if bn == "bn":
        bn_mod = make_bn()
    elif bn == "sync":
        bn_mod = nn.SyncBatchNorm(4)
    model = randomize_bn(_Combo(make_conv(), bn_mod, add, relu, conv_first)).eval()
    fused = fuse_fx(model).eval()
    leaves = [m for m in fused.modules() if isinstance(m, FusedModule)]
    assert len(leaves) == 1, module_tree(fused)
    want = stem + ("6" if relu.endswith("6") else "") + ("" if conv == "Linear" else conv[-2:])
    assert type(leaves[0]).__name__ == want
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fused.modules())
    x, y = torch.randn(*shape), torch.randn(*_OUT[conv])
    torch.testing.assert_close(fused(x, y), model(x, y), rtol=1e-4, atol=1e-5)


def test_example_inputs_give_the_same_result() -> None:
    model = randomize_bn(ResNetish()).eval()
    x = torch.randn(2, 1, 8, 8)
    a, b = fuse_fx(model), fuse_fx(model, (x,))
    assert module_tree(a) == module_tree(b)
    torch.testing.assert_close(a.eval()(x), model(x), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# stable names


def test_generated_names_are_scoped_to_their_owner() -> None:
    fused = fuse_fx(ResNetish())
    names = {n for n, _ in fused.named_modules()}
    assert {"layer1.0._generated_add_0", "layer1.1._generated_add_0"} <= names
    assert "_generated_add_0" not in names  # no + at the root
    assert type(fused.get_submodule("layer1.0._generated_add_0")).__name__ == "ConvAddReLU2d"
    for consumed in ("layer1.0.conv2", "layer1.0.bn2", "layer1.0.relu2", "layer1.0.bn1", "layer1.0.relu1"):
        assert isinstance(fused.get_submodule(consumed), nn.Identity)
    assert type(fused.get_submodule("layer1.0.conv1")).__name__ == "ConvReLU2d"


class _TwoBlocks(nn.Module):
    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.a = Block(2)
        self.b = Block(2)
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if self.extra:
            x = x + x  # an unrelated edit at the root
        return self.b(x)


def test_editing_another_module_does_not_shift_names() -> None:
    plain = {n for n, _ in fuse_fx(_TwoBlocks(False)).named_modules() if n.rpartition(".")[2].startswith("_generated")}
    edited = {n for n, _ in fuse_fx(_TwoBlocks(True)).named_modules() if n.rpartition(".")[2].startswith("_generated")}
    assert plain == {"a._generated_add_0", "b._generated_add_0"}
    assert edited == plain | {"_generated_add_0"}


def test_fusing_twice_changes_nothing() -> None:
    once = fuse_fx(ResNetish())
    twice = fuse_fx(once)
    assert module_tree(twice) == module_tree(once)
    assert list(twice.state_dict()) == list(once.state_dict())


# ---------------------------------------------------------------------------------------------
# checkpoints


def test_float_checkpoint_loads_by_original_keys() -> None:
    trained = randomize_bn(ResNetish(), seed=3).eval()
    fresh = fuse_fx(ResNetish()).eval()
    result = fresh.load_state_dict(trained.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(fresh(x), trained(x), rtol=1e-4, atol=1e-5)


def test_fused_checkpoint_round_trips() -> None:
    a = fuse_fx(randomize_bn(ResNetish(), seed=1))
    b = fuse_fx(ResNetish())
    b.load_state_dict(a.state_dict())
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])


def test_untraceable_model_names_the_module() -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:
                return self.conv(x)
            return x

    with pytest.raises(Exception, match=r"qir\.utils\.fx_helper\.wrap"):
        fuse_fx(Bad())
