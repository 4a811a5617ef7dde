"""Router configuration: one point (``RouterConfig``) and a grid of them.

``RouterConfig`` mirrors the router's ``AffinityConfig`` knobs that decide a
prefill route (ROUTER_SEMANTICS.md section 6), under the router's own flag
names with underscores.  Defaults are ``AffinityConfig::default()``.

Validation follows the router's ``Cli::into_config`` (section 6):
:func:`validate_router_flags` emulates every check that a knob value can reach,
in the router's order and with the router's exact error text, and
:meth:`RouterConfig.validate` applies it to one config.

Value specs (``--worker-queue-limit none,1..4,8``) are parsed by
:func:`parse_values`; a :class:`Grid` is the cartesian product of per-knob
value lists in a fixed, canonical order, with the combinations the router would
refuse skipped and recorded with the router's text.
"""

from __future__ import annotations

import itertools
import math
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import numpy as np

from replay.errors import ConfigError


@dataclass(frozen=True)
class RouterConfig:
    """One router configuration (defaults = the router's ``AffinityConfig::default()``).

    Constructing one does not validate it (the router's unit-test proposal
    defaults, :meth:`proposal_default`, are not a valid CLI config); call
    :meth:`validate` for the router's CLI checks.
    """

    worker_queue_limit: int | None = None
    saturation_queue_floor: int | None = None
    min_load_choices: int = 2
    cache_switch_margin_tokens: int = 1024
    pressure_guard: bool = True
    pressure_abs_threshold_tokens: int = 1024
    pressure_abs_threshold_ms: float | None = None
    pressure_rel_threshold: float = 1.5
    cache_affinity_min_matched_tokens: int | None = 1024
    cache_affinity_min_match_ratio: float | None = None
    cache_candidate_min_workers: int = 8
    cache_candidate_ratio: float = 0.05
    cache_candidate_max_workers: int = 32
    # the routing engine (ROUTER_REORG.md section 1): legacy ladder or the opt-in reorg
    # engine, its load-only draw size and its one hard admission cap (--filter overloaded)
    chat_routing: str = "legacy"
    power_of_n_choices: int | None = None
    max_in_flight: int | None = None
    # replay-only policy variants (docs/replay-model.md): not router
    # flags, never in given_flags(); the defaults are the router's behaviour
    variant_pin_order: str = "pressure"
    variant_floor_scaling: str = "fleet"
    variant_reorg_ranking: str = "power-of-n"

    @classmethod
    def proposal_default(cls, **overrides) -> RouterConfig:
        """The knobs of ``CacheCandidateProposal::default()`` used by the router's
        direct resolver unit tests: margin 0, guard off, abs 0, ms None, rel 0.0."""
        base: dict[str, Any] = dict(
            cache_switch_margin_tokens=0,
            pressure_guard=False,
            pressure_abs_threshold_tokens=0,
            pressure_abs_threshold_ms=None,
            pressure_rel_threshold=0.0,
        )
        base.update(overrides)
        return cls(**base)

    def as_dict(self) -> dict:
        """The knobs as ``{knob_name: value}`` in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def given_flags(self) -> dict:
        """The knobs that differ from ``AffinityConfig::default()``.

        This is the command line that would produce this config: a knob left
        at its default is read as "flag not given".  (The router cannot tell
        a default value given explicitly from an absent flag only for the
        policy checks, which matter only for ``policy != cache_aware``.)
        """
        return {k: v for k, v in self.as_dict().items()
                if KNOBS[k].router and not _same_value(v, _DEFAULTS[k])}

    def variants(self) -> dict:
        """The replay-only policy variants (``variant_*`` knobs) that differ from the router's behaviour."""
        return {k: v for k, v in self.as_dict().items()
                if not KNOBS[k].router and not _same_value(v, _DEFAULTS[k])}

    def validate(self, policy: str = "cache_aware") -> RouterConfig:
        """Raise :class:`ConfigError` with the router's exact text if the router
        would refuse this config under ``--policy policy``; return ``self``.

        The flags given are :meth:`given_flags` (knobs that differ from the
        defaults); see :func:`validate_router_flags` for the checks and order.
        """
        validate_router_flags(self.given_flags(), policy)
        validate_variants(self.as_dict())
        return self


KNOB_NAMES: tuple[str, ...] = tuple(f.name for f in fields(RouterConfig))
"""The knobs in ``RouterConfig`` field order: the grid's fixed product order."""

_DEFAULTS: dict[str, Any] = RouterConfig().as_dict()


# --------------------------------------------------------------------------------------
# Knob table


