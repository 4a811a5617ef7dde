"""Library refusals name the call's parameters; the commands name their flags.

Each case calls the library as a Python user would and checks the refusal's text names the
parameter and no command-line flag, then that the text the CLI prints (``cli_text``, what
``user_errors`` shows) names the flag in the same sentence.  A case where the command is run
checks the line it prints.
"""

from __future__ import annotations

import re

import pytest
from test_nothing_lost import invoke, refused

from replay.analysis.recommend import recommend_dir
from replay.capture.importer import ImportSpec, import_capture
from replay.capture.recorder import Recorder
from replay.errors import NeedsForce, ParamError, ParamsError, ReplayError
from replay.simulate import generate_log
from replay.simulate.benchfit import calibrate_bench_file
from replay.simulate.formats import read_log
from replay.simulate.plan import scale_log
from replay.sweep.pool import probe_ray_address
from replay.trace.synthetic import generate_trace

FLAG = re.compile(r"(?<![\w-])--[a-z]")
QUOTED = re.compile(r"`[^`]*`")   # another program's command line (`ray start --head`) is quoted


def refusal(call, *args, **kwargs) -> ReplayError:
    with pytest.raises(ReplayError) as err:
        call(*args, **kwargs)
    assert isinstance(err.value, (ParamError, ParamsError, NeedsForce)), type(err.value)
    assert not FLAG.search(QUOTED.sub("", str(err.value))), str(err.value)
    return err.value


def test_a_load_scale_names_factor(tmp_path):
    err = refusal(scale_log, generate_log(20, seed=1), 0.0)
    assert str(err) == "factor must be in (0, 64], got 0.0"
    assert err.cli_text() == "--load-scale must be in (0, 64], got 0.0"


def test_session_options_name_their_parameters(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n')
    err = refusal(read_log, log, sessions=2)
    assert str(err) == "sessions and session_rate apply to kv-cache-tester sessions, not a mooncake log"
    assert err.cli_text() == "--sessions and --session-rate apply to kv-cache-tester sessions, not a mooncake log"


def test_a_recorder_without_workers_names_urls(tmp_path):
    err = refusal(Recorder, [], tmp_path / "rec")
    assert str(err) == "no worker given (use urls)"
    assert err.cli_text() == "no worker given (use --worker URL or --workers-file FILE)"


def test_an_import_without_a_request_source_names_the_spec_fields(tmp_path):
    err = refusal(import_capture, ImportSpec(out=tmp_path / "trace"))
    assert str(err) == "give exactly one request source: token_export, dynamo or mooncake"
    assert err.cli_text() == "give exactly one request source: --token-export, --dynamo-trace or --mooncake"
    refused(invoke("import", "--out", tmp_path / "t2"), "give exactly one request source: --token-export, "
                                                        "--dynamo-trace or --mooncake")
    assert not (tmp_path / "trace").exists() and not (tmp_path / "t2").exists()


def test_generate_names_dp_size(tmp_path):
    err = refusal(generate_trace, tmp_path / "t", n_requests=10, n_workers=2, dp_size=1025)
    assert str(err).startswith("generate: dp_size 1025 is above 1024")
    assert err.cli_text().startswith("generate: --dp-size 1025 is above 1024")


def test_an_existing_fleet_file_needs_force(tmp_path):
    out = tmp_path / "fleet.toml"
    out.write_text("# mine\n")
    bench = tmp_path / "bench.jsonl"
    bench.write_text('{"input_lens": [100], "output_lens": [10], "ttfts": [0.1], "itls": [[0.01]]}\n')
    err = refusal(calibrate_bench_file, bench, out)
    assert "force=True" in str(err) and "--force" in err.cli_text()
    assert out.read_text() == "# mine\n"


def test_a_ray_address_with_nothing_behind_it_names_address():
    err = refusal(probe_ray_address, "127.0.0.1:1", timeout=2.0)
    assert str(err).startswith("address 127.0.0.1:1: nothing listens there")
    assert str(err).endswith("or drop address for a local Ray)")
    assert err.cli_text().startswith("--ray-address 127.0.0.1:1: nothing listens there")
    assert err.cli_text().endswith("or drop --ray-address for a local Ray)")


def test_a_plan_s_flags_are_named_by_the_parameter_that_asks_for_them(tmp_path):
    err = refusal(recommend_dir, tmp_path, plan=True, emit_flags=True, max_ttft_p99_ms=1000.0)
    assert str(err) == ("emit_flags applies to a config recommendation, not plan (a plan answers per traffic "
                        "level; its flags are in as_json)")
    assert err.cli_text() == ("--emit-flags applies to a config recommendation, not --plan (a plan answers per "
                              "traffic level; its flags are in --json)")
