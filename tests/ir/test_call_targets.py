"""IR text cannot name arbitrary callables: ``call`` targets, methods and ``getattr`` go through an allowlist."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from qir.frontend import trace
from qir.ir import Graph, IRError, ParseError, TensorType, parse_graph, print_graph, run_graph
from qir.ir.call_targets import (
    lookup_call_target,
    method_allowed,
    register_call_method,
    register_call_target,
    unregister_call_target,
)
from qir.ir.op import Ref
from qir.ir.ops.core import Call
from qir.utils.fx_helper import wrap


def _call_text(target: str, kind: str = "function") -> str:
    return (
        "graph @m(%x: tensor<2xf32>) {\n"
        f'  %y: tensor<2xf32> = call(%x, kind="{kind}", target="{target}", args=(%x,))\n'
        "  return %y\n"
        "}"
    )


@pytest.fixture(autouse=True)
def no_process_escape(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail loudly if anything under test reaches the process-spawning functions."""

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"escaped: {args!r}")

    for mod, name in ((os, "system"), (os, "popen"), (subprocess, "run"), (subprocess, "Popen")):
        monkeypatch.setattr(mod, name, boom)
    yield


HOSTILE_FUNCTIONS = [
    "os.system",
    "posix.system",
    "subprocess.run",
    "subprocess.Popen",
    "builtins.eval",
    "builtins.exec",
    "builtins.__import__",
    "builtins.getattr",
    "builtins.open",
    "eval",
    "exec",
    "__import__",
    "getattr",
    "print",
    "importlib.import_module",
    "torch.os.system",  # attribute chains from torch reach os
    "torch.sys.modules",
    "torch.load",  # unpickling runs code
    "torch.save",
    "torch.from_file",
    "torch.hub.load",
    "torch.ops.load_library",
    "torch.utils.cpp_extension.load_inline",
    "torch.jit.load",
    "torch.compile",
    "torch.manual_seed",
    "torch.set_num_threads",
    "torch._C._get_tracing_state",
    "torch.__builtins__",
    "torch.__loader__.load_module",
    "torch.nn.functional.torch",  # a module re-exported by a namespace
    "torch.nn.functional.importlib",
    "torch.functional.torch.load",
    "torch._C._nn.__class__",
    "torch.Tensor.numpy",
    "torch.Tensor.untyped_storage",
    "torch.Tensor.register_hook",
    "torch.Tensor.__reduce_ex__",
    "operator.attrgetter",
    "operator.methodcaller",
    "operator.call",
    "operator.__builtins__",
    "math.__loader__",
    "",
    ".",
    "torch.",
    "torch..flatten",
    "torch.flatten.__globals__",
    "torch.flatten\x00",
]


@pytest.mark.parametrize("target", HOSTILE_FUNCTIONS)
def test_hostile_function_targets_are_parse_errors(target: str) -> None:
    with pytest.raises(ParseError) as e:
        parse_graph(_call_text(target.replace("\x00", "\\x00")))
    assert e.value.line == 2
    if target != "torch.flatten\x00":
        assert e.value.column == _call_text(target).splitlines()[1].index('target="') + len("target=") + 1
        assert "register_call_target" in e.value.reason


HOSTILE_METHODS = [
    "__class__",
    "__reduce_ex__",
    "__getattribute__",
    "_version",
    "numpy",
    "untyped_storage",
    "storage",
    "share_memory_",
    "register_hook",
    "apply_",
    "set_",
    "tofile",
    "from_file",
    "system",
    "load",
]


@pytest.mark.parametrize("name", HOSTILE_METHODS)
def test_hostile_methods_are_parse_errors(name: str) -> None:
    with pytest.raises(ParseError, match=r"<text>:2:\d+: method .* is not allowed.*register_call_method"):
        parse_graph(_call_text(name, kind="method"))


@pytest.mark.parametrize("attr", ["__class__", "__globals__", "__dict__", "_cdata", "untyped_storage", "storage"])
def test_getattr_of_private_or_storage_attributes_is_a_parse_error(attr: str) -> None:
    text = f'graph @m(%x: tensor<2xf32>) {{\n  %y: !object = getattr(%x, attr="{attr}")\n  return %y\n}}'
    with pytest.raises(ParseError, match=rf"<text>:2:\d+: attribute '{attr}' cannot be read from IR text"):
        parse_graph(text)


def test_dunder_chain_to_builtins_is_refused_at_its_first_step() -> None:
    # the classic escape: x.__class__.__init__.__globals__["__builtins__"]["eval"](...)
    text = (
        "graph @m(%x: tensor<2xf32>) {\n"
        '  %c: !object = getattr(%x, attr="shape")\n'
        '  %d: !object = getattr(%c, attr="__class__")\n'
        "  return %d\n"
        "}"
    )
    with pytest.raises(ParseError, match="<text>:3:"):
        parse_graph(text)


