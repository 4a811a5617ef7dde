"""``record`` and ``import`` against the released engine's own publishers (sglang 0.5.23).

Beside the fake engine of tests/capture_fleet.py (written from CAPTURE.md),
these drive the package's real ``SchedulerLoadPublisher``, ``SchedulerKvEventsPublisher``
(``ZmqEventPublisher`` with its replay buffer), ``KVCacheEventRecorder``, block
hash and ``describe_kv_events_publisher`` (tests/sglang_engine.py loads them
without torch).  They skip, saying why, where the ``sglang-engine`` extra is
not installed; ``.ci/run`` installs it.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import time
from pathlib import Path

import polars as pl
import pytest
import sglang_engine as sg
from click.testing import CliRunner
from test_capture_record import read_table, start_record, stop

from replay.capture.blockhash import block_hashes
from replay.capture.recorder import Overrides, engine_from_info
from replay.cli import main

WHY = sg.missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the released engine is not loadable: {WHY}")


@pytest.fixture
def engines():
    made = []

    def make(**kw):
        e = sg.RealEngine(**kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _until(cond, what: str, act=None, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        if act is not None:
            act()
        time.sleep(0.15)


def warm(e, out: Path) -> None:
    """Publish on every rank until the recorder has a row of each (PUB/SUB joins late); the
    test's own messages come after.  Enough batches that a restart's new sequence starts below."""
    n = [0]

    def poke():
        n[0] += 1
        for r in range(e.ranks):
            e.load(r, 1000 + n[0], 0, 0)
            e.clear(r)

    def seen():
        ld, kv = read_table(out, "loads"), read_table(out, "kv_events")
        return all(ld.height and kv.height and ld.filter(pl.col("dp_rank") == r).height
                   and kv.filter(pl.col("dp_rank") == r).height for r in range(e.ranks))

    _until(seen, "the recorder never received the engine's publishers", poke)
    for _ in range(6):
        poke()
    time.sleep(0.5)
    for r in range(e.ranks):
        e.published[r].clear()


def _rfc3339(t: float) -> str:
    ns = int(t * 1e9)
    return f"{dt.datetime.fromtimestamp(ns // 10**9, tz=dt.UTC):%Y-%m-%dT%H:%M:%S}.{ns % 10**9:09d}Z"


def token_export(d: Path, reqs: list[tuple[str, list[int], float]], salt=None) -> Path:
    """The router's token export (gzip NDJSON) of ``(request_id, input_ids, unix time)``."""
    day = d / "slug=t" / "date=2026-12-01"
    day.mkdir(parents=True)
    with gzip.open(day / "router-0-0-0.ndjson.gz", "wt") as fh:
        for rid, ids, t in reqs:
            rec = {"kind": "ingest", "request_id": rid, "slug": "t", "model": "real-model", "input_ids": ids,
                   "ts": _rfc3339(t)}
            if salt:
                rec["cache_salt"] = salt
            fh.write(json.dumps(rec) + "\n")
    return d


def _medium(ev) -> str:
    return getattr(ev.medium, "value", ev.medium)


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def stop_and_import(proc, out: Path, tmp_path: Path, reqs: list[tuple[str, list[int]]]) -> Path:
    """Let the last messages land, stop the recorder cleanly, and import ``reqs`` (request id,
    input ids) as arriving after everything recorded; returns the imported trace."""
    try:
        time.sleep(0.6)
        t_req = time.time()
        time.sleep(0.2)
        rc, _, err = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, err
    te = token_export(tmp_path / "te", [(rid, ids, t_req + 0.01 * k) for k, (rid, ids) in enumerate(reqs)])
    imp = tmp_path / "imp"
    res = run("import", "--out", imp, "--token-export", te, "--recorded", out)
    assert res.exit_code == 0, res.output
    return imp


def imported_matches(out: Path) -> dict:
    df = pl.read_parquet(out / "requests.parquet")
    return {r["request_id"]: sorted((m["worker"], m["blocks"]) for m in (r["matches"] or []))
            for r in df.iter_rows(named=True)}


def recorded(out: Path) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    return read_table(out, "loads"), read_table(out, "kv_events"), gap_rows(out)


def gap_rows(out: Path, kind: str | None = None) -> pl.DataFrame:
    """``gaps/`` rows (of ``kind``); an empty frame with the columns when there is none."""
    g = read_table(out, "gaps")
    if not g.height:
        g = pl.DataFrame(schema={"kind": pl.String, "stream": pl.String, "from_seq": pl.Int64,
                                 "to_seq": pl.Int64})
    return g if kind is None else g.filter(pl.col("kind") == kind)


