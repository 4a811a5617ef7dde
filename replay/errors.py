"""Errors a user can cause.  The CLI turns each into one line and exit code 2."""

from __future__ import annotations


class ReplayError(Exception):
    """Base class: bad input or an impossible request.  ``str(err)`` is one line."""

    def cli_text(self) -> str:
        """The line the CLI prints (the same, unless the error names a parameter)."""
        return str(self)


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

    def cli_text(self) -> str:
        """The line the CLI prints: the flag in place of the parameter."""
        return f"{self.flag} {self.text}"


class _Named:
    """A parameter in a :class:`ParamsError` text: ``{name}`` or ``{name:METAVAR}``."""

    def __init__(self, name: str, sep: str):
        self.name, self.sep = name, sep

    def __format__(self, metavar: str) -> str:
        return self.name + (self.sep + metavar if metavar else "")


class ParamsError(ReplayError):
    """A bad combination of arguments, naming several parameters inside one sentence:
    ``text`` holds ``{param}`` or ``{param:METAVAR}`` fields (and ``{value}`` fields
    filled from ``values`` as they are).  The library reads
    ``param`` / ``param=METAVAR``; the CLI ``--param`` / ``--param METAVAR``.  A parameter
    whose flag is not ``--`` + its name with dashes is given as ``(param, flag)``."""

    def __init__(self, text: str, *params: str | tuple[str, str], **values: object):
        flags = dict(p if isinstance(p, tuple) else (p, "--" + p.replace("_", "-")) for p in params)
        super().__init__(text.format(**values, **{p: _Named(p, "=") for p in flags}))
        self.text, self.params, self.values, self.flags = text, tuple(flags), values, flags

    def cli_text(self) -> str:
        return self.text.format(**self.values, **{p: _Named(f, " ") for p, f in self.flags.items()})


class NeedsForce(ReplayError):
    """An output that exists and is replaced only when asked: the library's text says
    ``force=True``, the CLI's ``--force``, in the place between ``before`` and ``after``."""

    def __init__(self, before: str, after: str):
        super().__init__(f"{before}force=True{after}")
        self.before, self.after = before, after

    def cli_text(self) -> str:
        return f"{self.before}--force{self.after}"
