"""A qadaptive_avg_pool2d whose scales its march cannot requantize (in_scale / out_scale over the
multiplier limit) is a VerifyError, not a graph that verifies and fails at its first run."""

from __future__ import annotations

import pytest
import torch

import qir.nn.quantized  # noqa: F401  (registers the integer modules verify probes)
from qir.ir import VerifyError, parse_graph, run_graph, verify

_TEXT = """graph @m(%x: tensor<2x16x8x8xqi8,scale=[{s_in}]>) {{
  %gap: tensor<2x16x1x1xqi8,scale=[0.0056]> = qadaptive_avg_pool2d(%x, out=QuantSpec(scale=(0.0056,)), \
in_scales=({s_in},), march="bayes") @gap
  return %gap
}}"""


def test_a_ratio_over_the_multiplier_limit_is_refused_by_verify() -> None:
    good = parse_graph(_TEXT.format(s_in=0.0227))
    verify(good)
    run_graph(good, torch.zeros(2, 16, 8, 8, dtype=torch.int8))
    bad = parse_graph(_TEXT.format(s_in=9.2e18))
    with pytest.raises(
        VerifyError, match=r"%gap \(module gap\): op 'qadaptive_avg_pool2d' fails .*exceeds the multiplier"
    ):
        verify(bad)
