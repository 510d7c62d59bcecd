"""200 cases of the IR text mutation fuzzer (benchmarks/fuzz_ir.py): every mutated text is a
ParseError, a VerifyError, or a graph that runs; nothing else, and no huge allocation."""

from __future__ import annotations

import pytest

from benchmarks import fuzz_ir
from benchmarks.fuzz_ir import OK_CLASSES, fuzz, run_case, seed_texts, table


def test_seeds_are_real_graphs_that_run() -> None:
    names = [n for n, _, _ in seed_texts()]
    assert any(n.startswith("golden:") for n in names) and any(n.startswith("frontend:") for n in names)
    assert len(names) >= 8


def test_two_hundred_mutations_find_no_bug() -> None:
    result = fuzz(200, seed=20261125, mem_bytes=2 * 2**30, timeout=10.0)
    assert sum(result["counts"].values()) == 200
    assert result["counts"].get("ran", 0) > 0 and result["counts"].get("parse-error", 0) > 0
    assert result["bugs"] == 0, table(result)


def test_bug_classes_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    bad_bias = (
        "graph @m(%x: tensor<1x3x4x4xf32>) {\n"
        '  %w: tensor<4x3x3x3xf32> = constant(key="w")\n'
        '  %b: tensor<3xf32> = constant(key="b")\n'
        "  %y: tensor<1x4x2x2xf32> = conv2d(%x, %w, %b)\n"
        "  return %y\n}"
    )
    assert run_case(bad_bias, 0)[0] == "verify-error"
    assert run_case("graph @m(%x: tensor<2xf32>) {\n  return %x", 0)[0] == "parse-error"
    # without the verifier the same text is the bug class the fuzzer exists to find
    monkeypatch.setattr(fuzz_ir, "verify", lambda graph: None)
    outcome, detail = run_case(bad_bias, 0)
    assert outcome == "verified-but-run-failed: conv2d: RuntimeError" and outcome not in OK_CLASSES
    assert "bias" in detail


@pytest.mark.parametrize(("repeats", "outcome"), [(False, "ran"), (True, "timeout in verify")])
def test_a_timeout_counts_only_when_it_repeats(monkeypatch: pytest.MonkeyPatch, repeats: bool, outcome: str) -> None:
    """Cases are deterministic: a hang times out again, a stall of a loaded machine does not. The
    retry's outcome counts and the stall is reported."""
    seed_texts()  # the seeds are checked with the real run_case (cached)
    calls: list[int] = []

    def stalling(text: str, seed: int, *args: object, **kwargs: object) -> tuple[str, str]:
        calls.append(seed)
        if len(calls) == 1 or (repeats and len(calls) == 2):
            return "timeout in verify", ""
        return "ran", ""

    monkeypatch.setattr(fuzz_ir, "run_case", stalling)
    result = fuzz(1, seed=3, timeout=5.0)
    assert calls == [3, 3] and result["counts"] == {outcome: 1}
    assert result["bugs"] == (1 if repeats else 0)
    assert result["timeouts_not_repeated"] == (0 if repeats else 1)
    assert ("within it when run again" in table(result)) is not repeats


def test_unknown_input_dimensions_take_the_seeds_sizes() -> None:
    text = (
        "graph @m(%x: tensor<?x3x?xf32>) {\n"
        '  %w: tensor<2x12xf32> = constant(key="w")\n'
        "  %f: tensor<?x12xf32> = flatten(%x, start_dim=1)\n"
        "  %y: tensor<?x2xf32> = linear(%f, %w, bias=False)\n"
        "  return %y\n}"
    )
    assert run_case(text, 0, shapes={"x": (2, 3, 4)})[0] == "ran"
    # at another size the declared 12 features are wrong: the run fails, which is why the seed's sizes are used
    assert run_case(text, 0, shapes={"x": (2, 3, 5)})[0].startswith("verified-but-run-failed")
    mutated = fuzz_ir._mutate_once("graph @m(%x: tensor<1x3xf32>) {\n  return %x\n}", _KindRng(18), [])
    assert "?" in mutated


class _KindRng(fuzz_ir.random.Random):
    """A Random whose first randrange picks the mutation kind given."""

    def __init__(self, kind: int) -> None:
        super().__init__(0)
        self.kind: int | None = kind

    def randrange(self, *args: object, **kwargs: object) -> int:  # type: ignore[override]
        if self.kind is not None:
            kind, self.kind = self.kind, None
            return kind
        return super().randrange(*args, **kwargs)  # type: ignore[arg-type]