def test_loadstat_and_kv_events_arrive_field_for_field(tmp_path, engines):
    e = engines(dp_size=2, page_size=4)
    out = tmp_path / "rec"
    proc = start_record(out, [e.url], "--kv-format", "default")
    try:
        warm(e, out)
        e.load(0, 3, 1, 512, waiting_uncached=300, total=812, prefill_uncached=4096, busy_us=123456)
        e.load(1, 5, 2, 256, waiting_uncached=7, total=300, prefill_uncached=11, busy_us=99)
        e.store(0, list(range(100, 112)))
        e.store(0, list(range(100, 116)))                    # extends the chain: parent = page 3
        e.store(1, list(range(200, 209)), cache_salt="tenant-1", session_id="s-1")   # partial page unpublished
        e.remove(0, list(range(100, 116)))
        e.clear(1)
        _until(lambda: read_table(out, "kv_events").filter(pl.col("type") == "BlockRemoved").height >= 1,
               "the removal never arrived")
        time.sleep(0.8)
        rc, _, err = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, err
    loads, kv, gaps = recorded(out)
    got = {r["dp_rank"]: r for r in loads.filter(pl.col("num_running_reqs") < 1000).iter_rows(named=True)}
    assert {k: got[0][k] for k in (
        "num_running_reqs", "num_waiting_reqs", "num_tokens", "max_total_num_tokens", "attn_dp_rank",
        "num_waiting_uncached_tokens", "num_total_tokens", "max_running_requests",
        "total_prefill_uncached_tokens", "total_prefill_busy_us")} == {
        "num_running_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 512, "max_total_num_tokens": 4096,
        "attn_dp_rank": 0, "num_waiting_uncached_tokens": 300, "num_total_tokens": 812,
        "max_running_requests": 64, "total_prefill_uncached_tokens": 4096, "total_prefill_busy_us": 123456}
    assert (got[1]["num_running_reqs"], got[1]["num_tokens"], got[1]["attn_dp_rank"],
            got[1]["total_prefill_busy_us"]) == (5, 256, 1, 99)
    # every event the engine's recorder published, in order per rank, field for field
    for r in range(2):
        sent = [ev for batch in e.published[r] for ev in batch]
        mine = kv.filter((pl.col("dp_rank") == r) & (pl.col("seq") >= 0)).sort("seq", "event_index")
        rows = list(mine.iter_rows(named=True))[-len(sent):]
        assert len(rows) == len(sent) and sent
        for row, ev in zip(rows, sent, strict=True):
            kind = type(ev).__name__
            assert row["type"] == kind
            if kind == "BlockStored":
                assert row["block_hashes"] == list(ev.block_hashes)
                assert row["parent_block_hash"] == ev.parent_block_hash
                assert (row["n_tokens"], row["block_size"], row["medium"]) == (len(ev.token_ids), ev.block_size,
                                                                               _medium(ev))
                assert (row["cache_salt"], row["session_id"], row["lora_name"]) == (ev.cache_salt, ev.session_id,
                                                                                   ev.lora_name)
                assert row["wide_tokens"] is False
            elif kind == "BlockRemoved":
                assert row["block_hashes"] == list(ev.block_hashes) and row["medium"] == _medium(ev)
    # and the hashes are ours: the 16-token chain on rank 0, the salted prompt's 2 full pages on rank 1
    stored0 = kv.filter((pl.col("dp_rank") == 0) & (pl.col("type") == "BlockStored"))
    assert [h for hs in stored0["block_hashes"].to_list()[-2:] for h in hs] == block_hashes(range(100, 116), 4)
    salted = kv.filter(pl.col("cache_salt") == "tenant-1").row(0, named=True)
    assert salted["block_hashes"] == block_hashes(range(200, 208), 4, "tenant-1")
    assert salted["session_id"] == "s-1"
    kv_gaps = gaps.filter((pl.col("kind") == "gap") & (pl.col("stream") == "kv"))
    assert kv_gaps.height == 0, kv_gaps.to_dicts()
    # LoadStat gaps (a PUB high-water mark of 8) are only reported, with their reason
    for g in gaps.filter(pl.col("stream") == "load").iter_rows(named=True):
        assert g["kind"] == "gap" and "no replay socket" in g["reason"], g


