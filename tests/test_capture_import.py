"""``router-replay import`` on a fixture fleet: matches equal an independent slow computation."""

from __future__ import annotations

import gzip
import json

import polars as pl
import pytest
from capture_fixture import PAGE, build, slow_matches, spec_hashes
from click.testing import CliRunner

from replay.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    return build(tmp_path_factory.mktemp("fleet"))


def import_args(fx, out, *extra):
    args = ["import", "--out", out, "--token-export", fx.token_dir, "--recorded", fx.recorded]
    for url, d in fx.engine_dirs.items():
        args += ["--engine-export", f"{url}={d}"]
    return [*args, *extra]


@pytest.fixture(scope="module")
def shuffled_fleet(tmp_path_factory):
    return build(tmp_path_factory.mktemp("fleet9"), kv_parts=9)


@pytest.mark.parametrize("lag_ms,layout", [(0, "two parts"), (3, "two parts"), (3, "nine shuffled parts")])
def test_import_matches_equal_slow_truth(fleet, shuffled_fleet, tmp_path, lag_ms, layout):
    if layout != "two parts":
        fleet = shuffled_fleet
    out = tmp_path / "trace"
    res = run(*import_args(fleet, out, "--index-lag-ms", lag_ms))
    assert res.exit_code == 0, res.output
    req = pl.read_parquet(out / "requests.parquet")
    truth = slow_matches(fleet, lag_ms * 1_000_000)
    assert req.height == len(fleet.requests)
    got = {r["request_id"]: [(m["worker"], m["blocks"]) for m in r["matches"]] for r in req.iter_rows(named=True)}
    assert got == truth
    assert sum(1 for v in truth.values() if v) > 50          # the fixture exercises real matches
    assert sum(1 for v in truth.values() if len(v) > 1) > 5   # and several workers per request
    # hash_ids and query_blocks, from the independent hash
    by_id = {r["rid"]: r for r in fleet.requests}
    for row in req.head(40).iter_rows(named=True):
        r = by_id[row["request_id"]]
        assert row["hash_ids"] == spec_hashes(r["tokens"], PAGE, r["salt"])
        assert row["query_blocks"] == -(-len(r["tokens"]) // PAGE)
        assert row["input_tokens"] == len(r["tokens"])
        assert row["best_prefix_blocks"] == max([b for _, b in got[row["request_id"]]], default=0)
    assert req["ts"].is_sorted()


def test_import_join_coverage_and_validate(fleet, tmp_path):
    out = tmp_path / "trace"
    res = run(*import_args(fleet, out))
    assert res.exit_code == 0, res.output
    assert "warning: " in res.output and "1 engine records have no router record" in res.output
    info = json.loads((out / "trace.json").read_text())
    f = info["extra"]["capture"]
    served = [r for r in fleet.requests if r["worker"] is not None and r["rid"] != "router-00007"]
    assert f["requests_without_engine_record"] == len(fleet.requests) - len(served)
    assert f["engine_records_without_router_record"] == 1
    assert f["engine_records_without_router_record_examples"] == ["router-orphan"]
    assert f["token_export_non_ingest_records"] == sum(1 for k in range(len(fleet.requests)) if k % 37 == 0)
    assert f["matches_source"] == "kv_events" and f["matches_exact"] is True
    assert info["page_size"] == PAGE
    req = pl.read_parquet(out / "requests.parquet")
    urls = sorted(u for u, _ in fleet.workers)
    for row in req.iter_rows(named=True):
        r = next(x for x in fleet.requests if x["rid"] == row["request_id"])
        if r in served:
            assert row["selected_worker"] == fleet.workers[r["worker"]][0]
            assert row["output_tokens"] == r["out"] and row["cached_tokens"] == r["cached"]
            assert row["latency_ms"] == pytest.approx(1000 * (0.25 + r["out"] / 100))
        else:
            assert row["selected_worker"] is None
            assert row["cached_tokens"] is None and row["latency_ms"] is None
    wk = pl.read_parquet(out / "workers.parquet")
    assert wk["worker"].to_list() == urls and wk["model"].to_list() == ["m1"] * 3
    assert wk["dp_size"].to_list() == [2, 2, 1]   # sorted URL order: .1, .10, .2
    v = run("validate", out)
    assert v.exit_code == 0, v.output
    assert "OK" in v.output.splitlines()[0]
    assert "capture: requests from router token export; matches: kv_events" in v.output
    assert (f"capture coverage: requests without engine record: {len(fleet.requests) - len(served)}, "
            "engine records without router record: 1") in v.output
    vj = json.loads(run("validate", out, "--json").output)
    assert vj["capture"]["engine_records_without_router_record"] == 1
    s = run("sweep", out, "--out", tmp_path / "run", "--worker-queue-limit", "none,2", "--no-report")
    assert s.exit_code == 0, s.output
    summary = pl.read_parquet(tmp_path / "run" / "summary.parquet")
    assert summary.height == 2 and summary["requests"].to_list() == [len(fleet.requests)] * 2
    assert summary["matched_rate"][0] > 0
    # the loads/ folder streams too: a windowed sweep decides exactly as the in-memory one
    s = run("sweep", out, "--out", tmp_path / "run-w", "--worker-queue-limit", "none,2", "--no-report",
            "--window", "5s")
    assert s.exit_code == 0, s.output
    assert pl.read_parquet(tmp_path / "run-w" / "summary.parquet").equals(summary)


def test_import_truncated_gzip_keeps_complete_lines(fleet, tmp_path):
    import shutil

    src = tmp_path / "export"
    shutil.copytree(fleet.token_dir, src)
    files = sorted(src.rglob("*.ndjson.gz"))
    victim = files[0]
    n_lines = len(gzip.decompress(victim.read_bytes()).splitlines())
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) * 2 // 3])
    out = tmp_path / "trace"
    args = import_args(fleet, out)
    args[args.index(str(fleet.token_dir)) if str(fleet.token_dir) in args else args.index(fleet.token_dir)] = src
    res = run(*args)
    assert res.exit_code == 0, res.output
    assert f"{victim}: truncated" in res.output
    f = json.loads((out / "trace.json").read_text())["extra"]["capture"]
    assert f["truncated_files"] == 1
    req = pl.read_parquet(out / "requests.parquet")
    lost = len(fleet.requests) - req.height
    assert 0 < lost < n_lines
    assert run("validate", out).exit_code == 0


