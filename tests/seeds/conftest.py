"""Seed examples run as tests: they set the process-wide march, so each test restores it."""

from collections.abc import Iterator

import pytest
import torch

from qir.march import get_march, set_march


@pytest.fixture(autouse=True)
def restore_march() -> Iterator[None]:
    saved = get_march(None)
    torch.manual_seed(0)  # the seeds draw random data: the same every run
    try:
        yield
    finally:
        set_march(saved)
