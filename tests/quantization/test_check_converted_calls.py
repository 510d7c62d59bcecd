"""Every function convert_fx writes into a converted graph is checked against the table row of the
op it computes: none is reported as an unknown qir-internal call that escapes the row's rules."""

from __future__ import annotations

import ast
import importlib
import pathlib
import types
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.quantization import DeQuantStub, QuantStub

import qir
from passes.legality_facts import function_view
from qir.frontend.lookup import qualified_name
from qir.march import March, march_scope
from qir.quantization import check_model, compile_model, convert_fx, get_default_qat_qconfig, prepare_qat_fx

_QIR = pathlib.Path(qir.__file__).parent


def _installed_functions() -> Iterator[tuple[str, types.FunctionType]]:
    """qir functions the library's sources put into fx graphs: the first argument of a
    ``graph.call_function(...)``, a function assigned to a node's ``.target``, and, when that
    argument is a parameter of the enclosing helper (``_replace(g, n, fn, ...)``), what the
    module's calls of the helper pass for it."""
    for path in sorted(_QIR.rglob("*.py")):
        text = path.read_text()
        if "call_function" not in text and ".target =" not in text:
            continue  # imported only where a graph may be written
        module = importlib.import_module(".".join(path.relative_to(_QIR.parent).with_suffix("").parts))
        tree = ast.parse(text)
        exprs: list[ast.expr] = []
        helpers: dict[str, int] = {}  # helper name -> index of the parameter it installs
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = [a.arg for a in fn.args.args]
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                    if node.func.attr == "call_function":
                        first = node.args[0]
                        if isinstance(first, ast.Name) and first.id in params:
                            helpers[fn.name] = params.index(first.id)
                        exprs.append(first)
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr == "target" for t in node.targets
                ):
                    exprs.append(node.value)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in helpers:
                i = helpers[node.func.id]
                if len(node.args) > i:
                    exprs.append(node.args[i])
        for e in exprs:
            obj = getattr(module, e.id, None) if isinstance(e, ast.Name) else None
            if isinstance(obj, types.FunctionType) and obj.__module__.startswith("qir."):
                yield qualified_name(obj), obj


def test_every_function_convert_installs_has_a_legality_view() -> None:
    found = dict(_installed_functions())
    # the scan finds the integer forms it is known to write (a scan that finds nothing tests nothing)
    assert {
        "qir.quantization.code_ops.abs_codes",
        "qir.quantization.code_ops.clamp_codes",
        "qir.quantization.code_ops.compare_codes",
        "qir.quantization.convert.relu6_codes",
        "qir.quantization.convert.nearest_interpolate_codes",
    } <= set(found)
    missing = sorted(name for name in found if function_view(name) is None)
    assert not missing, (
        f"{missing} can be in a converted graph but check_model has no view for them: register one with "
        "passes.legality_facts.register_function_view (the op it computes, so its table row applies)"
    )


class _Resize(nn.Module):
    def __init__(self, mode: str, factor: float) -> None:
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.mode, self.factor = mode, factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dq(F.interpolate(self.q(x), scale_factor=self.factor, mode=self.mode))


def _converted(model: nn.Module, x: torch.Tensor) -> nn.Module:
    qat = prepare_qat_fx(model, {"": get_default_qat_qconfig()})
    qat(x)
    return convert_fx(qat.eval())


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_interpolate_scale_bound_applies_to_both_modes(mode: str) -> None:
    x = torch.rand(1, 1, 2, 2)
    with march_scope(March.BERNOULLI2):  # 1/256 <= scale <= 256
        model = _converted(_Resize(mode, 300), x)
        report = check_model(model, x)
        assert not report.ok and not report.unknown
        (v,) = report.violations
        assert v.spelling == "torch.nn.functional.interpolate" and v.actual == (300, 300)
        assert "qir.quantization.convert" not in str(report)  # the row's spelling, not qir's internal function
        with pytest.raises(Exception, match="not legal on bernoulli2"):
            compile_model(model, [x])


def test_legal_nearest_interpolate_passes_and_compiles() -> None:
    x = torch.rand(1, 2, 4, 4)
    with march_scope(March.BERNOULLI2):
        model = _converted(_Resize("nearest", 2), x)
        assert any(getattr(n.target, "__name__", "") == "nearest_interpolate_codes" for n in model.graph.nodes)
        report = check_model(model, x)
        assert report.ok and not report.unknown and report.checked == 3
        assert torch.equal(compile_model(model, [x])(x), model(x))
