"""IR tests run thousands of tiny kernels: one thread avoids oversubscription stalls."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    # tiny convolutions are ~100x slower when several busy processes share the cores
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
