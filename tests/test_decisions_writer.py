"""decisions.parquet's ``long`` layout, written from its runs.

``replay/runs/flat_parquet.py`` writes the long table without pyarrow's writer.
Held here: the file reads back exactly as the Arrow table earlier versions
wrote through ``pq.ParquetWriter`` (``DecisionWriter.long_table``, the
reference; ``pl.read_parquet`` and pyarrow, dtypes, values and order), on
real chunks of generated traces with int and string request ids, several row
groups and an empty run; the footer's statistics that readers prune with
(``decision_store.file_info``, polars' predicate pushdown) are right; the
writer's own encoders against plain Python on hypothesis-drawn columns; and a
writer that fails, in the sweep's background thread or mid-chunk, fails the
replay and leaves no file that reads as complete.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from replay.cli import main
from replay.config import Grid
from replay.runs import decisions as decision_store
from replay.runs import flat_parquet as fp
from replay.sweep import executors
from replay.sweep.engine import Chunk, iter_chunks
from replay.sweep.results import DecisionWriter
from replay.trace import load_trace

GRID = {"--worker-queue-limit": "none,1,2,4", "--saturation-queue-floor": "none,1,2"}


def replayed(trace_dir, chunk_decisions: int):
    trace = load_trace(trace_dir)
    grid = Grid.from_texts(GRID)
    return trace, grid, list(iter_chunks(trace, grid.configs, seed=0, chunk_decisions=chunk_decisions))


def write_both(tmp_path, trace, grid, chunks):
    """The file the writer writes, and the reference: its Arrow tables through pyarrow."""
    new, old = tmp_path / "new.parquet", tmp_path / "old.parquet"
    w = DecisionWriter(str(new), trace, grid.config_ids)
    ref = DecisionWriter(str(old), trace, grid.config_ids)
    tables = [ref.long_table(c) for c in chunks] or [ref.long_table(_empty(grid))]
    with pq.ParquetWriter(str(old), tables[0].schema, compression="zstd", store_schema=False) as pw:
        for t in tables:
            pw.write_table(t)
    for c in chunks:
        w.write(c)
    w.close()
    return new, old


def _empty(grid) -> Chunk:
    from replay.kernels import layout as kl

    n = len(grid.config_ids)
    return Chunk(0, 0, np.zeros((kl.O_NCOLS, 0, n), np.int64), np.zeros((kl.F_NCOLS, 0, n), np.float64))


@pytest.mark.parametrize("which", ["gen_trace", "models_trace"])
@pytest.mark.parametrize("chunk_decisions", [1 << 20, 997])
def test_long_file_reads_as_the_arrow_table(which, chunk_decisions, request, tmp_path):
    trace, grid, chunks = replayed(request.getfixturevalue(which), chunk_decisions)
    new, old = write_both(tmp_path, trace, grid, chunks)
    want = pl.read_parquet(old)
    got = pl.read_parquet(new)
    assert got.columns == list(decision_store.LONG_COLUMNS)
    assert got.height == trace.n_requests * len(grid.config_ids) > 0
    assert_frame_equal(got, want, check_exact=True)
    assert pq.read_table(new).equals(pq.read_table(old))          # pyarrow: the same schema and values
    md = pq.read_metadata(new)
    assert md.num_row_groups == len(chunks)
    # every kind of column has nulls somewhere in these traces (failed decisions, unknown queues)
    assert got.null_count().sum_horizontal().item() > 0
    # the readers of decisions read it as the same table
    assert_frame_equal(decision_store.scan_decisions([new]).collect(), want, check_exact=True)


def test_long_file_statistics_prune_correctly(gen_trace, tmp_path):
    trace, grid, chunks = replayed(gen_trace, 2000)
    new, _old = write_both(tmp_path, trace, grid, chunks)
    rows, lo, hi = decision_store.file_info(new)
    assert (rows, lo, hi) == (trace.n_requests * len(grid.config_ids), min(grid.config_ids), max(grid.config_ids))
    full = pl.read_parquet(new)
    for pred in (pl.col("config_id") == grid.config_ids[3], pl.col("matched_blocks") > 2,
                 pl.col("request_id") < full["request_id"][full.height // 2],
                 pl.col("selected_waiting").is_null(), pl.col("worker") == full["worker"].drop_nulls()[0]):
        assert_frame_equal(pl.scan_parquet(new).filter(pred).collect(), full.filter(pred), check_exact=True)


def test_empty_run_writes_a_readable_file(gen_trace, tmp_path):
    trace, grid, _chunks = replayed(gen_trace, 1 << 20)
    new, old = write_both(tmp_path, trace, grid, [])
    assert_frame_equal(pl.read_parquet(new), pl.read_parquet(old), check_exact=True)
    assert pl.read_parquet(new).height == 0


def test_sweep_writes_the_same_decisions_windowed_and_whole(gen_trace, tmp_path):
    args = [a for kv in GRID.items() for a in kv]
    for window in ("none", "2s"):
        res = CliRunner().invoke(main, ["sweep", str(gen_trace), "--out", str(tmp_path / window), "--no-report",
                                        "--window", window, *args])
        assert res.exit_code == 0, res.output
    a = pl.read_parquet(tmp_path / "none" / "decisions.parquet")
    b = pl.read_parquet(tmp_path / "2s" / "decisions.parquet")
    assert pq.read_metadata(tmp_path / "2s" / "decisions.parquet").num_row_groups > 1
    assert_frame_equal(a, b, check_exact=True)


# ---------------------------------------------------------------------------
# failures


def test_writer_failing_in_the_background_fails_the_replay(gen_trace, tmp_path):
    """The decisions file cannot be created (its directory is a regular file): the error
    raised on the writer's thread is the replay's error, and nothing hangs."""
    trace = load_trace(gen_trace)
    grid = Grid.from_texts(GRID)
    not_a_dir = tmp_path / "run"
    not_a_dir.write_text("a file where the run directory should be\n")
    job = executors.Job(source=trace, configs=grid.configs, grid=grid, seed=0, freshness_ns=5_000_000_000,
                        model=None, threads=None, progress=None, out_dir=not_a_dir, decisions=True)
    with pytest.raises(NotADirectoryError):
        executors.LocalExecutor().replay(job, 0)
    assert not_a_dir.read_text() == "a file where the run directory should be\n"


def test_writer_failing_mid_chunk_leaves_no_complete_file(gen_trace, tmp_path):
    trace, grid, chunks = replayed(gen_trace, 2000)
    path = tmp_path / "decisions.parquet"
    w = DecisionWriter(str(path), trace, grid.config_ids)
    w.write(chunks[0])
    bad = Chunk(chunks[1].start, chunks[1].stop, chunks[1].out_i, chunks[1].out_f[:, :1])  # a column too short
    with pytest.raises(ValueError):
        w.write(bad)
    w.close()
    with pytest.raises(pa.ArrowInvalid):                  # no footer: not a Parquet file
        pq.read_metadata(path)


# ---------------------------------------------------------------------------
# the encoders, against plain Python


def rle_runs_plain(buf: bytes, bit_width: int, n: int) -> list[int]:
    """Decode the RLE/bit-packed hybrid (both run kinds) in plain Python."""
    out: list[int] = []
    i = 0
    vw = (bit_width + 7) // 8
    while len(out) < n:
        h = shift = 0
        while True:
            b = buf[i]
            i += 1
            h |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if h & 1:                                          # bit-packed groups of 8
            bits = int.from_bytes(buf[i:i + (h >> 1) * bit_width], "little")
            i += (h >> 1) * bit_width
            out += [(bits >> (k * bit_width)) & ((1 << bit_width) - 1) for k in range((h >> 1) * 8)]
        else:
            v = int.from_bytes(buf[i:i + vw], "little")
            i += vw
            out += [v] * (h >> 1)
    assert i == len(buf)
    return out[:n]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**20), st.integers(1, 70_000)), min_size=1, max_size=40),
       st.integers(1, 24))
def test_rle_encoder_matches_plain_decoding(runs, bit_width):
    values = np.array([v & ((1 << bit_width) - 1) for v, _ in runs], np.int64)
    lengths = np.array([n for _, n in runs], np.int64)
    got = fp._rle(values, lengths, bit_width).tobytes()
    want = [int(v) for v, n in zip(values, lengths, strict=True) for _ in range(n)]
    assert rle_runs_plain(got, bit_width, len(want)) == want


def test_thrift_compact_encoding_of_fields():
    # field deltas 1..15 in the header byte, longer jumps as a zigzag i16; zigzag varints; a STOP byte
    assert fp.thrift_struct([(1, "i32", 3), (2, "i64", -1), (20, "bin", "ab")]) == bytes(
        [0x15, 0x06, 0x16, 0x01, 0x08, 0x28, 0x02]) + b"ab" + b"\x00"
    assert fp.thrift_struct([(1, "list", ("i32", [0, 3, 8]))]) == bytes([0x19, 0x35, 0x00, 0x06, 0x10, 0x00])
    assert fp.thrift_struct([(7, "struct", [])]) == bytes([0x7C, 0x00, 0x00])


column_cells = st.lists(st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)), min_size=1, max_size=300)


@settings(max_examples=60, deadline=None)
@given(st.lists(column_cells, min_size=1, max_size=3), st.data())
def test_flat_writer_round_trips_every_kind(tmp_path_factory, groups, data):
    """Each kind of column, in several row groups of drawn values and nulls, reads back
    (pyarrow and polars) as the same values."""
    path = tmp_path_factory.mktemp("flat") / "t.parquet"
    labels = pa.array(["a", "bb", "", "ccc"], pa.string())
    cols = [fp.Column("i64", "int64"), fp.Column("i32", "int32"), fp.Column("f", "float64"),
            fp.Column("b", "bool"), fp.Column("lab", "string", labels), fp.Column("s", "string")]
    w = fp.FlatParquetWriter(str(path), cols)
    want: dict[str, list] = {c.name: [] for c in cols}
    for cells in groups:
        n = len(cells)
        null = np.array([c is None for c in cells])
        i64 = np.array([0 if c is None else c for c in cells], np.int64)
        i32 = (i64 % 1000 - 500).astype(np.int64)
        f = np.where(null, np.nan, i64.astype(np.float64) / 7)
        b = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        codes = np.where(null, -1, np.abs(i64) % 4)
        names = pa.array([f"id-{x % 50}" for x in i64], pa.string())
        uniq = pa.array(sorted(set(names.to_pylist())), pa.string())
        pos = {s: k for k, s in enumerate(uniq.to_pylist())}
        scodes = np.array([pos[s] for s in names.to_pylist()], np.int64)
        w.write_row_group(n, {
            "i64": fp.runs_of(i64, null), "i32": fp.runs_of(i32, null), "f": fp.runs_of(f.view(np.int64), null),
            "b": b, "lab": fp.runs_of(np.maximum(codes, -1), codes < 0), "s": (fp.runs_of(scodes), uniq)})
        want["i64"] += [None if c is None else c for c in cells]
        want["i32"] += [None if nl else int(v) for nl, v in zip(null, i32, strict=True)]
        want["f"] += [None if nl else float(v) for nl, v in zip(null, f, strict=True)]
        want["b"] += b.tolist()
        want["lab"] += [None if c < 0 else labels[int(c)].as_py() for c in codes]
        want["s"] += names.to_pylist()
    w.close()
    got = pq.read_table(path)
    assert got.schema.types == [pa.int64(), pa.int32(), pa.float64(), pa.bool_(), pa.string(), pa.string()]
    assert got.to_pydict() == want
    assert pl.read_parquet(path).to_dict(as_series=False) == want
    md = pq.read_metadata(path)
    for g in range(md.num_row_groups):                    # integer statistics: the row group's min and max
        st_ = md.row_group(g).column(0).statistics
        vals = [v for v in pq.ParquetFile(path).read_row_group(g, columns=["i64"])["i64"].to_pylist() if v is not None]
        if vals:
            assert (st_.min, st_.max) == (min(vals), max(vals))
        assert st_.null_count == md.row_group(g).num_rows - len(vals)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**24 - 1), min_size=1, max_size=200), st.integers(1, 24))
def test_bitpacked_encoder_matches_plain_decoding(values, bit_width):
    v = np.array([x & ((1 << bit_width) - 1) for x in values], np.int64)
    got = fp._bitpacked(v, bit_width).tobytes()
    assert rle_runs_plain(got, bit_width, len(v)) == v.tolist()
