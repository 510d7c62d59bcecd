"""Shared test configuration: hypothesis profiles and the torchvision marker."""

import os

from hypothesis import HealthCheck, settings

# CI: 200 examples per property, derandomized so a green run stays green on the next
# machine; the "dev" profile (and `--hypothesis-seed`) keeps exploring new examples locally.
settings.register_profile(
    "ci", max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Two xdist workers on two cores: one intra-op thread each avoids oversubscription,
# which makes tiny torch kernels hundreds of times slower when threads spin.
import torch  # noqa: E402

torch.set_num_threads(1)


from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from qir.march import get_march, set_march  # noqa: E402


@pytest.fixture(autouse=True)
def restore_march() -> Iterator[None]:
    """Code written like the seeds calls ``set_march``: no test leaks its march into the next."""
    saved = get_march(None)
    try:
        yield
    finally:
        set_march(saved)
