"""Flow tests run under a march scope (per test, so tests stay independent)."""

from collections.abc import Iterator

import pytest

from qir.march import March, march_scope


@pytest.fixture(autouse=True, params=[March.BAYES], ids=["bayes"])
def march(request: pytest.FixtureRequest) -> Iterator[March]:
    with march_scope(request.param) as m:
        yield m
