"""The ranking core every recommendation shares: which configs qualify, in which order.

Three questions rank configs: the open-loop ``recommend`` of a sweep (best hit rate
whose p99 queue at the chosen worker stays within a bound, per dp_size), the
closed-loop ``recommend`` of a simulator grid (best mean served hit rate among the
stable configs whose upper bound meets the bound), and the capacity plan (per traffic
level, the smallest fleet with a config under the bound).  Each reads its own table;
all three then do the same thing, done here once:

* :func:`rank` splits the rows into the qualifying ones, ordered best first, and the
  excluded ones by reason (no value, a named check failed, above the bound);
* :func:`router_flags` / :func:`deploy_flags` turn the chosen row into the router's
  command-line flags.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from replay.config import KNOB_NAMES, KNOBS, RouterConfig
from replay.runs.metrics import knob_text

UNKNOWN = "unknown"
OVER_BOUND = "over_bound"

VARIANT_NOTE = "not a router flag"
"""The words :func:`router_flags` puts in the flags of a config that needs a replay-only variant."""

NO_GATE_TEXT = "(router defaults: no gate)"


@dataclass
class Ranking:
    """The rows that qualify, best first, and the rest by reason.

    ``excluded`` keys, in order: each check's reason (as given to :func:`rank`), then
    ``over_bound``, then ``unknown``; every key present, lists in input order."""

    ranked: list[dict]
    excluded: dict[str, list[dict]]


def rank(rows: Iterable[dict], *, value: Callable[[dict], float | None], bound: float | None,
         order: Callable[[dict], Any], checks: Sequence[tuple[str, Callable[[dict], bool]]] = ()) -> Ranking:
    """Rank ``rows`` on a bounded metric.

    ``value(row)`` is the value the bound is checked on (None: unknown, the row is
    excluded as ``unknown``); ``checks`` are ``(reason, fails)`` pairs tried in order
    on a row with a value, the first that fails excludes it under its reason; then a
    value above ``bound`` (None: no bound) excludes it as ``over_bound``.  The rest
    qualify, sorted by ``order`` (a stable sort: equal keys keep the input order)."""
    excluded: dict[str, list[dict]] = {reason: [] for reason, _ in checks}
    excluded[OVER_BOUND] = []
    excluded[UNKNOWN] = []
    ok = []
    for r in rows:
        v = value(r)
        if v is None:
            excluded[UNKNOWN].append(r)
            continue
        failed = next((reason for reason, fails in checks if fails(r)), None)
        if failed is not None:
            excluded[failed].append(r)
        elif bound is not None and not v <= bound:  # NaN too
            excluded[OVER_BOUND].append(r)
        else:
            ok.append(r)
    ok.sort(key=order)
    return Ranking(ok, excluded)


def router_flags(row: dict) -> str:
    """The router command-line flags of a config row (the knobs that differ from the
    defaults), with a note when the config needs a replay-only policy variant."""
    cfg = RouterConfig(**{k: row[k] for k in KNOB_NAMES if k in row})
    parts = []
    for k, v in cfg.given_flags().items():
        spec = KNOBS[k]
        if spec.inverted:
            if v is False:
                parts.append(spec.flag)
        else:
            if k == "max_in_flight":  # the router takes the cap with the overloaded filter
                parts.append("--filter overloaded")
            parts.append(f"{spec.flag} {knob_text(v)}")
    text = " ".join(parts) if parts else NO_GATE_TEXT
    variants = [f"{KNOBS[k].flag} {v}" for k, v in cfg.variants().items()]
    if variants:  # not deployable: say so instead of printing a router command line that omits it
        text += f" [needs the replay-only policy variant {', '.join(variants)}: {VARIANT_NOTE}]"
    return text


def deploy_flags(row: dict | None) -> str | None:
    """A config row's flags as a router command line takes them ('' for the router's
    defaults); None when there is nothing to deploy (no row, or it needs a replay-only variant)."""
    if row is None:
        return None
    text = router_flags(row)
    if VARIANT_NOTE in text:
        return None
    return "" if text == NO_GATE_TEXT else text
