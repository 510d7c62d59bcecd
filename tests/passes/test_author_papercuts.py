"""Pass authors' papercuts: rewriter errors name their rule, `qir opt --no-verify` never prints
IR that does not parse, a non-attrs pass class cannot drop its options."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

import passes
from passes.base import PASS_REGISTRY
from passes.patterns import P
from passes.rewrite import RewriteError, Rule, apply_rewrites
from qir.cli.main import main
from qir.ir.graph import Graph
from qir.ir.ops.elementwise import Relu
from qir.ir.parser import parse_graph

IR = """graph @G(%x: tensor<1x4xf32>) {
  %r: tensor<1x4xf32> = relu(%x)
  return %r
}
"""


@pytest.fixture(autouse=True)
def forget_test_passes() -> Iterator[None]:
    yield
    for name, cls in list(PASS_REGISTRY.items()):
        if cls.__module__ == __name__:
            del PASS_REGISTRY[name]


def test_rewriter_error_names_the_rule() -> None:
    def explode(graph: Graph, m: Any) -> None:
        raise ValueError("bad weights")

    with pytest.raises(RewriteError, match=r"rule 'explode-relu' failed rewriting %r \(relu\) on @G: ValueError: bad"):
        apply_rewrites(parse_graph(IR), [Rule("explode-relu", P(Relu), explode)])

    with pytest.raises(RewriteError, match=r"rule 'junk' returned 3 for %r"):
        apply_rewrites(parse_graph(IR), [Rule("junk", P(Relu), lambda g, m: 3)])


def test_opt_no_verify_refuses_unparsable_result(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    @passes.register_pass
    class DanglingRename(passes.Pass):
        """Gives the relu the input's name: two definitions of %x (not IR)."""

        name: ClassVar[str] = "papercut-dangling"

        def apply(self, ctx: passes.PassContext, graph: Graph) -> bool:
            relu = next(n for n in graph.nodes if n.op.name == "relu")
            relu.name = "x"
            return True

    src = tmp_path / "g.qir"
    src.write_text(IR)
    code = main(["opt", str(src), "-p", "papercut-dangling", "--no-verify"])
    err = capsys.readouterr().err
    assert code == 1 and "--no-verify" in err and "does not parse back" in err, err
    code = main(["opt", str(src), "-p", "papercut-dangling"])
    err = capsys.readouterr().err
    assert code == 1 and "papercut-dangling" in err, err


def test_plain_pass_class_with_options_is_refused() -> None:
    with pytest.raises(ValueError, match=r"declares option\(s\) threshold but is not an attrs class.*@attrs\.frozen"):

        @passes.register_pass
        class Plain(passes.Pass):
            name: ClassVar[str] = "papercut-plain"
            threshold: int = 3

    assert "papercut-plain" not in PASS_REGISTRY


def test_in_place_constant_edit_is_caught_and_reported_truthfully() -> None:
    import torch

    from passes.errors import PassFailure
    from qir.frontend import trace

    @passes.register_pass
    class ScaleWeights(passes.Pass):
        """Doubles every weight in place (wrong: the tensors are shared with the input)."""

        name: ClassVar[str] = "papercut-scale-in-place"

        def apply(self, ctx: passes.PassContext, graph: Graph) -> bool:
            with torch.no_grad():
                for key, t in graph.constants.items():
                    if key.endswith("weight"):
                        t.mul_(2)
            return True

    @passes.register_pass
    class Explode(passes.Pass):
        name: ClassVar[str] = "papercut-explode"

        def apply(self, ctx: passes.PassContext, graph: Graph) -> bool:
            raise RuntimeError("boom")

    g = trace(torch.nn.Sequential(torch.nn.Linear(2, 2)).eval(), (torch.randn(1, 2),))
    with pytest.raises(PassFailure) as info:
        passes.run_pipeline(g, "papercut-scale-in-place")
    msg = str(info.value)
    assert "wrote into constant tensor(s) 0.weight in place" in msg and "graph.add_constant" in msg
    assert "constant tensor(s) 0.weight were modified in place" in msg
    assert "the input graph is untouched" not in msg
    # without verify_each nothing is checked, and the message does not claim the input is intact
    with pytest.raises(PassFailure) as info:
        passes.run_pipeline(g, "papercut-scale-in-place,papercut-explode", verify_each=False)
    assert "the input graph is untouched" not in str(info.value)
    assert "checked only with verify_each" in str(info.value)
