"""RouterConfig validation (ROUTER_SEMANTICS.md section 6), value specs and the Grid."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.config import (
    FLAG_TO_KNOB,
    KNOB_NAMES,
    KNOBS,
    Grid,
    RouterConfig,
    SkippedConfig,
    fleet_dp_size,
    knob_spec,
    parse_knob_values,
    parse_values,
    validate_router_flags,
)
from replay.errors import ConfigError

FIXTURE = Path(__file__).parent / "fixtures" / "cli_scenarios.json"

# Router texts, section 6.
E_LIMIT0 = "--worker-queue-limit must be at least 1"
E_FLOOR_NO_LIMIT = (
    "--saturation-queue-floor requires --worker-queue-limit (there is no diversion to cancel without it)"
)
E_FLOOR0 = "--saturation-queue-floor must be at least 1"
E_MLC0 = "--min-load-choices must be at least 1"
E_CACHE_POLICY = "cache candidate tuning flags require --policy cache_aware"
E_PRESSURE_POLICY = "pressure guard tuning requires --policy session_aware or cache_aware"
E_DISABLE_POLICY = "--disable-pressure-guard requires --policy session_aware or cache_aware"
E_REL = "--pressure-rel-threshold must be finite and greater than 1"
E_MS = "--pressure-abs-threshold-ms must be finite and non-negative"
E_RATIO = "--cache-affinity-min-match-ratio must be finite and in [0, 1]"
E_CRATIO = "--cache-candidate-ratio must be finite and in [0, 1]"
E_MINMAX = (
    "--cache-candidate-min-workers and --cache-candidate-max-workers "
    "must be positive and min must not exceed max"
)


def e_floor_gt(floor, limit):
    return f"--saturation-queue-floor ({floor}) must be at most --worker-queue-limit ({limit})"


def router_error(args, policy="cache_aware"):
    """The text validate_router_flags raises, or None when it accepts."""
    try:
        validate_router_flags(args, policy)
    except ConfigError as err:
        return str(err)
    return None


# --------------------------------------------------------------------------------------
# Section 6: texts and order

NAN, INF = float("nan"), float("inf")

ORDER_CASES = [
    # (args, policy, expected text or None)
    ({}, "cache_aware", None),
    ({"worker_queue_limit": 4}, "cache_aware", None),
    ({"worker_queue_limit": 0}, "cache_aware", E_LIMIT0),
    ({"worker_queue_limit": 0, "saturation_queue_floor": 5}, "cache_aware", E_LIMIT0),
    ({"worker_queue_limit": 0, "min_load_choices": 0}, "cache_aware", E_LIMIT0),
    ({"saturation_queue_floor": 2}, "cache_aware", E_FLOOR_NO_LIMIT),
    ({"saturation_queue_floor": 0}, "cache_aware", E_FLOOR_NO_LIMIT),  # 2 before 3
    ({"worker_queue_limit": None, "saturation_queue_floor": 2}, "cache_aware", E_FLOOR_NO_LIMIT),
    ({"worker_queue_limit": 4, "saturation_queue_floor": 0}, "cache_aware", E_FLOOR0),
    ({"worker_queue_limit": 4, "saturation_queue_floor": 0, "min_load_choices": 0}, "cache_aware", E_FLOOR0),
    ({"worker_queue_limit": 4, "saturation_queue_floor": 5}, "cache_aware", e_floor_gt(5, 4)),
    ({"worker_queue_limit": 4, "saturation_queue_floor": 5, "min_load_choices": 0}, "cache_aware", e_floor_gt(5, 4)),
    ({"worker_queue_limit": 4, "saturation_queue_floor": 4}, "cache_aware", None),  # floor == limit allowed
    ({"worker_queue_limit": 4, "saturation_queue_floor": 1}, "cache_aware", None),
    ({"min_load_choices": 0}, "cache_aware", E_MLC0),
    ({"min_load_choices": 1}, "cache_aware", None),
    ({"min_load_choices": 10**9}, "cache_aware", None),  # no upper bound
    # value checks before policy checks
    ({"worker_queue_limit": 0}, "power_of_two", E_LIMIT0),
    ({"saturation_queue_floor": 2}, "power_of_two", E_FLOOR_NO_LIMIT),
    ({"worker_queue_limit": 2, "saturation_queue_floor": 3}, "power_of_two", e_floor_gt(3, 2)),
    ({"min_load_choices": 0, "pressure_rel_threshold": 2.0}, "random", E_MLC0),
    # 6: cache candidate tuning flags
    ({}, "power_of_two", None),
    ({"pressure_guard": True}, "power_of_two", None),  # True is no flag
    ({"worker_queue_limit": 4}, "power_of_two", E_CACHE_POLICY),
    ({"worker_queue_limit": None}, "power_of_two", E_CACHE_POLICY),  # given, even if unset
    ({"min_load_choices": 3}, "session_aware", E_CACHE_POLICY),
    ({"cache_switch_margin_tokens": 0}, "round_robin", E_CACHE_POLICY),
    ({"cache_affinity_min_matched_tokens": 512}, "session_aware", E_CACHE_POLICY),
    ({"cache_affinity_min_match_ratio": 0.5}, "power_of_two", E_CACHE_POLICY),
    ({"cache_candidate_min_workers": 4}, "power_of_two", E_CACHE_POLICY),
    ({"cache_candidate_ratio": 0.1}, "power_of_two", E_CACHE_POLICY),
    ({"cache_candidate_max_workers": 4}, "power_of_two", E_CACHE_POLICY),
    ({"cache_candidate_ratio": -0.1}, "power_of_two", E_CACHE_POLICY),  # policy before item 8
    ({"worker_queue_limit": 4, "pressure_guard": False, "pressure_rel_threshold": 2.0}, "power_of_two", E_CACHE_POLICY),
    # --disable-pressure-guard (before 7), then 7
    ({"pressure_guard": False}, "power_of_two", E_DISABLE_POLICY),
    ({"pressure_guard": False, "pressure_rel_threshold": 2.0}, "power_of_two", E_DISABLE_POLICY),
    ({"pressure_rel_threshold": 2.0}, "power_of_two", E_PRESSURE_POLICY),
    ({"pressure_abs_threshold_tokens": 0}, "random", E_PRESSURE_POLICY),
    ({"pressure_abs_threshold_ms": 3.5}, "round_robin", E_PRESSURE_POLICY),
    ({"pressure_rel_threshold": 0.5}, "power_of_two", E_PRESSURE_POLICY),  # item 8 only for affinity policies
    ({"pressure_guard": False, "pressure_rel_threshold": 2.0}, "session_aware", None),
    ({"pressure_rel_threshold": 0.5}, "session_aware", E_REL),
    # 8: affinity value checks, in the listed order
    ({"pressure_rel_threshold": 1.0}, "cache_aware", E_REL),  # strictly greater than 1
    ({"pressure_rel_threshold": 1.0000001}, "cache_aware", None),
    ({"pressure_rel_threshold": INF}, "cache_aware", E_REL),
    ({"pressure_rel_threshold": NAN}, "cache_aware", E_REL),
    ({"pressure_rel_threshold": 0.5, "pressure_abs_threshold_ms": -1.0}, "cache_aware", E_REL),
    ({"pressure_abs_threshold_ms": -1.0}, "cache_aware", E_MS),
    ({"pressure_abs_threshold_ms": INF}, "cache_aware", E_MS),
    ({"pressure_abs_threshold_ms": NAN}, "cache_aware", E_MS),
    ({"pressure_abs_threshold_ms": 0.0}, "cache_aware", None),
    ({"pressure_abs_threshold_ms": -1.0, "cache_affinity_min_match_ratio": 1.1}, "cache_aware", E_MS),
    ({"cache_affinity_min_match_ratio": 1.1}, "cache_aware", E_RATIO),
    ({"cache_affinity_min_match_ratio": -0.0001}, "cache_aware", E_RATIO),
    ({"cache_affinity_min_match_ratio": NAN}, "cache_aware", E_RATIO),
    ({"cache_affinity_min_match_ratio": 0.0}, "cache_aware", None),
    ({"cache_affinity_min_match_ratio": 1.0}, "cache_aware", None),
    ({"cache_affinity_min_match_ratio": 1.1, "cache_candidate_ratio": -0.1}, "cache_aware", E_RATIO),
    ({"cache_candidate_ratio": -0.1}, "cache_aware", E_CRATIO),
    ({"cache_candidate_ratio": INF}, "cache_aware", E_CRATIO),
    ({"cache_candidate_ratio": 0.0}, "cache_aware", None),
    ({"cache_candidate_ratio": 1.0}, "cache_aware", None),
    ({"cache_candidate_ratio": 1.5, "cache_candidate_min_workers": 0}, "cache_aware", E_CRATIO),
    ({"cache_candidate_min_workers": 9, "cache_candidate_max_workers": 8}, "cache_aware", E_MINMAX),
    ({"cache_candidate_min_workers": 33}, "cache_aware", E_MINMAX),  # against default max 32
    ({"cache_candidate_min_workers": 0}, "cache_aware", E_MINMAX),
    ({"cache_candidate_min_workers": 0, "cache_candidate_max_workers": 0}, "cache_aware", E_MINMAX),
    ({"cache_candidate_min_workers": 4, "cache_candidate_max_workers": 4}, "cache_aware", None),
    # knobs without a check
    ({"cache_affinity_min_matched_tokens": 0}, "cache_aware", None),
    ({"cache_affinity_min_matched_tokens": None}, "cache_aware", None),
    ({"cache_switch_margin_tokens": 0, "pressure_abs_threshold_tokens": 0}, "cache_aware", None),
]


@pytest.mark.parametrize("args,policy,expected", ORDER_CASES)
def test_router_checks_texts_and_order(args, policy, expected):
    assert router_error(args, policy) == expected


def test_value_checks_come_before_policy_checks_for_every_policy():
    for policy in ("power_of_two", "random", "round_robin", "session_aware", "cache_aware"):
        assert router_error({"worker_queue_limit": 0}, policy) == E_LIMIT0
        assert router_error({"min_load_choices": 0, "worker_queue_limit": 3}, policy) == E_MLC0


def test_unknown_flag_is_refused():
    with pytest.raises(ConfigError, match="unknown router knob"):
        validate_router_flags({"stable_pair": True}, "cache_aware")


def test_router_config_validate_uses_non_default_knobs_as_given_flags():
    assert RouterConfig().validate() == RouterConfig()
    assert RouterConfig().given_flags() == {}
    assert RouterConfig().validate("power_of_two") == RouterConfig()
    cfg = RouterConfig(worker_queue_limit=4, pressure_guard=False)
    assert cfg.given_flags() == {"worker_queue_limit": 4, "pressure_guard": False}
    with pytest.raises(ConfigError) as exc:
        cfg.validate("power_of_two")
    assert str(exc.value) == E_CACHE_POLICY
    with pytest.raises(ConfigError) as exc:
        RouterConfig(pressure_guard=False).validate("power_of_two")
    assert str(exc.value) == E_DISABLE_POLICY
    with pytest.raises(ConfigError) as exc:
        RouterConfig(worker_queue_limit=3, saturation_queue_floor=7).validate()
    assert str(exc.value) == e_floor_gt(7, 3)
    # The router's unit-test proposal defaults are not a valid CLI config (rel 0.0).
    with pytest.raises(ConfigError) as exc:
        RouterConfig.proposal_default().validate()
    assert str(exc.value) == E_REL


def _all_flags_visible(args):
    """True when every given flag differs from its default (so RouterConfig can see it)."""
    given = {k for k, v in args.items() if not (k == "pressure_guard" and v)}
    return set(RouterConfig(**args).given_flags()) == given


@pytest.mark.parametrize("args,policy,expected", [c for c in ORDER_CASES if _all_flags_visible(c[0])])
def test_router_config_validate_agrees_with_flags(args, policy, expected):
    """Where every given flag differs from the default, validate() == validate_router_flags().

    (A flag given at its default value, e.g. ``--worker-queue-limit`` unset under
    ``--policy power_of_two``, is invisible to RouterConfig; only the policy
    checks can tell, and the replay always runs cache_aware.)
    """
    cfg = RouterConfig(**args)
    try:
        cfg.validate(policy)
        got = None
    except ConfigError as err:
        got = str(err)
    assert got == expected


# --------------------------------------------------------------------------------------
# The router's own CLI scenarios (cli-01..cli-06), from tests/fixtures/cli_scenarios.json

# Flags that are not routing knobs and carry no check we model.
IGNORED_FLAGS = {"--kv-indexer-endpoint"}
VALUE_FLAGS = {"--policy", "--kv-indexer-endpoint", "--kv-indexer-query-timeout-ms"}
BARE_FLAGS = {"--disable-pressure-guard", "--stable-pair"}

UNREACHABLE = {
    "cli-04#4": "--kv-indexer-query-timeout-ms is a KV-indexer client flag, not a routing knob; "
    "traces carry the indexer's answers, not its timeouts",
    "cli-05#3": "--stable-pair is a session-affinity flag; sessions are out of scope (spec section 0, item 8)",
    "cli-05#4": "--stable-pair is a session-affinity flag; sessions are out of scope (spec section 0, item 8)",
}


def _split_args(text):
    """shlex-split a router command line into [(flag, value or None)]."""
    tokens = shlex.split(text)
    out, i = [], 0
    while i < len(tokens):
        tok = tokens[i]
        assert tok.startswith("--"), tok
        if "=" in tok:
            flag, value = tok.split("=", 1)
            out.append((flag, value))
            i += 1
        elif tok in BARE_FLAGS:
            out.append((tok, None))
            i += 1
        else:
            out.append((tok, tokens[i + 1]))
            i += 2
    return out


def _cli_cases():
    data = json.loads(FIXTURE.read_text())
    cases = []
    for sc in data["scenarios"]:
        for n, case in enumerate(sc["cases"], 1):
            cases.append((f"{sc['id']}#{n}", case))
    return cases


CLI_CASES = _cli_cases()


def _to_knob_args(pairs):
    """(policy, knob args, unmodelled flags) for one command line."""
    policy, args, unmodelled = "random", {}, []
    for flag, value in pairs:
        if flag == "--policy":
            policy = value
        elif flag in IGNORED_FLAGS:
            continue
        elif flag == "--disable-pressure-guard":
            args["pressure_guard"] = False
        elif flag in FLAG_TO_KNOB:
            (v,) = parse_values(flag, value)
            args[FLAG_TO_KNOB[flag]] = v
        else:
            unmodelled.append(flag)
    return policy, args, unmodelled


def test_cli_fixture_covers_cli_01_to_06():
    ids = sorted({cid.split("#")[0] for cid, _ in CLI_CASES})
    assert ids == [f"cli-0{i}" for i in range(1, 7)]
    assert len(CLI_CASES) == 24


def test_unreachable_cli_cases_are_exactly_the_errors_about_unmodelled_flags():
    """An ok case with an unmodelled flag (cli-05#1: ``--kv-indexer-query-timeout-ms 40``)
    is still tested on its knobs; only refusals caused by such flags are unreachable."""
    refused = {
        cid for cid, case in CLI_CASES if not case["ok"] and _to_knob_args(_split_args(case["args"]))[2]
    }
    assert refused == set(UNREACHABLE)


@pytest.mark.parametrize("cid,case", [c for c in CLI_CASES if c[0] not in UNREACHABLE],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_cli_scenario(cid, case):
    policy, args, _ = _to_knob_args(_split_args(case["args"]))
    got = router_error(args, policy)
    # RouterConfig.validate reads non-default knobs as the given flags; every fixture
    # flag differs from its default, so both paths must agree.
    cfg = RouterConfig(**args)
    assert set(cfg.given_flags()) == {k for k, v in args.items() if not (k == "pressure_guard" and v)}
    try:
        cfg.validate(policy)
        got_cfg = None
    except ConfigError as err:
        got_cfg = str(err)
    assert got_cfg == got
    if case["ok"]:
        assert got is None
        expect = dict(case.get("values", {}))
        expect.update({k: v for k, v in case.items() if k in KNOBS})
        assert expect, "an ok case should state at least one value"
        for k, v in expect.items():
            assert getattr(cfg, k) == v, k
    else:
        assert got is not None
        contains = case["error_contains"]
        for part in [contains] if isinstance(contains, str) else contains:
            assert part in got
        if "exact" in case:
            assert got == case["exact"]


# --------------------------------------------------------------------------------------
# Value specs


@pytest.mark.parametrize(
    "flag,text,expected",
    [
        ("--worker-queue-limit", "4", [4]),
        ("--worker-queue-limit", "none", [None]),
        ("--worker-queue-limit", "None", [None]),
        ("--worker-queue-limit", "none,1..4,8", [None, 1, 2, 3, 4, 8]),
        ("--worker-queue-limit", " 8 , 2..3 ,none", [8, 2, 3, None]),  # first-seen order
        ("--worker-queue-limit", "3..3", [3]),
        ("--worker-queue-limit", "2,1..3,2,none,none", [2, 1, 3, None]),  # deduped
        ("--worker-queue-limit", "0", [0]),  # zero parses; the router refuses it later
        ("--worker-queue-limit", "+5", [5]),
        ("--saturation-queue-floor", "none,1..2", [None, 1, 2]),
        ("--min-load-choices", "1..3", [1, 2, 3]),
        ("--cache-affinity-min-matched-tokens", "none,0,512", [None, 0, 512]),
        ("--pressure-rel-threshold", "1.5,2,1e1", [1.5, 2.0, 10.0]),
        ("--pressure-rel-threshold", "2,2.0", [2.0]),
        ("--pressure-abs-threshold-ms", "none,3.5,.5", [None, 3.5, 0.5]),
        ("--cache-affinity-min-match-ratio", "none,0.25", [None, 0.25]),
        ("--cache-candidate-ratio", "-0.1", [-0.1]),  # parses; refused by validation
        ("--disable-pressure-guard", "true,false", [True, False]),
        ("--disable-pressure-guard", "yes,1,TRUE", [True]),
        ("worker_queue_limit", "1,2", [1, 2]),  # knob names accepted
        ("worker-queue-limit", "1", [1]),
    ],
)
def test_parse_values(flag, text, expected):
    assert parse_values(flag, text) == expected
    spec = knob_spec(flag)
    assert parse_values(flag, text, spec.kind) == expected


def test_parse_float_non_finite_is_left_to_the_router_checks():
    vals = parse_values("--pressure-rel-threshold", "inf,nan,NaN,1.5")
    assert vals[0] == math.inf and math.isnan(vals[1]) and vals[2] == 1.5 and len(vals) == 3


def test_parse_values_with_explicit_kind_for_unknown_flag():
    assert parse_values("--other", "none,1..2", "int", nullable=True) == [None, 1, 2]
    with pytest.raises(ConfigError, match=r"^--other: 'x' is not an integer or a range a\.\.b$"):
        parse_values("--other", "x", "int")
    with pytest.raises(ConfigError, match="unknown router knob"):
        parse_values("--other", "1")


@pytest.mark.parametrize(
    "flag,text,message",
    [
        ("--worker-queue-limit", "abc", "--worker-queue-limit: 'abc' is not an integer, a range a..b, or none"),
        ("--min-load-choices", "abc", "--min-load-choices: 'abc' is not an integer or a range a..b"),
        ("--min-load-choices", "none",
         "--min-load-choices: 'none' is not allowed (the router has no unset value for this flag)"),
        ("--worker-queue-limit", "5..2", "--worker-queue-limit: range '5..2' is empty (end 2 < start 5)"),
        ("--worker-queue-limit", "1,5..2", "--worker-queue-limit: range '5..2' is empty (end 2 < start 5)"),
        ("--worker-queue-limit", "-1", "--worker-queue-limit: '-1' is negative; the router takes an unsigned integer"),
        ("--worker-queue-limit", "1.5", "--worker-queue-limit: '1.5' is not an integer, a range a..b, or none"),
        ("--worker-queue-limit", "1..", "--worker-queue-limit: '1..' is not an integer, a range a..b, or none"),
        ("--worker-queue-limit", "1_000", "--worker-queue-limit: '1_000' is not an integer, a range a..b, or none"),
        ("--worker-queue-limit", "", "--worker-queue-limit: empty value; expected an integer, a range a..b, or none"),
        ("--worker-queue-limit", "1,,2",
         "--worker-queue-limit: empty item in '1,,2'; expected an integer, a range a..b, or none"),
        ("--worker-queue-limit", "0..1000000",
         "--worker-queue-limit: range '0..1000000' has 1000001 values, more than 100000"),
        ("--pressure-rel-threshold", "fast", "--pressure-rel-threshold: 'fast' is not a number"),
        ("--pressure-rel-threshold", "1..2", "--pressure-rel-threshold: '1..2' is not a number"),
        ("--pressure-rel-threshold", "none",
         "--pressure-rel-threshold: 'none' is not allowed (the router has no unset value for this flag)"),
        ("--pressure-abs-threshold-ms", "x", "--pressure-abs-threshold-ms: 'x' is not a number or none"),
        ("--disable-pressure-guard", "maybe", "--disable-pressure-guard: 'maybe' is not true or false"),
        ("--disable-pressure-guard", "none",
         "--disable-pressure-guard: 'none' is not allowed (the router has no unset value for this flag)"),
    ],
)
def test_parse_values_errors(flag, text, message):
    with pytest.raises(ConfigError) as exc:
        parse_values(flag, text)
    assert str(exc.value) == message
    assert "\n" not in str(exc.value)


def test_nullable_knobs_are_those_the_router_allows_unset():
    assert {k for k, s in KNOBS.items() if s.nullable} == {
        "worker_queue_limit",
        "saturation_queue_floor",
        "pressure_abs_threshold_ms",
        "cache_affinity_min_matched_tokens",
        "cache_affinity_min_match_ratio",
        "power_of_n_choices",
        "max_in_flight",
    }
    assert tuple(KNOBS) == KNOB_NAMES
    for k, spec in KNOBS.items():
        if not spec.router:  # replay-only policy variants: variant_x_y <-> --x-y
            assert k.startswith("variant_") and spec.flag == "--" + k[len("variant_"):].replace("_", "-")
            continue
        assert spec.flag == "--" + k.replace("_", "-") or k == "pressure_guard"


def test_parse_knob_values_inverts_disable_pressure_guard():
    assert parse_knob_values("--disable-pressure-guard", "true") == [False]
    assert parse_knob_values("pressure_guard", "false,true") == [True, False]
    assert parse_knob_values("--worker-queue-limit", "none,2") == [None, 2]


# --------------------------------------------------------------------------------------
# Grid


def test_default_grid_is_one_default_config():
    g = Grid()
    assert g.configs == [RouterConfig()]
    assert g.config_ids == [0]
    assert g.skipped == []
    assert g.n_configs == len(g) == 1
    assert g.warning_line() is None


def test_grid_product_order_ids_and_skipped():
    g = Grid({"worker_queue_limit": [4, None, 2], "saturation_queue_floor": "3,none,1"})
    assert g.values["worker_queue_limit"] == [None, 2, 4]
    assert g.values["saturation_queue_floor"] == [None, 1, 3]
    # product: (None,None)=0 (None,1)=1x (None,3)=2x (2,None)=3 (2,1)=4 (2,3)=5x (4,None)=6 (4,1)=7 (4,3)=8
    assert g.config_ids == [0, 3, 4, 6, 7, 8]
    assert [(c.worker_queue_limit, c.saturation_queue_floor) for c in g.configs] == [
        (None, None), (2, None), (2, 1), (4, None), (4, 1), (4, 3)
    ]
    assert [(s.knobs["worker_queue_limit"], s.knobs["saturation_queue_floor"], s.error) for s in g.skipped] == [
        (None, 1, E_FLOOR_NO_LIMIT),
        (None, 3, E_FLOOR_NO_LIMIT),
        (2, 3, e_floor_gt(3, 2)),
    ]
    knobs, err = g.skipped[0]  # a (knob dict, text) pair
    assert isinstance(g.skipped[0], SkippedConfig) and set(knobs) == set(KNOB_NAMES) and err == E_FLOOR_NO_LIMIT
    assert g.n_combinations == 9
    assert g.config(8) == RouterConfig(worker_queue_limit=4, saturation_queue_floor=3)
    with pytest.raises(KeyError):
        g.config(1)
    assert list(g)[0] == (0, RouterConfig())
    line = g.warning_line()
    assert "\n" not in line and line.startswith("skipped 3 of 9 configs") and E_FLOOR_NO_LIMIT in line


def test_grid_skips_zero_values():
    g = Grid({"worker_queue_limit": "0..2", "min_load_choices": "0,1"})
    assert [(c.worker_queue_limit, c.min_load_choices) for c in g.configs] == [(1, 1), (2, 1)]
    assert [s.error for s in g.skipped] == [E_LIMIT0, E_LIMIT0, E_MLC0, E_MLC0]


def test_grid_product_follows_field_order_not_input_order():
    a = Grid({"min_load_choices": [1, 2], "worker_queue_limit": [3, 4]})
    b = Grid({"worker_queue_limit": [4, 3], "min_load_choices": [2, 1]})
    assert a.configs == b.configs and a.config_ids == b.config_ids == [0, 1, 2, 3]
    # worker_queue_limit is the slowest-varying knob
    assert [(c.worker_queue_limit, c.min_load_choices) for c in a.configs] == [(3, 1), (3, 2), (4, 1), (4, 2)]


def test_single_invalid_config_raises_router_text():
    with pytest.raises(ConfigError) as exc:
        Grid({"worker_queue_limit": 0})
    assert str(exc.value) == E_LIMIT0
    with pytest.raises(ConfigError) as exc:
        Grid({"saturation_queue_floor": 2})
    assert str(exc.value) == E_FLOOR_NO_LIMIT
    with pytest.raises(ConfigError) as exc:
        Grid({"pressure_rel_threshold": "1.0"})
    assert str(exc.value) == E_REL


def test_grid_without_valid_config_raises_first_refused_in_canonical_order():
    with pytest.raises(ConfigError) as exc:
        Grid({"worker_queue_limit": [3], "saturation_queue_floor": [5, 4]})
    assert str(exc.value) == e_floor_gt(4, 3)


@pytest.mark.parametrize(
    "values,message",
    [
        ({"nope": [1]}, "unknown router knob 'nope'"),
        ({"min_load_choices": []}, "--min-load-choices: no values given"),
        ({"min_load_choices": [None]}, "--min-load-choices: none is not allowed"),
        ({"worker_queue_limit": [1.5]}, "--worker-queue-limit: 1.5 is not an integer"),
        ({"worker_queue_limit": [True]}, "--worker-queue-limit: True is not an integer"),
        ({"worker_queue_limit": [-2]}, "--worker-queue-limit: '-2' is negative"),
        ({"pressure_guard": [1]}, "--disable-pressure-guard: 1 is not true or false"),
        ({"pressure_rel_threshold": ["2"]}, "--pressure-rel-threshold: '2' is not a number"),
        ({"worker_queue_limit": [1], "--worker-queue-limit": [2]}, "--worker-queue-limit given twice"),
        ({"cache_switch_margin_tokens": "0..99999", "pressure_abs_threshold_tokens": "0..99"}, "more than 1000000"),
    ],
)
def test_grid_input_errors(values, message):
    with pytest.raises(ConfigError) as exc:
        Grid(values)
    assert str(exc.value).startswith(message) or message in str(exc.value)


def test_grid_accepts_scalars_numpy_and_flag_names():
    g = Grid({"--worker-queue-limit": np.array([2, 1]), "pressure_rel_threshold": 2, "pressure_guard": np.bool_(False)})
    assert [c.worker_queue_limit for c in g.configs] == [1, 2]
    assert all(c.pressure_rel_threshold == 2.0 and isinstance(c.pressure_rel_threshold, float) for c in g.configs)
    assert all(c.pressure_guard is False for c in g.configs)
    h = Grid.from_texts({"--worker-queue-limit": "2,1", "--saturation-queue-floor": None})
    assert h.configs == [RouterConfig(worker_queue_limit=1), RouterConfig(worker_queue_limit=2)]


def test_to_arrays_encoding():
    g = Grid(
        {
            "worker_queue_limit": "none,4",
            "saturation_queue_floor": "none,2",
            "pressure_abs_threshold_ms": "none,3.5",
            "pressure_guard": [True, False],
        }
    )
    arr = g.to_arrays()
    assert set(arr) == set(KNOB_NAMES)
    n = g.n_configs
    assert n == 3 * 2 * 2  # (None,None), (4,None), (4,2) x ms x guard
    for k, a in arr.items():
        assert a.shape == (n,)
        kind = KNOBS[k].kind
        assert a.dtype == {"int": np.int64, "float": np.float64, "bool": np.bool_, "choice": object}[kind]
    for i, cfg in enumerate(g.configs):
        for k in KNOB_NAMES:
            v, a = getattr(cfg, k), arr[k][i]
            if v is None:
                assert (a == -1) if KNOBS[k].kind == "int" else np.isnan(a)
            else:
                assert a == v
    assert arr["pressure_guard"].tolist() == [c.pressure_guard for c in g.configs]


def test_describe_is_json():
    g = Grid({"worker_queue_limit": "none,2", "saturation_queue_floor": "none,2,3", "pressure_rel_threshold": "2,nan"})
    d = g.describe()
    text = json.dumps(d, allow_nan=False)
    back = json.loads(text)
    assert back["n_configs"] == g.n_configs == 3
    assert back["values"]["worker_queue_limit"] == [None, 2]
    assert back["values"]["pressure_rel_threshold"] == [2.0, "nan"]
    assert back["config_ids"] == g.config_ids
    assert back["knob_order"] == list(KNOB_NAMES)
    assert back["per_dp_rank"] is False and back["dp_size"] is None
    errors = [s["error"] for s in back["skipped"]]
    assert len(errors) == g.n_combinations - g.n_configs == 12 - 3
    assert E_FLOOR_NO_LIMIT in errors and e_floor_gt(3, 2) in errors and E_REL in errors


# canonical order independence ----------------------------------------------------------

KNOB_POOLS = {
    "worker_queue_limit": [None, 0, 1, 2, 3, 5],
    "saturation_queue_floor": [None, 0, 1, 2, 4],
    "min_load_choices": [0, 1, 2, 7],
    "pressure_guard": [True, False],
    "pressure_abs_threshold_ms": [None, 0.0, 2.5, -1.0],
    "pressure_rel_threshold": [1.0, 1.5, 3.0],
    "cache_affinity_min_match_ratio": [None, 0.0, 0.5, 1.5],
    "cache_candidate_min_workers": [1, 8, 40],
}


@st.composite
def grid_values(draw):
    knobs = draw(st.lists(st.sampled_from(sorted(KNOB_POOLS)), min_size=1, max_size=4, unique=True))
    return {k: draw(st.lists(st.sampled_from(KNOB_POOLS[k]), min_size=1, max_size=4, unique=True)) for k in knobs}


def _outcome(values, **kw):
    try:
        g = Grid(values, **kw)
    except ConfigError as err:
        return ("error", str(err))
    return (g.configs, g.config_ids, g.skipped, g.describe(), g.rows())


@settings(max_examples=150, deadline=None)
@given(data=st.data(), values=grid_values())
def test_permuting_values_never_changes_configs_or_ids(data, values):
    permuted = {}
    for k in data.draw(st.permutations(list(values))):  # knob order too
        vals = data.draw(st.permutations(values[k]))
        extra = data.draw(st.lists(st.sampled_from(values[k]), max_size=2))  # duplicates
        permuted[k] = list(vals) + extra
    assert _outcome(permuted) == _outcome(values)
    dp = data.draw(st.integers(1, 3))
    assert _outcome(permuted, dp_size=dp) == _outcome(values, dp_size=dp)


@settings(max_examples=100, deadline=None)
@given(values=grid_values())
def test_grid_partitions_the_product_and_matches_validate(values):
    try:
        g = Grid(values)
    except ConfigError:
        return
    assert g.n_configs + len(g.skipped) == g.n_combinations
    assert g.config_ids == sorted(g.config_ids) and len(set(g.config_ids)) == g.n_configs
    for cfg in g.configs:
        cfg.validate()
    for knobs, err in g.skipped:
        with pytest.raises(ConfigError) as exc:
            RouterConfig(**knobs).validate()
        assert str(exc.value) == err


# per-dp-rank ---------------------------------------------------------------------------


def test_per_dp_rank_scaling():
    base = Grid({"worker_queue_limit": "2,4", "saturation_queue_floor": "none,1,3"})
    assert base.dp_size is None and all(r["per_rank_limit"] is None for r in base.rows())
    g = base.scaled_per_dp_rank(2)
    assert g.dp_size == 2
    built = Grid({"worker_queue_limit": "2,4", "saturation_queue_floor": "none,1,3"}, dp_size=2)
    assert built.configs == g.configs and built.config_ids == g.config_ids
    pairs = [(c.worker_queue_limit, c.saturation_queue_floor) for c in g.configs]
    assert pairs == [(4, None), (4, 2), (8, None), (8, 2), (8, 6)]
    rows = g.rows()
    assert [(r["per_rank_limit"], r["per_rank_floor"]) for r in rows] == [(2, None), (2, 1), (4, None), (4, 1), (4, 3)]
    assert all(r["dp_size"] == 2 for r in rows)
    assert [r["config_id"] for r in rows] == g.config_ids == base.config_ids
    # the refused per-rank floor 3 > limit 2 is reported with the router's text on fleet values
    assert [s.error for s in g.skipped] == [e_floor_gt(6, 4)]
    d = json.loads(json.dumps(g.describe(), allow_nan=False))
    assert d["per_dp_rank"] is True and d["dp_size"] == 2
    assert d["values"]["worker_queue_limit"] == [4, 8]
    assert d["values"]["saturation_queue_floor"] == [None, 2, 6]
    assert d["per_rank_values"] == {"worker_queue_limit": [2, 4], "saturation_queue_floor": [None, 1, 3]}
    assert d["skipped"][0]["per_rank_limit"] == 2 and d["skipped"][0]["per_rank_floor"] == 3
    arr = g.to_arrays()
    assert arr["worker_queue_limit"].tolist() == [4, 4, 8, 8, 8]
    assert arr["saturation_queue_floor"].tolist() == [-1, 2, -1, 2, 6]
    # dp 1 is the identity
    assert base.scaled_per_dp_rank(1).configs == base.configs


def test_per_dp_rank_zero_stays_refused():
    with pytest.raises(ConfigError) as exc:
        Grid({"worker_queue_limit": 0}, dp_size=4)
    assert str(exc.value) == E_LIMIT0


@pytest.mark.parametrize("dp", [0, -1, True, 1.5])
def test_per_dp_rank_needs_positive_int(dp):
    with pytest.raises(ConfigError, match="--per-dp-rank needs a dp_size of at least 1"):
        Grid({"worker_queue_limit": 2}, dp_size=dp)


def test_fleet_dp_size():
    assert fleet_dp_size([2, 2, 2]) == 2
    assert fleet_dp_size(np.array([4])) == 4
    with pytest.raises(ConfigError) as exc:
        fleet_dp_size([2, 1, 2])
    assert str(exc.value) == "--per-dp-rank needs one dp_size across the fleet, found 1, 2"
    with pytest.raises(ConfigError, match="at least one worker"):
        fleet_dp_size([])
    with pytest.raises(ConfigError, match="at least 1"):
        fleet_dp_size([0, 0])
