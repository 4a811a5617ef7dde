"""Errors a user can cause.  The CLI turns each into one line and exit code 2."""

from __future__ import annotations


class ReplayError(Exception):
    """Base class: bad input or an impossible request.  ``str(err)`` is one line."""


class ConfigError(ReplayError, ValueError):
    """An invalid knob value or grid (the router's own error text where it has one)."""


class ParamError(ReplayError):
    """A bad argument of a library call, named by its parameter (``seed must be ...``); the
    CLI names the flag instead (``--seed must be ...``): ``flag`` where it is not
    ``--`` + the parameter with dashes."""

    def __init__(self, param: str, text: str, *, flag: str | None = None):
        super().__init__(f"{param} {text}")
        self.param = param
        self.text = text
        self.flag = flag or "--" + param.replace("_", "-")
