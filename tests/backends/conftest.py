"""Fixtures shared by the artifact tests: ``good`` (a real compiled file, decoded) and ``forge``."""

from artifact_forge import forge, good

__all__ = ["forge", "good"]
