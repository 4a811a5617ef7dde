"""The ``router-replay`` command line: thin click commands over the library.

:mod:`replay.cli.app` holds the group and the error handling every command
shares; each command lives in its own module here and is registered below,
explicitly, in the order ``--help`` lists them.
"""

from __future__ import annotations

from replay.cli import (
    calibrate,
    check,
    compare,
    generate,
    import_,
    recommend,
    record,
    report,
    simulate,
    sweep,
    validate,
)
from replay.cli.app import InputError, main, outputs_closed, user_errors

__all__ = ["InputError", "main", "outputs_closed", "user_errors"]

for _module in (calibrate, check, compare, generate, import_, recommend, record, report, simulate, sweep, validate):
    for _cmd in _module.COMMANDS:
        main.add_command(_cmd)