@pytest.mark.parametrize("keep", [None, 1], ids=["buffer-holds-it", "buffer-of-one"])
def test_a_lost_batch_comes_back_through_the_engines_replay_buffer(tmp_path, engines, keep):
    """A batch lost on the wire is asked of the engine's replay socket (DEALER, four-frame
    answers, all-0xFF end marker) and recorded; the import then calls its matches exact.  With
    a replay buffer of one batch it is gone: a gap, and the import says the matches are
    approximate, for the requests after it."""
    e = engines(dp_size=1, page_size=4, buffer_steps=keep)
    out = tmp_path / "rec"
    proc = start_record(out, [e.url], "--kv-format", "default", "--replay-timeout", "3s")
    a, b = list(range(300, 316)), list(range(400, 408))
    try:
        warm(e, out)
        e.lose_next_batch(0)
        e.store(0, a)                     # lost on the wire
        e.store(0, b)                     # the gap shows
        _until(lambda: read_table(out, "kv_events").filter(pl.col("replayed")).height >= 1
               or gap_rows(out, "gap").height >= 1,
               "neither a replayed batch nor a gap")
    finally:
        imp = stop_and_import(proc, out, tmp_path, [("ra", a), ("rb", b)])
    _, kv, gaps = recorded(out)
    rep = kv.filter(pl.col("replayed"))
    facts = json.loads((imp / "trace.json").read_text())["extra"]["capture"]
    m = imported_matches(imp)
    rf = json.loads((out / "record.json").read_text())
    assert rf["restarts"] == 0
    # the last batch seen before the gap, asked again, shows the same publisher; a buffer of one
    # batch no longer holds it, and the recorder says it could not tell
    assert rf["unverified_gaps"] == (0 if keep is None else 1)
    if keep is None:
        assert rep["block_hashes"].to_list() == [block_hashes(a, 4)]
        assert gaps.filter((pl.col("kind") == "gap") & (pl.col("stream") == "kv")).height == 0
        assert facts["matches_exact"] is True
        assert m == {"ra": [(e.url, 4)], "rb": [(e.url, 2)]}
    else:
        assert rep.height == 0
        g = gaps.filter((pl.col("kind") == "gap") & (pl.col("stream") == "kv"))
        assert g.height == 1 and g["from_seq"][0] == g["to_seq"][0]
        assert facts["matches_exact"] is False
        assert facts["matches_approximate"]["requests"] == 2
        assert m["ra"] == []                  # the lost blocks: the rebuilt index never saw them
        v = run("validate", imp)
        assert v.exit_code == 0, v.output
        assert "approximate for 2 requests" in v.output


def test_attention_dp_and_dcp_as_server_info_advertises(tmp_path, engines):
    """Attention DP 2 and DCP 2: the top-level dp_size and page_size read 1 and 4, the kv_events
    block 2 ranks of block size 8; record subscribes to both ranks and hashes with 8."""
    e = engines(dp_size=1, attn_dp_size=2, page_size=4, dcp_size=2)
    info = e.server_info()
    assert (info["dp_size"], info["page_size"]) == (1, 4)
    assert (info["kv_events"]["dp_size"], info["kv_events"]["block_size"]) == (2, 8)
    got = engine_from_info(e.url, info, Overrides())
    assert (got.dp_size, got.page_size, got.load_port_base, got.load_topic) == (
        2, 8, info["kv_events"]["load_endpoint_port_base"], "load")
    # the `auto` load range is read as advertised, never derived
    e.server_args.load_publish_endpoint = "auto"
    auto = e.m.runtime.describe_kv_events_publisher(e.server_args)
    assert engine_from_info(e.url, {**info, "kv_events": auto}, Overrides()).load_port_base == \
        auto["load_endpoint_port_base"]
    out = tmp_path / "rec"
    proc = start_record(out, [e.url])
    tokens = list(range(500, 524))
    try:
        warm(e, out)                                      # both ranks heard
        e.store(1, tokens)
        _until(lambda: read_table(out, "kv_events").filter(pl.col("type") == "BlockStored").height >= 1,
               "rank 1's store never arrived")
        time.sleep(0.5)
        rc, _, err = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, err
    wk = pl.read_parquet(out / "workers.parquet")
    assert wk.select("dp_size", "page_size").row(0) == (2, 8)
    _, kv, _ = recorded(out)
    st = kv.filter(pl.col("type") == "BlockStored").row(0, named=True)
    assert st["dp_rank"] == 1 and st["block_size"] == 8
    assert st["block_hashes"] == block_hashes(tokens, 8)
    assert st["block_hashes"] != block_hashes(tokens, 4)[:3]


