"""Errors the CLI reports as a message and an exit code instead of a traceback."""

from __future__ import annotations

#: Exit codes of every subcommand.
EXIT_OK = 0
EXIT_USER_ERROR = 1
EXIT_ILLEGAL = 2


class UserError(Exception):
    """Bad input from the user: a missing file, a malformed pipeline, a bad option (exit 1)."""


class IllegalModel(Exception):
    """The model is not legal on the march (exit 2); the legality table is already printed."""
