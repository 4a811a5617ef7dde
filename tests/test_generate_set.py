"""The trace-set generator (``generate_trace_set``, ``generate --partition-s``): real files on disk."""

from __future__ import annotations

import pathlib
import shutil

import polars as pl
import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from replay.cli import main
from replay.trace import load_trace
from replay.trace.synthetic import NS, generate_trace_set, plan_trace_set

# 22:00 UTC on 2026-01-01: three hourly partitions cross midnight
START = 1_767_225_600 * NS + 22 * 3600 * NS
# 3000 requests at 0.3/s span 10,000 s: 3600 + 3600 + 2800 s; loads every 5 s keep the files small
KW = dict(n_requests=3000, n_workers=3, dp_size=2, sample_interval_ms=5000, max_matches=4, seed=4,
          rate_per_s=0.3, partition_s=3600, start_ns=START)
NAMES = ["date=2026-01-01/part-22.parquet", "date=2026-01-01/part-23.parquet",
         "date=2026-01-02/part-00.parquet"]


def parquet_files(root: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.parquet"))


def read_all(root: pathlib.Path, sub: str) -> pl.DataFrame:
    """Every Parquet file under ``root/sub`` in sorted path order, concatenated
    (hive ``date`` from the path), as the trace-set reader does."""
    files = sorted(str(p) for p in (root / sub).rglob("*.parquet"))
    table = ds.dataset(files, format="parquet", partitioning="hive",
                       partition_base_dir=str(root / sub)).to_table()
    return pl.from_arrow(table)


@pytest.fixture(scope="module")
def trace_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("set") / "s"
    calls = []
    info = generate_trace_set(out, progress=calls.append, **KW)
    return out, info, calls


def test_layout_and_summary(trace_set):
    out, info, calls = trace_set
    assert parquet_files(out) == (["loads/" + n for n in NAMES] + ["requests/" + n for n in NAMES]
                                  + ["workers.parquet"])
    assert calls == [1, 2, 3]
    assert info["partitions"] == 3 and info["files"] == 7 and info["span_s"] == 10_000
    assert info["requests"] == 3000 and info["workers"] == 3 and info["dp_size"] == 2
    assert info["load_rows"] == read_all(out, "loads").height
    assert [p.name for p in plan_trace_set(3000, rate_per_s=0.3, start_ns=START)] == NAMES


def test_requests_concatenate_to_the_whole_trace(trace_set):
    out, _, _ = trace_set
    req = read_all(out, "requests")
    assert req.height == 3000
    assert req["request_id"].n_unique() == 3000
    assert req["ts"].is_sorted()                 # sorted path order is time order
    assert req["date"].unique().sort().to_list() == ["2026-01-01", "2026-01-02"]
    parts = plan_trace_set(3000, rate_per_s=0.3, start_ns=START)
    assert [p.n_requests for p in parts] == [1080, 1080, 840]      # proportional to 3600/3600/2800 s
    ids = set()
    for p in parts:
        r = pl.read_parquet(out / "requests" / p.name)
        assert r.height == p.n_requests
        assert r["ts"].min() >= p.start_ns and r["ts"].max() < p.end_ns
        assert r["ts"].is_sorted()
        assert r["request_id"].str.starts_with(f"p{p.index:04d}-").all()
        ids |= set(r["request_id"].to_list())
    assert len(ids) == 3000


def test_loads_cover_every_partition(trace_set):
    out, _, _ = trace_set
    workers = pl.read_parquet(out / "workers.parquet")
    interval = KW["sample_interval_ms"] * 1_000_000
    for p in plan_trace_set(3000, rate_per_s=0.3, start_ns=START):
        ld = pl.read_parquet(out / "loads" / p.name)
        assert ld["ts"].min() >= p.start_ns and ld["ts"].max() < p.end_ns
        assert ld["ts"].min() < p.start_ns + interval and ld["ts"].max() >= p.end_ns - 2 * interval
        # every publisher (prefill and decode workers, every rank) publishes in every partition
        assert set(ld["worker"].unique().to_list()) == set(workers["worker"].to_list())
        assert ld.filter(pl.col("dp_rank") < 2).select("worker", "dp_rank").unique().height == 4 * 2


def test_prefill_counters_stay_monotonic_across_partitions(trace_set):
    out, _, _ = trace_set
    ld = read_all(out, "loads").filter(pl.col("dp_rank") < 2)     # stray ranks carry another rank's values
    for col in ("total_prefill_uncached_tokens", "total_prefill_busy_us"):
        d = (ld.filter(pl.col(col).is_not_null()).sort("ts", maintain_order=True)
             .select(pl.col(col).diff().over("worker", "dp_rank").alias("d")))
        assert d["d"].drop_nulls().min() >= 0, col


def test_each_partition_is_a_valid_trace(trace_set, tmp_path):
    out, _, _ = trace_set
    for p in plan_trace_set(3000, rate_per_s=0.3, start_ns=START):
        one = tmp_path / f"p{p.index}"
        one.mkdir()
        shutil.copy(out / "requests" / p.name, one / "requests.parquet")
        shutil.copy(out / "loads" / p.name, one / "loads.parquet")
        shutil.copy(out / "workers.parquet", one / "workers.parquet")
        t = load_trace(one)
        assert t.n_requests == p.n_requests and t.fleet(0).shape[0] == 3


def test_deterministic_per_seed(trace_set, tmp_path):
    out, _, _ = trace_set
    generate_trace_set(tmp_path / "again", **KW)
    generate_trace_set(tmp_path / "other", **{**KW, "seed": 5})
    files = parquet_files(out)
    assert parquet_files(tmp_path / "again") == files == parquet_files(tmp_path / "other")
    for f in files:
        assert (out / f).read_bytes() == (tmp_path / "again" / f).read_bytes(), f
    for f in files:
        if f != "workers.parquet":
            assert (out / f).read_bytes() != (tmp_path / "other" / f).read_bytes(), f


def test_partition_names():
    day = 1_767_225_600 * NS
    # a partition length that does not divide a day: a running index under the date of each start
    parts = plan_trace_set(3000, rate_per_s=0.02, partition_s=50_000, start_ns=day)
    assert [p.name for p in parts] == ["date=2026-01-01/part-00000.parquet", "date=2026-01-01/part-00001.parquet",
                                       "date=2026-01-02/part-00002.parquet"]
    assert [(p.n_sec, p.n_requests) for p in parts] == [(50_000, 1000)] * 3
    # quarter hours: 96 a day, two digits (23:30 is quarter 94); minutes: 1440 a day, four digits
    parts = plan_trace_set(1000, rate_per_s=1, partition_s=900, start_ns=day + 86_400 * NS - 1800 * NS)
    assert [p.name for p in parts] == ["date=2026-01-01/part-94.parquet", "date=2026-01-01/part-95.parquet"]
    parts = plan_trace_set(100, rate_per_s=1, partition_s=60, start_ns=day)
    assert [p.name for p in parts] == ["date=2026-01-01/part-0000.parquet", "date=2026-01-01/part-0001.parquet"]
    assert [(p.n_sec, p.n_requests) for p in parts] == [(60, 60), (40, 40)]
    # exact total for awkward splits
    for n in (0, 1, 7, 9_999):
        parts = plan_trace_set(n, rate_per_s=0.37, partition_s=700)
        assert sum(p.n_requests for p in parts) == n and all(p.n_requests >= 0 for p in parts)
    with pytest.raises(ValueError):
        plan_trace_set(10, partition_s=0)


def test_cli_writes_what_the_library_writes(trace_set, tmp_path):
    out, _, _ = trace_set
    cli_out = tmp_path / "cli"
    args = ["generate", str(cli_out), "--requests", "3000", "--workers", "3", "--dp-size", "2",
            "--sample-interval-ms", "5000", "--max-matches", "4", "--seed", "4", "--rate", "0.3",
            "--partition-s", "3600"]
    # the CLI starts at the default time (midnight), so compare with a library call from midnight
    lib_out = tmp_path / "lib"
    info = generate_trace_set(lib_out, **{k: v for k, v in KW.items() if k != "start_ns"})
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "3,000 requests" in lines[0] and "3 partition(s)" in lines[0]
    assert f"{info['load_rows']:,} load rows" in lines[0]
    files = parquet_files(lib_out)
    assert parquet_files(cli_out) == files
    assert files[0] == "loads/date=2026-01-01/part-00.parquet"
    for f in files:
        assert (cli_out / f).read_bytes() == (lib_out / f).read_bytes(), f
    # non-empty: refused; --force rewrites, and a smaller set leaves no stale partition behind
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "--force" in res.output
    (cli_out / "requests.parquet").write_bytes(b"stale single-layout file")
    res = CliRunner().invoke(main, args[:3] + ["1000"] + args[4:] + ["--force"])
    assert res.exit_code == 0, res.output
    assert parquet_files(cli_out) == ["loads/date=2026-01-01/part-00.parquet",
                                      "requests/date=2026-01-01/part-00.parquet", "workers.parquet"]
    assert pl.read_parquet(cli_out / "requests" / "date=2026-01-01" / "part-00.parquet").height == 1000
