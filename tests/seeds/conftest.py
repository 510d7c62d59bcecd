"""Seed examples run as tests (tests/conftest.py restores the march they set)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)  # the seeds draw random data: the same every run
