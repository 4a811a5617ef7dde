"""Errors a user can cause.  The CLI turns each into one line and exit code 2."""

from __future__ import annotations


class ReplayError(Exception):
    """Base class: bad input or an impossible request.  ``str(err)`` is one line."""


class ConfigError(ReplayError, ValueError):
    """An invalid knob value or grid (the router's own error text where it has one)."""