class KnobSpec(NamedTuple):
    """One grid knob: its field name, the router's flag, value kind and nullability.

    ``kind`` is ``"int"``, ``"float"``, ``"bool"`` or ``"choice"`` (one of
    ``choices``, the first being the default).  ``nullable`` means the
    router allows the knob unset (``none`` in a value spec).  ``inverted`` is
    true for ``pressure_guard``, whose flag is ``--disable-pressure-guard``:
    a flag value ``true`` means ``pressure_guard=False``.  ``router`` is false
    for the replay-only policy variants (``variant_*``): swept like any knob,
    but not a router flag (never in a router command line, not validated by
    the router's checks).

    Adding a knob: a ``RouterConfig`` field and a row here; the kernels read it
    as ``knobs.<name>[c]`` (``replay/kernels/layout.py`` says how).
    """

    name: str
    flag: str
    kind: str
    nullable: bool
    inverted: bool = False
    choices: tuple[str, ...] = ()
    router: bool = True


KNOBS: dict[str, KnobSpec] = {
    s.name: s
    for s in (
        KnobSpec("worker_queue_limit", "--worker-queue-limit", "int", True),
        KnobSpec("saturation_queue_floor", "--saturation-queue-floor", "int", True),
        KnobSpec("min_load_choices", "--min-load-choices", "int", False),
        KnobSpec("cache_switch_margin_tokens", "--cache-switch-margin-tokens", "int", False),
        KnobSpec("pressure_guard", "--disable-pressure-guard", "bool", False, inverted=True),
        KnobSpec("pressure_abs_threshold_tokens", "--pressure-abs-threshold-tokens", "int", False),
        KnobSpec("pressure_abs_threshold_ms", "--pressure-abs-threshold-ms", "float", True),
        KnobSpec("pressure_rel_threshold", "--pressure-rel-threshold", "float", False),
        KnobSpec("cache_affinity_min_matched_tokens", "--cache-affinity-min-matched-tokens", "int", True),
        KnobSpec("cache_affinity_min_match_ratio", "--cache-affinity-min-match-ratio", "float", True),
        KnobSpec("cache_candidate_min_workers", "--cache-candidate-min-workers", "int", False),
        KnobSpec("cache_candidate_ratio", "--cache-candidate-ratio", "float", False),
        KnobSpec("cache_candidate_max_workers", "--cache-candidate-max-workers", "int", False),
        KnobSpec("chat_routing", "--chat-routing", "choice", False, choices=("legacy", "reorg")),
        KnobSpec("power_of_n_choices", "--power-of-n-choices", "int", True),
        KnobSpec("max_in_flight", "--max-in-flight", "int", True),
        KnobSpec("variant_pin_order", "--pin-order", "choice", False,
                 choices=("pressure", "locality"), router=False),
        KnobSpec("variant_floor_scaling", "--floor-scaling", "choice", False,
                 choices=("fleet", "per-worker"), router=False),
        KnobSpec("variant_reorg_ranking", "--reorg-ranking", "choice", False,
                 choices=("power-of-n", "power-of-n-fold", "power-of-two"), router=False),
    )
}
"""Every knob by field name, in ``KNOB_NAMES`` order."""

FLAG_TO_KNOB: dict[str, str] = {s.flag: s.name for s in KNOBS.values()}
"""The router's flag name (``--worker-queue-limit``) -> knob name."""

assert tuple(KNOBS) == KNOB_NAMES

KNOB_SHORT: dict[str, str] = {"worker_queue_limit": "limit", "saturation_queue_floor": "floor"}
"""The short names tables and labels give the two queue-gate knobs (``limit=2 floor=none``)."""

GATE_KNOBS: tuple[str, ...] = tuple(KNOB_SHORT)
"""The queue-gate knobs: a config with both unset is the no-gate config."""


def knob_spec(name: str) -> KnobSpec:
    """The :class:`KnobSpec` for a knob name or router flag name (``--x-y``, ``x-y`` or ``x_y``)."""
    if name in KNOBS:
        return KNOBS[name]
    flag = name if name.startswith("--") else "--" + name.replace("_", "-")
    if flag in FLAG_TO_KNOB:
        return KNOBS[FLAG_TO_KNOB[flag]]
    raise ConfigError(f"unknown router knob {name!r}; known: {', '.join(s.flag for s in KNOBS.values())}")


# --------------------------------------------------------------------------------------
# The router's CLI checks (ROUTER_SEMANTICS.md section 6)

AFFINITY_POLICIES: frozenset[str] = frozenset({"session_aware", "cache_aware"})
"""Policies that build an ``AffinityConfig`` (pressure guard and section-6 item-8 checks)."""