def test_a_publisher_restart_clears_that_rank(tmp_path, engines):
    """The rank's scheduler restarts (new publishers on the same ports, sequences from 0): the
    recorder sees the sequence go back, writes the reset, and the imported index forgets the
    blocks the old cache held."""
    e = engines(dp_size=1, page_size=4)
    out = tmp_path / "rec"
    proc = start_record(out, [e.url], "--kv-format", "default")
    old, new = list(range(600, 608)), list(range(700, 708))
    try:
        warm(e, out)
        e.store(0, old)
        time.sleep(0.3)
        e.restart(0)
        k = [0]

        def poke():
            k[0] += 1
            e.store(0, new + [800 + k[0]] * 4)

        _until(lambda: gap_rows(out, "restart").height >= 1,
               "no restart recorded", poke)
        poke()
    finally:
        imp = stop_and_import(proc, out, tmp_path, [("old", old), ("new", new)])
    _, kv, gaps = recorded(out)
    assert gaps.filter((pl.col("kind") == "restart") & (pl.col("stream") == "kv")).height == 1
    assert kv.filter((pl.col("seq") == -1) & (pl.col("type") == "AllBlocksCleared")).height == 1
    assert imported_matches(imp) == {"old": [], "new": [(e.url, 2)]}


def test_a_restart_whose_sequence_passes_the_old_one_is_still_a_restart(tmp_path, engines):
    """The rank restarts and its new publisher's first batches never reach the recorder (it
    reconnects late), so the first one it sees numbers above the old publisher's last: a gap, by
    the numbers.  The recorder asks the replay buffer for the last batch it saw as well, finds
    other bytes under that number, and records a restart: the rank is cleared and the new
    publisher's batches are recovered from 0."""
    e = engines(dp_size=1, page_size=4)
    out = tmp_path / "rec"
    proc = start_record(out, [e.url], "--kv-format", "default", "--replay-timeout", "3s")
    old, new = list(range(600, 608)), list(range(700, 708))
    try:
        warm(e, out)
        e.store(0, old)
        time.sleep(0.3)
        last = e.kv_pubs[0].kv_event_publisher._buffer[-1][0]     # the old publisher's last sequence
        hidden = last + 3
        e.restart(0, lose=hidden)                 # its clear (seq 0) and the next batches are not seen
        for k in range(hidden - 1):
            e.store(0, [900 + k] * 4)             # seq 1 .. last + 2, in the new buffer only
        k = [0]

        def poke():                               # seq last + 3 on: the first the recorder sees
            k[0] += 1
            e.store(0, new + [800 + k[0]] * 4)

        _until(lambda: gap_rows(out, "restart").height >= 1, "no restart recorded", poke)
        time.sleep(0.5)
    finally:
        imp = stop_and_import(proc, out, tmp_path, [("old", old), ("new", new), ("hidden", [900] * 4)])
    _, kv, gaps = recorded(out)
    r = gaps.filter((pl.col("kind") == "restart") & (pl.col("stream") == "kv"))
    assert r.height == 1 and "passed the old one" in r["reason"][0], r
    assert gaps.filter((pl.col("kind") == "gap") & (pl.col("stream") == "kv")).height == 0
    assert kv.filter((pl.col("seq") == -1) & (pl.col("type") == "AllBlocksCleared")).height == 1
    # every batch of the new publisher is recorded once, its seq 0 (the clear) among them
    newer = kv.filter((pl.col("seq") >= 0) & (pl.col("ts") > kv.filter(pl.col("seq") == -1)["ts"][0]))
    seqs = newer.unique(["seq", "event_index"])["seq"].unique().sort().to_list()
    assert seqs == list(range(len(seqs))) and len(seqs) > hidden
    assert newer.height == newer.unique(["seq", "event_index"]).height
    facts = json.loads((imp / "trace.json").read_text())["extra"]["capture"]
    assert facts["matches_exact"] is True
    # the old cache is forgotten, the new publisher's hidden batches are known
    assert imported_matches(imp) == {"old": [], "new": [(e.url, 2)], "hidden": [(e.url, 1)]}


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("salt", [None, "tenant-7"])
def test_our_block_hash_is_the_engines(page, salt):
    tokens = [(i * 7919 + 13) % 150_000 for i in range(3 * page + 5)]
    try:
        theirs = sg.engine_hashes(tokens, page, salt)
    except sg.Unavailable as err:
        pytest.skip(str(err))
    ours = block_hashes(tokens, page, salt)
    assert len(theirs) == -(-len(tokens) // page) and ours == theirs     # the partial last page too
    # and the salt matters (the check can fail)
    assert block_hashes(tokens, page, None if salt else "x") != theirs
