"""Flow tests run under a march scope (per test, so tests stay independent), with a fixed torch seed."""

from collections.abc import Iterator

import pytest
import torch

from qir.march import March, march_scope


@pytest.fixture(autouse=True, params=[March.BAYES], ids=["bayes"])
def march(request: pytest.FixtureRequest) -> Iterator[March]:
    torch.manual_seed(0)  # random inputs and weights: the same every run
    with march_scope(request.param) as m:
        yield m