_CACHE_CANDIDATE_FLAGS = (
    "cache_affinity_min_matched_tokens",
    "cache_affinity_min_match_ratio",
    "cache_candidate_min_workers",
    "cache_candidate_ratio",
    "cache_candidate_max_workers",
    "cache_switch_margin_tokens",
    "worker_queue_limit",
    "saturation_queue_floor",
    "min_load_choices",
)
_PRESSURE_TUNING_FLAGS = (
    "pressure_abs_threshold_tokens",
    "pressure_abs_threshold_ms",
    "pressure_rel_threshold",
)


def _finite(x: float) -> bool:
    return math.isfinite(x)


def validate_router_flags(args: Mapping[str, Any], policy: str = "cache_aware") -> None:
    """Emulate the router's ``Cli::into_config`` checks reachable from knob values.

    ``args`` maps knob name -> value for each flag *given* on the command line
    (an absent key = flag not given; ``None`` for a nullable knob = not set).
    ``pressure_guard: False`` stands for ``--disable-pressure-guard`` (a
    ``True`` value is no flag).  Raises :class:`ConfigError` with the router's
    exact text of the first failing check, in the router's order:

    1. ``--worker-queue-limit 0``; 2. floor without limit; 3. floor 0;
    4. floor > limit; 5. ``--min-load-choices 0`` (value checks, any policy);
    6. cache candidate tuning flags with ``policy != cache_aware``;
    ``--disable-pressure-guard`` outside the affinity policies; 7. pressure
    tuning flags outside the affinity policies; 8. (affinity policies only)
    rel threshold, abs ms, min match ratio, candidate ratio, min/max workers,
    evaluated on the resulting config (flags over defaults).

    Unknown keys raise :class:`ConfigError`.
    """
    for key in args:
        if key not in KNOBS:
            raise ConfigError(f"unknown router knob {key!r}")
    args = {k: v for k, v in args.items() if KNOBS[k].router}
    given = {k: v for k, v in args.items() if not (k == "pressure_guard" and v)}
    limit = args.get("worker_queue_limit")
    floor = args.get("saturation_queue_floor")
    mlc = args.get("min_load_choices")
    reorg = args.get("chat_routing", "legacy") == "reorg"

    # ROUTER_REORG.md 1.1: --power-of-n-choices is a NonZero integer (a parse error,
    # clap's text), then 1.2 item 1, checked before the legacy builders.
    pon = args.get("power_of_n_choices")
    if pon is not None and pon == 0:
        raise ConfigError(
            "invalid value '0' for '--power-of-n-choices <N>': number would be zero for non-zero type")
    if pon is not None and not reorg:
        raise ConfigError("--power-of-n-choices requires --chat-routing reorg")
    # REPLAY CHOICE: legacy's --filter overloaded --max-in-flight eligibility filter is
    # not modelled (ROUTER_REORG.md section 6 row 20); under reorg it is the
    # in-flight admission cap.  Not a router refusal: the replay's own.
    if args.get("max_in_flight") is not None and not reorg:
        raise ConfigError("the replay models --max-in-flight only under --chat-routing reorg "
                          "(legacy's overloaded filter is not modelled)")

    # 1-5: value checks, before any policy check.
    if limit is not None and limit == 0:
        raise ConfigError("--worker-queue-limit must be at least 1")
    if floor is not None:
        if limit is None:
            raise ConfigError(
                "--saturation-queue-floor requires --worker-queue-limit "
                "(there is no diversion to cancel without it)"
            )
        if floor == 0:
            raise ConfigError("--saturation-queue-floor must be at least 1")
        if floor > limit:
            raise ConfigError(
                f"--saturation-queue-floor ({floor}) must be at most --worker-queue-limit ({limit})"
            )
    if mlc is not None and mlc == 0:
        raise ConfigError("--min-load-choices must be at least 1")

    # 6-7: policy checks.
    if policy != "cache_aware" and any(k in given for k in _CACHE_CANDIDATE_FLAGS):
        raise ConfigError("cache candidate tuning flags require --policy cache_aware")
    affinity = policy in AFFINITY_POLICIES
    if not affinity and "pressure_guard" in given:
        raise ConfigError("--disable-pressure-guard requires --policy session_aware or cache_aware")
    if not affinity and any(k in given for k in _PRESSURE_TUNING_FLAGS):
        raise ConfigError("pressure guard tuning requires --policy session_aware or cache_aware")
    if not affinity:
        return

    # 8: AffinityConfig value checks on the resulting config.
    eff = dict(_DEFAULTS)
    eff.update(args)
    rel = eff["pressure_rel_threshold"]
    if not (_finite(rel) and rel > 1.0):
        raise ConfigError("--pressure-rel-threshold must be finite and greater than 1")
    ms = eff["pressure_abs_threshold_ms"]
    if ms is not None and not (_finite(ms) and ms >= 0.0):
        raise ConfigError("--pressure-abs-threshold-ms must be finite and non-negative")
    ratio = eff["cache_affinity_min_match_ratio"]
    if ratio is not None and not (_finite(ratio) and 0.0 <= ratio <= 1.0):
        raise ConfigError("--cache-affinity-min-match-ratio must be finite and in [0, 1]")
    cratio = eff["cache_candidate_ratio"]
    if not (_finite(cratio) and 0.0 <= cratio <= 1.0):
        raise ConfigError("--cache-candidate-ratio must be finite and in [0, 1]")
    lo, hi = eff["cache_candidate_min_workers"], eff["cache_candidate_max_workers"]
    if not (lo >= 1 and hi >= 1 and lo <= hi):
        raise ConfigError(
            "--cache-candidate-min-workers and --cache-candidate-max-workers "
            "must be positive and min must not exceed max"
        )

    # ROUTER_REORG.md 1.2 item 5: policies_reorg::factory::validate, after every
    # legacy builder (the replay's policy is cache_aware: 5.1-5.4 cannot fail).
    if reorg and eff["min_load_choices"] != 2:
        raise ConfigError("reorg cache fallback requires --min-load-choices 2")


