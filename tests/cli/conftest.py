"""Fixtures for the CLI tests: run ``qir.cli.main.main`` and capture what a user would see."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from cli_helpers import MODELS, Result

from qir.cli.main import main


@pytest.fixture
def qir(capsys: pytest.CaptureFixture[str]) -> Callable[..., Result]:
    def run(*argv: str) -> Result:
        code = main(list(argv))
        cap = capsys.readouterr()
        return Result(code, cap.out, cap.err)

    return run


@pytest.fixture
def model() -> Callable[[str], str]:
    """``model("tiny")`` -> the factory path of a model in tests/cli/models.py."""
    return lambda name: f"{MODELS}:{name}"
