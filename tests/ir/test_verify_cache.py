"""verify checks a bound constant's values once per tensor identity and version: a verify
after a pass that left the constant alone does not scan it again, and an in-place edit (which
bumps the tensor's version) is still caught, in a pipeline run in place too."""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest

import passes
from benchmarks.fuzz_ir import seed_texts
from passes.base import Pass, PassContext, register_pass
from passes.errors import PassVerificationFailure
from qir.ir import Graph, VerifyError, parse_graph, verify


def _vision() -> Graph:
    for name, text, constants in seed_texts():
        if name == "converted:vision:bayes":
            return parse_graph(text, constants={k: t.clone() for k, t in constants.items()})
    raise AssertionError("no converted:vision:bayes seed")


@register_pass
@attrs.frozen
class _EditShift(Pass):
    """Writes a shift of 99 into the first conv's shift tensor in place (the bug under test)."""

    name: ClassVar[str] = "test-edit-shift-in-place"

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        graph.constants["conv.shift"][0] = 99
        return True


def test_an_unchanged_constant_is_not_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = _vision()
    verify(graph)
    node = next(n for n in graph.nodes if n.scope == "conv" and n.op.name != "constant")
    calls: list[str] = []
    original = type(node.op).verify_values

    def counting(self: object, operand_types: object, values: object) -> None:
        calls.append(node.name)
        original(self, operand_types, values)  # type: ignore[arg-type]

    monkeypatch.setattr(type(node.op), "verify_values", counting)
    verify(graph)
    assert calls == []
    graph.constants["conv.shift"] = graph.constants["conv.shift"].clone()  # a new tensor: checked
    verify(graph)
    assert node.name in calls


def test_an_in_place_edit_is_caught_after_a_verify_that_passed() -> None:
    graph = _vision()
    verify(graph)
    graph.constants["conv.shift"][3] = 99
    with pytest.raises(VerifyError, match=r"%conv \(module conv\): op 'qconv': shift must hold integers in \[0, 62\]"):
        verify(graph)


def test_a_pass_editing_a_constant_in_place_is_caught_in_an_inplace_pipeline() -> None:
    graph = _vision()
    verify(graph)
    with pytest.raises(PassVerificationFailure, match="shift must hold integers in"):
        passes.run_pipeline(graph, "test-edit-shift-in-place", inplace=True)
    shared = _vision()  # on a copy, the constant guard names the edit first
    with pytest.raises(Exception, match=r"wrote into constant tensor\(s\) conv.shift in place"):
        passes.run_pipeline(shared, "test-edit-shift-in-place")