_LEGACY_VARIANTS = ("variant_pin_order", "variant_floor_scaling")
_REORG_VARIANTS = ("variant_reorg_ranking",)


def validate_variants(knobs: Mapping[str, Any]) -> None:
    """The replay's own refusals of the replay-only variants (not router text):
    a variant applies to one routing engine only, and the power-of-two revision
    (ROUTER_REORG.md section 0, A1) has no ``--power-of-n-choices``."""
    routing = knobs.get("chat_routing", "legacy")
    other = _LEGACY_VARIANTS if routing == "reorg" else _REORG_VARIANTS
    for k in other:
        if k in knobs and not _same_value(knobs[k], _DEFAULTS[k]):
            raise ConfigError(f"the replay-only variant {KNOBS[k].flag} does not apply to "
                              f"--chat-routing {routing}")
    if knobs.get("variant_reorg_ranking") == "power-of-two" and knobs.get("power_of_n_choices") is not None:
        raise ConfigError("--power-of-n-choices does not exist in the power-of-two revision "
                          "(--reorg-ranking power-of-two)")


def parse_router_command_line(text: str, option: str = "--router-flags") -> dict[str, Any]:
    """The knob flags of a production router's command line, as ``{knob: value}`` (knob sense).

    ``text`` is what was passed to the router, e.g. ``"--worker-queue-limit 8
    --saturation-queue-floor 2 --disable-pressure-guard"``: each knob flag once,
    ``--flag VALUE`` or ``--flag=VALUE``, one value (no lists, ranges or
    ``none``: the router takes a plain value; leave a flag out for its default),
    ``--disable-pressure-guard`` a switch; then the router's own checks
    (:func:`validate_router_flags`).  A flag the replay does not model, or a
    replay-only variant, is refused.  Raises :class:`ConfigError` with one line
    starting with ``option``.
    """
    try:
        words = shlex.split(text)
    except ValueError as err:
        raise ConfigError(f"{option}: cannot split {text!r} ({err})") from None
    out: dict[str, Any] = {}
    i = 0
    known = ", ".join(s.flag for s in KNOBS.values() if s.router)
    while i < len(words):
        word = words[i]
        flag, eq, value = word.partition("=")
        spec = KNOBS.get(FLAG_TO_KNOB.get(flag, ""))
        if spec is None or not spec.router:
            raise ConfigError(f"{option}: {word!r} is not a router flag the replay models (known: {known})")
        if spec.name in out:
            raise ConfigError(f"{option}: {flag} given twice")
        if spec.kind == "bool" and not eq:
            v: Any = True
            i += 1
        else:
            if not eq:
                if i + 1 >= len(words) or words[i + 1].startswith("--"):
                    raise ConfigError(f"{option}: {flag} needs a value")
                value = words[i + 1]
                i += 2
            else:
                i += 1
            if "," in value or ".." in value or value.strip().lower() == "none":
                raise ConfigError(f"{option}: {flag} {value!r}: the router takes one plain value")
            v = parse_values(flag, value, spec.kind, False)[0]
        out[spec.name] = (not v) if spec.inverted else v
    validate_router_flags(out)
    return {k: out[k] for k in KNOBS if k in out}


# --------------------------------------------------------------------------------------
# Value specs

MAX_RANGE_VALUES = 100_000
"""Largest number of values one ``a..b`` range may expand to."""

MAX_GRID_COMBINATIONS = 1_000_000
"""Largest cartesian product (before skipping refused combinations) a Grid accepts."""

