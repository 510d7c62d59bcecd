"""Helpers for users: fx tracing control (``fx_helper.wrap``)."""
