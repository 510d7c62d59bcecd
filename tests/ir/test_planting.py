"""planted_graphs: the pattern under test is in most drawn graphs; near misses never match."""

from __future__ import annotations

import operator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

from passes.patterns import P, find_all
from qir.ir import verify
from qir.testing import assert_preserves_semantics, graphs
from qir.testing.planting import NEAR_MISSES, planted_graphs

PATTERNS = [
    (nn.ReLU, (operator.add, nn.Conv2d, P.any())),
    (nn.BatchNorm2d, nn.Conv2d),
    (operator.mul, nn.Linear),
    (torch.cat,),
    (torch.matmul, nn.MaxPool2d),
    (nn.ReLU, nn.AvgPool2d),
]
FAST = settings(max_examples=40, database=None, deadline=None, suppress_health_check=list(HealthCheck))


def share_matching(pattern: object, **kwargs: object) -> float:
    hits: list[bool] = []

    @FAST
    @given(planted_graphs(pattern, **kwargs))
    def draw(g: object) -> None:
        verify(g)  # type: ignore[arg-type]
        hits.append(bool(find_all(pattern, g)))  # type: ignore[arg-type]

    draw()
    return sum(hits) / len(hits)


IDS = ["relu-add-conv", "bn-conv", "mul-linear", "cat", "matmul-maxpool", "relu-avgpool"]


@pytest.mark.parametrize("pattern", PATTERNS, ids=IDS)
def test_planted_pattern_is_in_most_graphs(pattern: object) -> None:
    assert share_matching(pattern) >= 0.5


@pytest.mark.parametrize("miss", NEAR_MISSES)
def test_near_misses_do_not_match(miss: str) -> None:
    # context of relus only, so nothing but the planted (broken) instance could match
    assert share_matching(PATTERNS[0], near_miss=miss, context_ops=("relu",)) == 0.0
    assert share_matching(PATTERNS[2], near_miss=miss, context_ops=("relu",)) == 0.0


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_bad_near_miss_is_named() -> None:
    with pytest.raises(ValueError, match="has no position for a 'extra_use' near miss"):
        planted_graphs((torch.cat,), near_miss="extra_use").example()


@FAST
@given(graphs(ops=("linear", "mul", "cat", "matmul", "max_pool2d", "avg_pool2d", "relu"), max_nodes=6))
def test_graphs_generates_the_new_ops(g: object) -> None:
    verify(g)  # type: ignore[arg-type]
    assert_preserves_semantics("dce", g)  # type: ignore[arg-type]