_INT_RE = re.compile(r"\+?[0-9]+")
_NEG_INT_RE = re.compile(r"-[0-9]+")
_RANGE_RE = re.compile(r"(\+?[0-9]+)\.\.(\+?[0-9]+)")
# Rust's f64::from_str grammar (no underscores, no hex), incl. inf/infinity/nan.
_FLOAT_RE = re.compile(
    r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)",
    re.IGNORECASE,
)
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _value_key(v: Any) -> tuple:
    """Canonical sort/dedupe key: None first, then ascending, NaN last."""
    if v is None:
        return (0, 0)
    if isinstance(v, float) and math.isnan(v):
        return (2, 0)
    return (1, v)


def _same_value(a: Any, b: Any) -> bool:
    return _value_key(a) == _value_key(b)


def _dedupe(values: Iterable[Any]) -> list:
    seen: set = set()
    out = []
    for v in values:
        k = _value_key(v)
        if k not in seen:
            seen.add(k)
            out.append(v)
    return out


def _what(kind: str, nullable: bool, choices: tuple[str, ...] = ()) -> str:
    if kind == "int":
        return "an integer, a range a..b, or none" if nullable else "an integer or a range a..b"
    if kind == "float":
        return "a number or none" if nullable else "a number"
    if kind == "choice":
        return "one of " + ", ".join(choices)
    return "true or false"


def parse_values(flag_name: str, text: str, kind: str | None = None, nullable: bool | None = None) -> list:
    """Parse a knob value spec into a list of values (deduplicated, first-seen order).

    ``text`` is one value, or a comma list whose items are values, inclusive
    integer ranges ``a..b`` (int knobs only) or ``none`` (nullable knobs
    only), e.g. ``none,1..4,8``.  ``kind`` is ``"int"`` (unsigned, like the
    router's integer flags), ``"float"`` (Rust ``f64`` syntax incl. ``inf`` and
    ``nan``, left for :func:`validate_router_flags` to refuse) or ``"bool"``
    (``true/false``, ``1/0``, ``yes/no``, ``on/off``).  ``kind`` and
    ``nullable`` default to the knob table's when ``flag_name`` is a known
    flag or knob name.  Values are returned in the *flag's* sense (for
    ``--disable-pressure-guard``, ``True`` = guard disabled; use
    :func:`parse_knob_values` for the knob's sense).

    Raises :class:`ConfigError` with one line naming the flag, e.g.
    ``--worker-queue-limit: 'abc' is not an integer, a range a..b, or none``.
    """
    spec = None
    try:
        spec = knob_spec(flag_name)
    except ConfigError:
        if kind is None:
            raise
    flag = spec.flag if spec is not None else (flag_name if flag_name.startswith("--") else "--" + flag_name)
    kind = kind if kind is not None else spec.kind
    if kind not in ("int", "float", "bool", "choice"):
        raise ValueError(f"kind must be int, float, bool or choice, not {kind!r}")
    choices = spec.choices if spec is not None else ()
    if nullable is None:
        nullable = spec.nullable if spec is not None else False
    if not isinstance(text, str):
        raise ConfigError(f"{flag}: expected a value spec string, got {text!r}")
    if not text.strip():
        raise ConfigError(f"{flag}: empty value; expected {_what(kind, nullable, choices)}")
    out: list = []
    for raw in text.split(","):
        item = raw.strip()
        low = item.lower()
        if not item:
            raise ConfigError(f"{flag}: empty item in {text!r}; expected {_what(kind, nullable, choices)}")
        if low == "none":
            if not nullable:
                raise ConfigError(f"{flag}: 'none' is not allowed (the router has no unset value for this flag)")
            out.append(None)
            continue
        if kind == "int":
            if _INT_RE.fullmatch(item):
                out.append(int(item))
                continue
            m = _RANGE_RE.fullmatch(item)
            if m:
                a, b = int(m.group(1)), int(m.group(2))
                if b < a:
                    raise ConfigError(f"{flag}: range '{item}' is empty (end {b} < start {a})")
                if b - a + 1 > MAX_RANGE_VALUES:
                    raise ConfigError(
                        f"{flag}: range '{item}' has {b - a + 1} values, more than {MAX_RANGE_VALUES}"
                    )
                out.extend(range(a, b + 1))
                continue
            if _NEG_INT_RE.fullmatch(item):
                raise ConfigError(f"{flag}: '{item}' is negative; the router takes an unsigned integer")
            raise ConfigError(f"{flag}: '{item}' is not {_what(kind, nullable)}")
        if kind == "float":
            if _FLOAT_RE.fullmatch(item):
                out.append(float(item))
                continue
            raise ConfigError(f"{flag}: '{item}' is not {_what(kind, nullable)}")
        if kind == "choice":
            if low in choices:
                out.append(low)
                continue
            raise ConfigError(f"{flag}: '{item}' is not {_what(kind, nullable, choices)}")
        if low in _TRUE:
            out.append(True)
        elif low in _FALSE:
            out.append(False)
        else:
            raise ConfigError(f"{flag}: '{item}' is not {_what(kind, nullable)}")
    return _dedupe(out)


