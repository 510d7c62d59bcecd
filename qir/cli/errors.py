"""Errors the CLI reports as a message (exit code 1) instead of a traceback."""


class UserError(Exception):
    """Bad input from the user: a missing file, a malformed pipeline, a bad option."""
