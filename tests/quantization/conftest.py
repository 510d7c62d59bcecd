"""Markers of the quantization tests."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ddp: multi-process torch.distributed (gloo, CPU) tests; a few seconds")