def parse_knob_values(name: str, text: str) -> list:
    """Parse ``text`` for a knob (by knob or flag name) into values in the *knob's* sense.

    Same as :func:`parse_values` with the knob table's kind and nullability,
    except that ``--disable-pressure-guard`` values are inverted into
    ``pressure_guard`` values (``true`` -> ``False``).
    """
    spec = knob_spec(name)
    values = parse_values(spec.flag, text, spec.kind, spec.nullable)
    if spec.inverted:
        values = [not v for v in values]
    return values


def _coerce(spec: KnobSpec, v: Any) -> Any:
    """Check and normalise one library-given knob value (knob sense)."""
    if v is None:
        if not spec.nullable:
            raise ConfigError(f"{spec.flag}: none is not allowed (the router has no unset value for this flag)")
        return None
    if spec.kind == "bool":
        if isinstance(v, (bool, np.bool_)):
            return bool(v)
    elif spec.kind == "choice":
        if isinstance(v, str) and v in spec.choices:
            return v
        raise ConfigError(f"{spec.flag}: {v!r} is not {_what(spec.kind, spec.nullable, spec.choices)}")
    elif spec.kind == "int":
        if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
            if v < 0:
                raise ConfigError(f"{spec.flag}: '{v}' is negative; the router takes an unsigned integer")
            return int(v)
    else:
        if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)):
            return float(v)
    raise ConfigError(f"{spec.flag}: {v!r} is not {_what(spec.kind, spec.nullable)}")


# --------------------------------------------------------------------------------------
# Fleet dp size


def fleet_dp_size(dp_sizes: Sequence[int]) -> int:
    """The one ``dp_size`` shared by every worker of a fleet, for ``--per-dp-rank``.

    Raises :class:`ConfigError` on an empty fleet, a non-positive size, or a
    mixed fleet, e.g. ``--per-dp-rank needs one dp_size across the fleet, found 1, 2``.
    """
    sizes = sorted({int(d) for d in dp_sizes})
    if not sizes:
        raise ConfigError("--per-dp-rank needs a fleet with at least one worker")
    if len(sizes) > 1:
        raise ConfigError(
            f"--per-dp-rank needs one dp_size across the fleet, found {', '.join(map(str, sizes))}"
        )
    if sizes[0] < 1:
        raise ConfigError(f"--per-dp-rank needs a dp_size of at least 1, found {sizes[0]}")
    return sizes[0]


# --------------------------------------------------------------------------------------
# Grid

_SCALED = ("worker_queue_limit", "saturation_queue_floor")


class SkippedConfig(NamedTuple):
    """A grid combination the router would refuse: its knobs (fleet values) and the router's text."""

    knobs: dict
    error: str


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


