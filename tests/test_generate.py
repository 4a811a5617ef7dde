"""The synthetic generator: valid, deterministic, realistic shape; the generate command."""

from __future__ import annotations

import hashlib
import os
import pathlib

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

import replay
from replay import labels
from replay.cli import main
from replay.errors import NeedsForce
from replay.trace import load_trace
from replay.trace.synthetic import generate_trace

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "traces" / "generated-sample"


def test_round_trip_and_shape(tmp_path):
    info = generate_trace(tmp_path / "g", n_requests=5000, n_workers=8, dp_size=2, seed=11)
    t = load_trace(tmp_path / "g")
    assert t.n_requests == 5000 == info["requests"]
    assert t.load_ts.shape[0] == info["load_rows"]
    assert t.has_workers_table and t.fleet(0).shape[0] == 8
    assert (t.worker_role == labels.ROLE_DECODE).sum() == 1
    assert set(t.worker_dp_size.tolist()) == {2}
    # query_blocks = ceil(L / 512) where given
    qb = t.req_query_blocks
    given = qb > 0
    assert np.array_equal(qb[given], -(-t.req_input_tokens[given] // 512))
    # matches: up to 8 entries, provider order with non-increasing blocks (except zero entries)
    lens = np.diff(t.match_offsets)
    assert lens.max() <= 8 and (lens == 0).mean() > 0.05
    rows = np.repeat(np.arange(t.n_requests), lens)
    b = t.match_blocks
    same = rows[1:] == rows[:-1]
    nonzero = (b[1:] > 0) & (b[:-1] > 0)
    assert np.all(b[1:][same & nonzero] <= b[:-1][same & nonzero])
    assert (t.match_worker < 0).sum() > 0           # unknown addresses
    assert (b == 0).sum() > 0                        # zero-block entries
    # loads: tails mostly present, some absent, a few partial; ignored ranks; inflight
    assert 0.6 < t.load_has_tail.mean() < 0.99
    assert t.facts.load_rows_partial_tail > 0
    assert (t.load_router_inflight >= 0).mean() > 0.9
    assert t.req_selected_worker is not None and (t.req_selected_worker >= 0).mean() > 0.4
    # bursty queues: the whole fleet sometimes saturates (every rank waiting), mostly not
    df = pl.DataFrame({"s": t.load_ts // 10**9, "w": t.load_worker, "q": t.load_waiting})
    fleet = set(t.fleet(0).tolist())
    per_sec = (df.filter(pl.col("w").is_in(list(fleet))).group_by("s")
               .agg(pl.col("q").min().alias("mn"), pl.col("q").median().alias("med")))
    assert (per_sec["mn"] >= 1).any()
    assert (per_sec["med"] <= 1).mean() > 0.3
    # stale gaps: some publisher is silent for > 5 s
    gaps = []
    for key in np.unique(t.load_worker * 16 + t.load_rank):
        ts = t.load_ts[(t.load_worker * 16 + t.load_rank) == key]
        gaps.append(np.diff(ts).max() if ts.size > 1 else 0)
    assert max(gaps) > 5 * 10**9


def test_deterministic_per_seed(tmp_path):
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        generate_trace(tmp_path / name, n_requests=1000, n_workers=4, dp_size=1, seed=seed)
    a, b, c = (load_trace(tmp_path / n) for n in "abc")
    for f in ("req_ts", "match_worker", "match_blocks", "load_ts", "load_waiting", "load_has_tail"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert not np.array_equal(a.req_ts, c.req_ts)


def test_edge_sizes(tmp_path):
    generate_trace(tmp_path / "z", n_requests=0, n_workers=1, dp_size=1, seed=0)
    assert load_trace(tmp_path / "z").n_requests == 0
    generate_trace(tmp_path / "m", n_requests=300, n_workers=3, dp_size=4, max_matches=0,
                   sample_interval_ms=250, seed=1)
    t = load_trace(tmp_path / "m")
    assert t.match_worker.size == 0 and set(t.load_rank.tolist()) <= {0, 1, 2, 3, 4}


def test_generate_command(tmp_path):
    out = tmp_path / "out"
    args = ["generate", str(out), "--requests", "500", "--workers", "4", "--dp-size", "2",
            "--sample-interval-ms", "200", "--max-matches", "4", "--seed", "3"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(out)) == ["loads.parquet", "requests.parquet", "trace.json", "workers.parquet"]
    res = CliRunner().invoke(main, args)                 # non-empty: refused
    assert res.exit_code == 2 and "--force" in res.output and len(res.output.strip().splitlines()) == 1
    res = CliRunner().invoke(main, args + ["--force"])
    assert res.exit_code == 0
    assert CliRunner().invoke(main, ["validate", str(out)]).exit_code == 0


def test_the_library_call_writes_the_command_s_bytes_and_refuses_alike(tmp_path):
    """``replay.generate_trace_dir`` is the command: the same files byte for byte (trace and trace
    set), the same refusal of an existing trace without force, and force replaces only a trace
    generate wrote."""
    kw = dict(n_requests=400, n_workers=3, dp_size=2, sample_interval_ms=200, max_matches=4, seed=5)
    flags = ["--requests", "400", "--workers", "3", "--dp-size", "2", "--sample-interval-ms", "200",
             "--max-matches", "4", "--seed", "5"]
    for extra, part in (([], None), (["--partition-s", "1"], 1)):
        lib, cli = tmp_path / f"lib{part}", tmp_path / f"cli{part}"
        replay.generate_trace_dir(lib, partition_s=part, **kw)
        assert CliRunner().invoke(main, ["generate", str(cli), *flags, *extra]).exit_code == 0
        assert digest_all(lib) == digest_all(cli) and len(digest_all(lib)) >= 4
    with pytest.raises(NeedsForce, match="force=True"):
        replay.generate_trace_dir(tmp_path / "libNone", **kw)
    replay.generate_trace_dir(tmp_path / "libNone", force=True, **dict(kw, seed=6))
    assert digest_all(tmp_path / "libNone") != digest_all(tmp_path / "cliNone")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(NeedsForce, match="replaces only a trace directory router-replay wrote"):
        replay.generate_trace_dir(mine, force=True, **kw)
    assert os.listdir(mine) == ["notes.txt"]


def digest_all(d: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def test_committed_sample_matches_its_regeneration_command(tmp_path):
    # traces/README.md: router-replay generate traces/generated-sample --requests 3000 --workers 8 --dp-size 2
    #                   --sample-interval-ms 100 --max-matches 8 --seed 7
    res = CliRunner().invoke(main, ["generate", str(tmp_path / "s"), "--requests", "3000", "--workers", "8",
                                    "--dp-size", "2", "--sample-interval-ms", "100", "--max-matches", "8",
                                    "--seed", "7"])
    assert res.exit_code == 0, res.output
    a, b = load_trace(SAMPLE), load_trace(tmp_path / "s")
    for f in ("request_id", "req_ts", "req_input_tokens", "match_offsets", "match_worker", "match_blocks",
              "load_ts", "load_worker", "load_waiting", "load_has_tail", "load_prefill_busy_us",
              "hash_offsets", "hash_values", "req_output_tokens"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert sum(os.path.getsize(SAMPLE / n) for n in os.listdir(SAMPLE)) < 1 << 20


def test_sizes_that_cannot_fit_in_memory_are_refused_first(tmp_path):
    """Output and input bounds: ``--workers 10**7`` used to try a 90 GiB allocation.  Every
    oversize request is one line, exit 2, in well under a second, nothing written."""
    from replay.trace.synthetic import MAX_PART_LOAD_ROWS, MAX_PART_REQUESTS

    cases = [
        (["--workers", str(10**7)], "12,000,002,400 load rows in one file, above the "
                                    f"{MAX_PART_LOAD_ROWS:,} one file may hold in memory"),
        (["--workers", "100000", "--partition-s", "3600"], "or a smaller --partition-s"),
        (["--requests", str(MAX_PART_REQUESTS + 1), "--workers", "1", "--sample-interval-ms", "100000"],
         f"{MAX_PART_REQUESTS + 1:,} requests in one file"),
        (["--dp-size", "1025"], "--dp-size 1025 is above 1024, the largest dp_size a trace may have"),
    ]
    for args, text in cases:
        out = tmp_path / "out"
        res = CliRunner().invoke(main, ["generate", str(out), *args])
        assert res.exit_code == 2, (args, res.output)
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: generate: ") and text in lines[0], lines
        assert not out.exists()
    # the largest accepted dp_size writes a trace validate accepts
    res = CliRunner().invoke(main, ["generate", str(tmp_path / "dp"), "--requests", "50", "--workers", "1",
                                    "--dp-size", "1024", "--sample-interval-ms", "5000"])
    assert res.exit_code == 0, res.output
    assert CliRunner().invoke(main, ["validate", str(tmp_path / "dp")]).exit_code == 0