@pytest.mark.parametrize(
    "target",
    [
        "torch.flatten",
        "torch.relu",
        "torch.cat",
        "torch.zeros_like",
        "torch.nn.functional.relu",
        "torch.nn.functional.interpolate",
        "torch.functional.split",  # torch.fx's name for torch.split
        "torch._C._linalg.linalg_norm",  # torch.fx's name for torch.linalg.norm
        "torch.linalg.norm",
        "torch.special.erf",
        "torch.Tensor.add",
        "_operator.add",  # torch.fx's name for operator.add
        "operator.mul",
        "math.sqrt",
    ],
)
def test_tensor_operations_are_allowed(target: str) -> None:
    assert lookup_call_target(target) is not None
    parse_graph(_call_text(target))


def test_allowed_targets_resolve_to_the_real_functions() -> None:
    assert lookup_call_target("torch.flatten") is torch.flatten
    assert lookup_call_target("torch.nn.functional.relu") is torch.nn.functional.relu
    assert lookup_call_target("torch._C._linalg.linalg_norm") is torch.linalg.norm
    assert method_allowed("transpose") and method_allowed("size") and not method_allowed("numpy")


def test_run_graph_refuses_a_target_built_in_memory() -> None:
    # Graphs built by code (not parsed) resolve through the same allowlist when run.
    g = Graph("m")
    x = g.add_input("x", TensorType((2,)))
    g.set_output(g.add_node(Call(kind="function", target="os.system", args=("echo pwned",)), [], TensorType((2,))))
    with pytest.raises(IRError, match=r"'os\.system' is not allowed"):
        run_graph(g, torch.zeros(2))
    del x


def test_parsed_allowed_call_runs() -> None:
    g = parse_graph(_call_text("torch.neg"))
    x = torch.tensor([1.0, -2.0])
    assert torch.equal(run_graph(g, x), -x)


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_registered_target_parses_and_runs() -> None:
    name = f"{__name__}._double"
    with pytest.raises(ParseError, match=rf"register_call_target\(fn, '{name}'\)"):
        parse_graph(_call_text(name))
    register_call_target(_double)
    try:
        g = parse_graph(_call_text(name))
        assert torch.equal(run_graph(g, torch.ones(2)), torch.full((2,), 2.0))
    finally:
        unregister_call_target(name)
    with pytest.raises(ParseError):
        parse_graph(_call_text(name))


def test_objects_given_to_the_parser_allow_their_keys() -> None:
    g = parse_graph(_call_text("my.helper"), objects={"my.helper": _double})
    assert torch.equal(run_graph(g, torch.ones(2)), torch.full((2,), 2.0))


def test_registration_rules() -> None:
    with pytest.raises(TypeError, match="not callable"):
        register_call_target(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dotted identifier"):
        register_call_target(_double, "a..b")
    register_call_target(_double, "tests.twice")
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_call_target(print, "tests.twice")
    finally:
        unregister_call_target("tests.twice")
    with pytest.raises(ValueError, match="no leading '_'"):
        register_call_method("__call__")
    register_call_method("boxes")
    assert method_allowed("boxes")


@wrap
def _opaque_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 3


class _Net(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.flatten(x, 1).transpose(0, 1)
        return _opaque_scale(torch.nn.functional.relu(y))


def test_front_end_graph_round_trips_through_text() -> None:
    x = torch.randn(2, 3, 2)
    g = trace(_Net(), (x,))
    text = print_graph(g)
    key = next(n.op.target for n in g.nodes if isinstance(n.op, Call) and n.op.kind == "function")
    # the user's own function is not on the allowlist: the text alone cannot run it
    with pytest.raises(ParseError, match="register_call_target"):
        parse_graph(text, g.constants)
    parsed = parse_graph(text, g.constants, g.objects)
    assert torch.equal(run_graph(parsed, x), _Net()(x))
    register_call_target(g.objects[key], key)
    try:
        assert torch.equal(run_graph(parse_graph(text, g.constants), x), _Net()(x))
    finally:
        unregister_call_target(key)


def test_torch_attribute_values_do_not_import_submodules() -> None:
    text = "graph @m(%x: tensor<2xf32>) {\n  %y = cast(%x, dtype=torch.onnx)\n  return %y\n}"
    with pytest.raises(ParseError, match=r"torch\.onnx is not a torch dtype"):
        parse_graph(text)


def test_ref_kwargs_in_allowed_calls_still_work() -> None:
    g = Graph("m")
    x = g.add_input("x", TensorType((2, 3)))
    g.set_output(
        g.add_node(
            Call(kind="function", target="torch.flatten", args=(Ref(0),), kwargs={"start_dim": 0}),
            [x],
            TensorType((6,)),
        )
    )
    parsed = parse_graph(print_graph(g))
    assert run_graph(parsed, torch.ones(2, 3)).shape == (6,)
