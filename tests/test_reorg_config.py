"""The reorg engine's knobs and the router's checks for them (ROUTER_REORG.md section 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from replay.cli.app import main
from replay.config import Grid, RouterConfig, parse_router_command_line, validate_router_flags
from replay.errors import ConfigError

SPEC = Path(__file__).resolve().parents[1] / ".." / "shared" / "spec" / "scenarios_reorg.json"


def _refusal(args: dict) -> str | None:
    try:
        validate_router_flags(args)
    except ConfigError as err:
        return str(err)
    return None


def test_factory_and_flag_checks_have_the_router_texts_in_order():
    assert _refusal({"chat_routing": "reorg"}) is None
    assert _refusal({"chat_routing": "reorg", "power_of_n_choices": 4, "max_in_flight": 2}) is None
    assert _refusal({"power_of_n_choices": 4}) == "--power-of-n-choices requires --chat-routing reorg"
    assert "--power-of-n-choices" in _refusal({"chat_routing": "reorg", "power_of_n_choices": 0})
    assert _refusal({"chat_routing": "reorg", "min_load_choices": 3}) == (
        "reorg cache fallback requires --min-load-choices 2")
    # the legacy builders run first: their refusal wins over the factory's
    assert _refusal({"chat_routing": "reorg", "min_load_choices": 0}) == "--min-load-choices must be at least 1"
    assert _refusal({"chat_routing": "reorg", "min_load_choices": 3, "worker_queue_limit": 0}) == (
        "--worker-queue-limit must be at least 1")
    assert _refusal({"min_load_choices": 3}) is None  # legacy keeps its sampler


def test_scenario_cli_cases_the_knobs_reach():
    cases = {s["id"]: s for s in json.loads(SPEC.read_text())}["rg-cli-01"]["cases"]
    by_args = {c["args"].split("30000", 1)[1].strip(): c for c in cases}
    refused = by_args["--power-of-n-choices 4"]
    assert _refusal({"power_of_n_choices": 4}) == refused["exact"]
    zero = by_args["--chat-routing reorg --power-of-n-choices 0"]
    assert zero["error_contains"] in _refusal({"chat_routing": "reorg", "power_of_n_choices": 0})
    assert by_args["--chat-routing reorg --policy power_of_n --power-of-n-choices 4"]["ok"]
    assert _refusal({"chat_routing": "reorg", "power_of_n_choices": 4}) is None


def test_grid_sweeps_both_engines_and_skips_refused_combinations_with_the_routers_text():
    g = Grid({"chat_routing": "legacy,reorg", "min_load_choices": "2,3", "power_of_n_choices": "none,4"})
    got = {(c.chat_routing, c.min_load_choices, c.power_of_n_choices) for c in g.configs}
    assert got == {("legacy", 2, None), ("legacy", 3, None), ("reorg", 2, None), ("reorg", 2, 4)}
    errors = sorted({s.error for s in g.skipped})
    assert errors == ["--power-of-n-choices requires --chat-routing reorg",
                      "reorg cache fallback requires --min-load-choices 2"]
    assert len(g.skipped) == 4


def test_variants_apply_to_one_engine_only():
    g = Grid({"chat_routing": "legacy,reorg", "pin_order": "pressure,locality",
              "reorg_ranking": "power-of-n,power-of-n-fold,power-of-two"})
    got = {(c.chat_routing, c.variant_pin_order, c.variant_reorg_ranking) for c in g.configs}
    assert got == {("legacy", "pressure", "power-of-n"), ("legacy", "locality", "power-of-n"),
                   ("reorg", "pressure", "power-of-n"), ("reorg", "pressure", "power-of-n-fold"),
                   ("reorg", "pressure", "power-of-two")}
    with pytest.raises(ConfigError, match="power-of-two revision"):
        RouterConfig(chat_routing="reorg", power_of_n_choices=3, variant_reorg_ranking="power-of-two").validate()
    with pytest.raises(ConfigError, match="--max-in-flight only under --chat-routing reorg"):
        RouterConfig(max_in_flight=4).validate()


def test_router_command_line_takes_the_reorg_flags():
    assert parse_router_command_line("--chat-routing reorg --power-of-n-choices 4 --max-in-flight 3") == {
        "chat_routing": "reorg", "power_of_n_choices": 4, "max_in_flight": 3}
    with pytest.raises(ConfigError, match="requires --chat-routing reorg"):
        parse_router_command_line("--power-of-n-choices 4")


def test_sweep_cli_refuses_a_bad_engine_name_in_one_line(tmp_path):
    (tmp_path / "t").mkdir()
    res = CliRunner().invoke(main, ["sweep", str(tmp_path / "t"), "--out", str(tmp_path / "o"),
                                    "--chat-routing", "legacy,fancy"])
    assert res.exit_code == 2, res.output
    assert "--chat-routing" in res.output and "Traceback" not in res.output


def test_recommended_flags_are_a_deployable_reorg_command_line():
    from replay.analysis.ranking import deploy_flags

    row = {**RouterConfig(chat_routing="reorg", max_in_flight=4, worker_queue_limit=8).as_dict(), "config_id": 3}
    flags = deploy_flags(row)
    assert flags == "--worker-queue-limit 8 --chat-routing reorg --filter overloaded --max-in-flight 4"
    # read back as a production command line (the filter is implied by the cap)
    assert parse_router_command_line(flags.replace("--filter overloaded ", "")) == {
        "worker_queue_limit": 8, "chat_routing": "reorg", "max_in_flight": 4}
    ranked = {**RouterConfig(chat_routing="reorg", variant_reorg_ranking="power-of-two").as_dict(), "config_id": 1}
    assert deploy_flags(ranked) is None   # a replay-only variant is not deployable
