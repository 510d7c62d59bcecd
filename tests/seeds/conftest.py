"""Seed examples run as tests: they set the process-wide march, so each test restores it."""

from collections.abc import Iterator

import pytest

from qir.march import get_march, set_march


@pytest.fixture(autouse=True)
def restore_march() -> Iterator[None]:
    saved = get_march(None)
    try:
        yield
    finally:
        set_march(saved)
