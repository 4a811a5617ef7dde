"""The capture writer's compiled parts against plain-Python references: the synthetic tokens, the
token export's NDJSON lines (read back with the standard library's gzip and json), and the
simulator's cache log copied out of its typed list."""

from __future__ import annotations

import gzip
import json

import numpy as np
import polars as pl
import pytest
from numba import types
from numba.typed import List

from replay.capture.from_sim import (
    block_token_rows,
    ingest_lines_bound,
    ingest_lines_nb,
    synthetic_tokens,
    token_rows_nb,
    write_capture,
)
from replay.config import RouterConfig
from replay.kernels.lists import int64_array_nb
from replay.simulate import FleetSpec, build_fleet, generate_log, simulate


@pytest.mark.parametrize("width", [1, 16, 64])
def test_token_rows_kernel_equals_numpy_reference(width):
    rng = np.random.default_rng(width)
    blocks = np.r_[rng.integers(0, 2**31, 300), [0, 1, 2**32 - 2, 2**32 - 1]].astype(np.int64)
    assert np.array_equal(token_rows_nb(blocks, width), block_token_rows(blocks, width))
    # one token differs when the block differs: the reference is not constant
    assert not np.array_equal(block_token_rows(blocks[:1], width), block_token_rows(blocks[1:2], width))


def _reference_lines(blocks_of, ntok_of, first_id, stamps, model):
    out = []
    for r, (blocks, ntok) in enumerate(zip(blocks_of, ntok_of, strict=True)):
        ids = [int(t) for b, n in zip(blocks, ntok, strict=True) for t in synthetic_tokens(b, n)]
        out.append(json.dumps({"kind": "ingest", "request_id": str(first_id + r), "slug": "sim", "model": model,
                               "input_ids": ids, "ts": stamps[r], "choice_index": 0, "choice_count": 1},
                              separators=(",", ":"), ensure_ascii=False) + "\n")
    return "".join(out).encode()


def _parts(model, stamps):
    head = np.frombuffer(b'{"kind":"ingest","request_id":"', np.uint8)
    mid = np.frombuffer(('","slug":"sim","model":' + json.dumps(model, ensure_ascii=False)
                         + ',"input_ids":[').encode(), np.uint8)
    tail = np.frombuffer(b'","choice_index":0,"choice_count":1}\n', np.uint8)
    st = np.frombuffer("".join('],"ts":"' + s for s in stamps).encode(), np.uint8).reshape(len(stamps), -1)
    return head, mid, st, tail


@pytest.mark.parametrize("width", [1, 16, 512])
def test_ingest_lines_kernel_equals_json_reference(width):
    rng = np.random.default_rng(width)
    # block ids near 2**32: a block's first token then has ten digits (the size bound's worst case)
    pool = np.r_[np.arange(40), rng.integers(0, 2**32 - 1, 10), [2**32 - 2]].astype(np.int64)
    sizes = [3, 0, 1, 7, 2, 12, 25]
    blocks_of = [rng.choice(pool, s) for s in sizes]
    ntok_of = [rng.integers(1, width + 1, s) for s in sizes]
    flat = np.concatenate(blocks_of).astype(np.int64)
    ntok = np.concatenate(ntok_of).astype(np.int64)
    req_off = np.r_[0, np.cumsum(sizes)].astype(np.int64)
    stamps = [f"2026-01-0{1 + r}T00:00:0{r}.{r:09d}Z" for r in range(len(sizes))]
    model = 'm"odel/\u00e9'
    head, mid, st, tail = _parts(model, stamps)
    first_id = 999_998
    fixed = head.size + mid.size + st.shape[1] + tail.size
    bound = ingest_lines_bound(len(sizes), flat.size, int(ntok.sum()), fixed, first_id + len(sizes))
    buf = np.zeros(bound + 64, np.uint8)
    n = ingest_lines_nb(flat, ntok, req_off, first_id, head, mid, st, tail, buf)
    assert n <= bound and not buf[n:].any()
    ref = _reference_lines([b.tolist() for b in blocks_of], [t.tolist() for t in ntok_of], first_id, stamps, model)
    assert bytes(buf[:n]) == ref
    last = json.loads(ref.decode().splitlines()[-1])
    assert last["request_id"] == str(first_id + len(sizes) - 1) and last["model"] == model
    assert json.loads(ref.decode().splitlines()[1])["input_ids"] == []


def test_size_bound_is_met_by_the_widest_first_tokens():
    # every token a block's first, each ten digits: the bound's worst case exactly
    blocks = np.full(50, 2**32 - 2, dtype=np.int64)
    ntok = np.ones(50, dtype=np.int64)
    req_off = np.array([0, 50], dtype=np.int64)
    head, mid, st, tail = _parts("m", ["2026-01-01T00:00:00.000000000Z"])
    fixed = head.size + mid.size + st.shape[1] + tail.size
    bound = ingest_lines_bound(1, 50, 50, fixed, 0)
    buf = np.zeros(bound, np.uint8)
    n = ingest_lines_nb(blocks, ntok, req_off, 0, head, mid, st, tail, buf)
    assert n <= bound
    assert json.loads(bytes(buf[:n]))["input_ids"] == [2**32 - 1] * 50


def test_cache_log_copy_equals_asarray():
    items = List.empty_list(types.int64)
    rng = np.random.default_rng(3)
    for v in rng.integers(-(2**62), 2**62, 1001).tolist():
        items.append(v)
    assert np.array_equal(int64_array_nb(items), np.asarray(items, dtype=np.int64))
    assert int64_array_nb(List.empty_list(types.int64)).shape == (0,)


def test_written_token_export_reads_back_with_gzip_and_json(tmp_path):
    log = generate_log(120, seed=5, rate_per_s=30.0, turns_mean=2.0)
    fleet = build_fleet(FleetSpec(workers=2, dp_size=2, prefill_tokens_per_s=8000, decode_tokens_per_s=50,
                                  max_running_requests=8, max_total_num_tokens=60_000))
    res = simulate(log, fleet, RouterConfig(), None, cache_log=True)
    write_capture(res, log, fleet, tmp_path / "cap")
    files = sorted((tmp_path / "cap" / "token_export").rglob("*.ndjson.gz"))
    assert files
    recs = [json.loads(line) for f in files for line in gzip.decompress(f.read_bytes()).decode().splitlines()]
    assert len(recs) == log.n_requests
    recs.sort(key=lambda r: int(r["request_id"]))
    ts = res.requests["ts"].to_numpy()
    stamp = pl.Series(ts).cast(pl.Datetime("ns", "UTC")).dt.to_string("%Y-%m-%dT%H:%M:%S%.9fZ").to_list()
    for i, r in enumerate(recs):
        blocks = log.hash_ids[log.hash_off[i]:log.hash_off[i + 1]]
        want = [int(t) for b in blocks.tolist() for t in synthetic_tokens(b, int(log.block_tokens[b]))]
        assert r["input_ids"] == want
        assert len(want) == int(log.input_tokens[i])
        assert r["ts"] == stamp[i] and r["kind"] == "ingest" and r["model"] == fleet.spec.model