def test_import_malformed_line(fleet, tmp_path):
    import shutil

    src = tmp_path / "export"
    shutil.copytree(fleet.token_dir, src)
    victim = sorted(src.rglob("*.ndjson.gz"))[1]
    lines = gzip.decompress(victim.read_bytes()).decode().splitlines()
    lines.insert(3, '{"kind": "ingest", "request_id": "x", "input_ids": [1, 2,')
    victim.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    out = tmp_path / "trace"
    args = ["import", "--out", out, "--token-export", src, "--recorded", fleet.recorded]
    res = run(*args)
    assert res.exit_code == 2
    line = res.output.strip()
    assert "\n" not in line
    assert line.startswith(f"error: {victim}: line 4: malformed token export record (Expecting value")
    assert line.endswith("use --skip-bad-lines to count and skip such lines")
    assert not out.exists()
    res = run(*args, "--skip-bad-lines")
    assert res.exit_code == 0, res.output
    f = json.loads((out / "trace.json").read_text())["extra"]["capture"]
    assert f["skipped_bad_lines"] == 1
    assert pl.read_parquet(out / "requests.parquet").height == len(fleet.requests)


def test_import_placement_model_is_labelled_approximate(fleet, tmp_path):
    out = tmp_path / "trace"
    res = run(*import_args(fleet, out, "--matches", "placement"))
    assert res.exit_code == 0, res.output
    f = json.loads((out / "trace.json").read_text())["extra"]["capture"]
    assert f["matches_source"] == "placement model (approximate)" and f["matches_exact"] is False
    assert "approximate" in res.output
    req = pl.read_parquet(out / "requests.parquet")
    # the model is not the indexer: on this fleet (random ranks, removals, clears) it must disagree somewhere
    truth = slow_matches(fleet)
    got = {r["request_id"]: [(m["worker"], m["blocks"]) for m in r["matches"]] for r in req.iter_rows(named=True)}
    assert got != truth
    assert sum(1 for v in got.values() if v) > 0
    assert run("validate", out).exit_code == 0


def test_import_refuses_out_inside_input_and_two_sources(fleet, tmp_path):
    res = run(*import_args(fleet, fleet.recorded / "trace"))
    assert res.exit_code == 2 and "lies inside an input of this command" in res.output
    res = run("import", "--out", tmp_path / "t", "--token-export", fleet.token_dir, "--mooncake", fleet.token_dir)
    assert res.exit_code == 2 and "exactly one request source" in res.output


def test_import_repeated_request_id_keeps_the_first(fleet, tmp_path):
    import shutil

    src = tmp_path / "export"
    shutil.copytree(fleet.token_dir, src)
    files = sorted(src.rglob("*.ndjson.gz"))
    first = json.loads(gzip.decompress(files[0].read_bytes()).splitlines()[0])
    dup = dict(first, input_ids=[9, 9, 9], ts=first["ts"])
    last = files[-1]
    last.write_bytes(gzip.compress(gzip.decompress(last.read_bytes()) + (json.dumps(dup) + "\n").encode()))
    out = tmp_path / "trace"
    res = run("import", "--out", out, "--token-export", src, "--recorded", fleet.recorded)
    assert res.exit_code == 0, res.output
    assert "1 request records repeat an earlier request_id" in res.output
    req = pl.read_parquet(out / "requests.parquet")
    assert req.height == len(fleet.requests)
    row = req.filter(pl.col("request_id") == first["request_id"]).row(0, named=True)
    assert row["input_tokens"] == len(first["input_ids"])
    assert row["hash_ids"] == spec_hashes(first["input_ids"], PAGE, first.get("cache_salt"))
    f = json.loads((out / "trace.json").read_text())["extra"]["capture"]
    assert f["duplicate_request_records_dropped"] == 1 and f["duplicate_request_id_examples"] == [first["request_id"]]