class Grid:
    """A grid of router configs: the cartesian product of per-knob value lists.

    ``values`` maps knob name (or router flag name) -> a list of values, a
    single value, or a value-spec string (parsed by :func:`parse_knob_values`);
    knobs not given take the ``RouterConfig`` default.  Each knob's values are
    deduplicated and sorted canonically (None first, then ascending), and the
    product runs in ``KNOB_NAMES`` order, so the order in which a user lists
    values never changes a config id: ``config_id`` is the position in that
    canonical product (ids of refused combinations are left unused).

    With ``dp_size`` (``--per-dp-rank``), ``worker_queue_limit`` and
    ``saturation_queue_floor`` values are per-rank numbers and are multiplied
    by ``dp_size`` before validation; the per-rank values stay available in
    :meth:`rows` and :meth:`describe`.

    Combinations that :meth:`RouterConfig.validate` refuses are skipped and
    recorded in :attr:`skipped`.  If none remains, the constructor raises
    :class:`ConfigError` with the router's text of the first refused
    combination (so a single invalid config raises with its text).
    """

    def __init__(
        self,
        values: Mapping[str, Any] | None = None,
        *,
        dp_size: int | None = None,
        policy: str = "cache_aware",
        per_dp_rank: bool = False,
    ) -> None:
        self.per_dp_rank: bool = bool(per_dp_rank) or dp_size is not None
        """Limit and floor values are per-rank numbers (``--per-dp-rank``); :meth:`resolve`
        scales them by the fleet's dp_size when ``dp_size`` is not given yet."""
        given: dict[str, list] = {}
        for name, vals in (values or {}).items():
            spec = knob_spec(name)
            if spec.name in given:
                raise ConfigError(f"{spec.flag} given twice")
            if isinstance(vals, str):
                vals = parse_knob_values(spec.name, vals)
            elif not isinstance(vals, (list, tuple, set, frozenset, np.ndarray, range)):
                vals = [vals]
            vals = [_coerce(spec, v) for v in vals]
            if not vals:
                raise ConfigError(f"{spec.flag}: no values given")
            given[spec.name] = vals
        if dp_size is not None:
            if isinstance(dp_size, bool) or not isinstance(dp_size, (int, np.integer)) or dp_size < 1:
                raise ConfigError(f"--per-dp-rank needs a dp_size of at least 1, found {dp_size!r}")
            dp_size = int(dp_size)
        self._input: dict[str, list] = given
        self.dp_size: int | None = dp_size
        """The fleet dp_size the limit and floor values were scaled by (None: not per-rank)."""
        self.policy: str = policy
        """The ``--policy`` the configs are validated under (always cache_aware for the replay)."""
        self.values: dict[str, list] = {
            k: sorted(_dedupe(given.get(k, [_DEFAULTS[k]])), key=_value_key) for k in KNOB_NAMES
        }
        """Canonical value lists per knob (as given: per-rank for limit/floor when ``dp_size``)."""
        n_comb = 1
        for k in KNOB_NAMES:
            n_comb *= len(self.values[k])
        if n_comb > MAX_GRID_COMBINATIONS:
            raise ConfigError(f"grid has {n_comb} combinations, more than {MAX_GRID_COMBINATIONS}")
        self.n_combinations: int = n_comb
        """Size of the cartesian product, refused combinations included."""

        self.configs: list[RouterConfig] = []
        """The valid configs, in config-id order."""
        self.config_ids: list[int] = []
        """Each valid config's id (its position in the canonical product)."""
        self.skipped: list[SkippedConfig] = []
        """Refused combinations as ``(knob dict, router error text)``, in product order."""
        self._per_rank: list[tuple[int | None, int | None]] = []
        self._skipped_per_rank: list[tuple[int | None, int | None]] = []
        for pos, combo in enumerate(itertools.product(*(self.values[k] for k in KNOB_NAMES))):
            knobs = dict(zip(KNOB_NAMES, combo, strict=True))
            per_rank = (knobs["worker_queue_limit"], knobs["saturation_queue_floor"])
            # REPLAY CHOICE: a per-worker floor scaling reads the limit and floor per
            # rank already (each worker's threshold is value x its own dp_size), so
            # --per-dp-rank leaves them as given
            if dp_size is not None and knobs["variant_floor_scaling"] != "per-worker":
                for k in _SCALED:
                    if knobs[k] is not None:
                        knobs[k] = knobs[k] * dp_size
            cfg = RouterConfig(**knobs)
            try:
                cfg.validate(policy)
            except ConfigError as err:
                self.skipped.append(SkippedConfig(knobs, str(err)))
                self._skipped_per_rank.append(per_rank)
                continue
            self.configs.append(cfg)
            self.config_ids.append(pos)
            self._per_rank.append(per_rank)
        if not self.configs:
            raise ConfigError(self.skipped[0].error)

    # -- construction helpers ---------------------------------------------------------

    @classmethod
    def from_texts(cls, texts: Mapping[str, str | None], **kwargs) -> Grid:
        """Build from value-spec strings keyed by flag or knob name (``None`` = not given).

        Keyword arguments go to the constructor (``dp_size``, ``policy``).
        """
        return cls({k: v for k, v in texts.items() if v is not None}, **kwargs)

    def scaled_per_dp_rank(self, dp_size: int) -> Grid:
        """The same grid with its limit and floor values read per rank and
        multiplied by ``dp_size`` (``--per-dp-rank``); a new Grid."""
        return Grid(self._input, dp_size=dp_size, policy=self.policy)

    def as_per_rank(self) -> Grid:
        """The same values read per rank (``--per-dp-rank``), to be scaled by :meth:`resolve`."""
        return Grid(self._input, policy=self.policy, per_dp_rank=True)

    def resolve(self, fleet_dp_sizes: Sequence[int]) -> Grid:
        """The grid for a fleet whose workers have ``fleet_dp_sizes``: a per-rank grid
        not yet scaled is scaled by the fleet's one dp_size (:func:`fleet_dp_size`);
        any other grid is returned as it is."""
        if not self.per_dp_rank or self.dp_size is not None:
            return self
        return self.scaled_per_dp_rank(fleet_dp_size(list(fleet_dp_sizes)))

    # -- access -----------------------------------------------------------------------

    @property
    def n_configs(self) -> int:
        """Number of valid configs."""
        return len(self.configs)

    def __len__(self) -> int:
        """Number of valid configs."""
        return len(self.configs)

    def __iter__(self):
        """Iterate over ``(config_id, RouterConfig)`` pairs in id order."""
        return iter(zip(self.config_ids, self.configs, strict=True))

    def __repr__(self) -> str:
        """Short summary: config and skipped counts."""
        return f"Grid(n_configs={self.n_configs}, skipped={len(self.skipped)}, dp_size={self.dp_size})"

    def config(self, config_id: int) -> RouterConfig:
        """The valid config with this id (``KeyError`` if refused or out of range)."""
        try:
            return self.configs[self.config_ids.index(config_id)]
        except ValueError:
            raise KeyError(config_id) from None

    def to_arrays(self) -> dict[str, np.ndarray]:
        """One numpy array per knob (key = knob name), length ``n_configs``, in id order.

        ints are ``int64`` with None as -1, floats ``float64`` with None as
        NaN, bools ``np.bool_``.  Limit and floor are fleet values (scaled).
        """
        out: dict[str, np.ndarray] = {}
        for k in KNOB_NAMES:
            kind = KNOBS[k].kind
            col = [getattr(c, k) for c in self.configs]
            if kind == "int":
                out[k] = np.array([-1 if v is None else v for v in col], dtype=np.int64)
            elif kind == "float":
                out[k] = np.array([np.nan if v is None else v for v in col], dtype=np.float64)
            elif kind == "choice":
                out[k] = np.array(col, dtype=object)
            else:
                out[k] = np.array(col, dtype=np.bool_)
        return out

    def rows(self) -> list[dict]:
        """One dict per valid config for reports: ``config_id``, every knob
        (fleet values), ``dp_size``, ``per_rank_limit`` and ``per_rank_floor``
        (None unless the grid is per-rank)."""
        out = []
        for cid, cfg, (pl, pf) in zip(self.config_ids, self.configs, self._per_rank, strict=True):
            row = {"config_id": cid, **cfg.as_dict(), "dp_size": self.dp_size}
            row["per_rank_limit"] = pl if self.dp_size is not None else None
            row["per_rank_floor"] = pf if self.dp_size is not None else None
            out.append(row)
        return out

    def warning_line(self, listed_in: str | None = "run.json") -> str | None:
        """One warning line about skipped combinations, or None when none was skipped;
        ``listed_in`` names the file that lists them all (None: :meth:`skipped_lines` follow)."""
        if not self.skipped:
            return None
        more = len(self.skipped) - 1
        where = f"listed in {listed_in}" if listed_in else "listed below"
        tail = f" (and {more} more, {where})" if more else ""
        return (
            f"skipped {len(self.skipped)} of {self.n_combinations} configs the router would refuse: "
            f"{self.skipped[0].error}{tail}"
        )

    def skipped_lines(self) -> list[str]:
        """One line per skipped combination: its knob values and the router's refusal."""
        out = []
        for knobs, err in self.skipped:
            shown = [k for k in knobs if len(self.values.get(k, ())) > 1] or list(knobs)
            vals = " ".join(f"{KNOBS[k].flag} {'none' if knobs[k] is None else knobs[k]}" for k in shown)
            out.append(f"  skipped: {vals}: {err}")
        return out

    def describe(self) -> dict:
        """A JSON-able description for ``run.json``: canonical value lists per
        knob (with flag names), per-rank info, counts, config ids and the
        skipped combinations with the router's texts.  Non-finite floats are
        written as the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
        per_rank = self.dp_size is not None
        values = {}
        for k in KNOB_NAMES:
            vals = self.values[k]
            if per_rank and k in _SCALED:
                vals = [None if v is None else v * self.dp_size for v in vals]
            values[k] = [_jsonable(v) for v in vals]
        skipped = []
        for (knobs, err), (pl, pf) in zip(self.skipped, self._skipped_per_rank, strict=True):
            entry: dict[str, Any] = {"knobs": {k: _jsonable(v) for k, v in knobs.items()}, "error": err}
            if per_rank:
                entry["per_rank_limit"], entry["per_rank_floor"] = pl, pf
            skipped.append(entry)
        return {
            "policy": self.policy,
            "knob_order": list(KNOB_NAMES),
            "flags": {k: KNOBS[k].flag for k in KNOB_NAMES},
            "values": values,
            "per_dp_rank": per_rank,
            "dp_size": self.dp_size,
            "per_rank_values": (
                {k: list(self.values[k]) for k in _SCALED} if per_rank else None
            ),
            "n_combinations": self.n_combinations,
            "n_configs": self.n_configs,
            "config_ids": list(self.config_ids),
            "skipped": skipped,
        }
