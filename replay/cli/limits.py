"""Option values refused before any work: counts that would exhaust memory or overflow, and
numbers that are not numbers.  One line naming the option (and, for a count, what it
would need), exit 2 - as ``sweep`` does for grids (docs/outputs.md, "Limits refused up front")."""

from __future__ import annotations

import math

import click

from replay.errors import ReplayError

MAX_SEEDS = 10_000
"""``--seeds N``: each seed replays the whole grid once more, and every seed is held in memory
(a Python int and its list slot: 36 bytes) before the first one runs."""
SEED_BYTES = 36


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**40:,.1f} TiB" if n_bytes >= 2**40 else f"{n_bytes / 2**30:,.1f} GiB"


def check_seeds(text: str | None) -> None:
    """Refuse ``--seeds N`` above :data:`MAX_SEEDS` (10**12 ran out of memory building the seed
    list, 2**63 overflowed) before anything is read."""
    if text is None:
        return
    t = text.strip()
    if "," in t or not t.lstrip("+").isdigit():
        return              # a list (its seeds are checked one by one), or not a count: parse_seeds says
    n = int(t)
    if n > MAX_SEEDS:
        raise ReplayError(f"--seeds {t}: {n:,} seeds are more than {MAX_SEEDS:,} (the seed list alone would "
                          f"need {_gib(n * SEED_BYTES)}, and each seed replays the whole grid once more)")


def check_fleet_sizes(workers: list | None, dp_sizes: list | None) -> None:
    """``--workers`` and ``--dp-size`` values a simulated fleet can have: at least 1 (0 used to be
    blamed on the fleet file), dp_size at most the largest a trace may have."""
    from replay.simulate.fleet import dp_size_limit  # lazy: loaded when the command runs
    from replay.trace.base import MAX_DP_SIZE  # lazy: loaded when the command runs

    for flag, values in (("--workers", workers), ("--dp-size", dp_sizes)):
        for v in values or []:
            if v < 1:
                raise ReplayError(f"{flag}: {v} is out of range (>= 1)")
    for v in dp_sizes or []:
        if v > MAX_DP_SIZE:
            why = dp_size_limit(v, max(workers) if workers else None)
            raise ReplayError(f"--dp-size: {v:,} is too many ranks: {why}")


def finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """click callback: a float option must be a finite number (``nan`` passes click's ranges)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"must be a finite number, got {value}", ctx=ctx, param=param)
    return value


MAX_PORT = 65535

MAX_PAGE_SIZE = 2**31 - 1
"""``--page-size`` (import, record): the largest page_size a trace.json may hold (``MAX_INT32`` of
replay/trace/base.py, not imported here so that ``--help`` loads no trace code); 2**63 overflowed."""
MAX_TOKENS = 2**53
"""Token capacities (``import --kv-capacity-tokens``): a fleet file's limit (replay/simulate/fleet.py)."""
MAX_LAG_MS = 10**9
"""``import --index-lag-ms``: the limit of ``simulate --index-lag-ms`` (its nanoseconds fit int64)."""


def check_rank_ports(dp_size: int | None, bases: dict[str, int | None]) -> None:
    """``record``: rank ``r`` of an engine listens on ``base + r``; refuse port-base flags whose
    last rank would be past 65535 (before the previous recording is cleared)."""
    if not dp_size:
        return
    for flag, base in bases.items():
        if base is not None and base + dp_size - 1 > MAX_PORT:
            raise ReplayError(f"{flag} {base} with --dp-size {dp_size:,}: rank {dp_size - 1:,} would listen on "
                              f"port {base + dp_size - 1:,}, above {MAX_PORT}")
