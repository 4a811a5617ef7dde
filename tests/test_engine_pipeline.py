"""Chunks overlap on the block threads (engine.iter_chunks, engine.start_blocks).

A chunk's blocks are handed to the threads before the previous chunk's are
waited for, and the blocks book into whichever accumulator slot is free.  So:
totals must not depend on how chunks, blocks and slots fell; every chunk is
yielded once, in order, after its own blocks are done; and a consumer that
stops early must leave no block running into its accumulators.
"""

from __future__ import annotations

import time

import numpy as np
from trace_factory import Shape, random_trace

from replay.config import Grid
from replay.sweep import engine

_SHAPE = Shape(n_requests=900, n_workers=6, n_loads=4000, span_s=60.0, max_matches=5, queue_max=9)


def _configs():
    return Grid.from_texts({"--worker-queue-limit": "none,1..5", "--saturation-queue-floor": "none,1..3"}).configs


def _totals(trace, configs, **kw):
    t = engine.new_totals(len(configs), threads=kw.get("threads"), blocks=kw.get("blocks"))
    chunks = [(ch.start, ch.stop) for ch in engine.iter_chunks(trace, configs, seed=2, totals=t, **kw)]
    return t.merged(), chunks


def test_overlapping_chunks_book_what_one_block_books():
    trace = random_trace(41, _SHAPE)
    configs = _configs()
    one, _ = _totals(trace, configs, threads=1, blocks=1, keep=False)
    # many small chunks of many blocks on two threads, and fewer slots than a chunk has blocks
    many, chunks = _totals(trace, configs, threads=2, blocks=5, keep=True, chunk_decisions=60 * len(configs))
    assert len(chunks) > 5
    assert chunks == [(a, min(a + 60, trace.n_requests)) for a in range(0, trace.n_requests, 60)]
    np.testing.assert_array_equal(one.acc, many.acc)
    np.testing.assert_array_equal(one.hist_wait, many.hist_wait)
    np.testing.assert_array_equal(one.hist_div, many.hist_div)
    np.testing.assert_array_equal(one.stats, many.stats)


def test_a_chunk_is_yielded_with_its_decisions_complete():
    trace = random_trace(43, _SHAPE)
    configs = _configs()
    whole = engine.decide_all(trace, configs, seed=2, threads=1)
    seen = 0
    for ch in engine.iter_chunks(trace, configs, seed=2, threads=2, blocks=3, chunk_decisions=50 * len(configs)):
        # compared at once: the next chunk's blocks are running meanwhile
        got = engine.chunk_fields(ch)
        for name in ("worker", "reason", "decision"):
            np.testing.assert_array_equal(got[name], whole[name][ch.start:ch.stop], err_msg=name)
        assert ch.start == seen
        seen = ch.stop
    assert seen == trace.n_requests


def test_stopping_early_leaves_no_block_running():
    """Blocks long enough (a few hundred ms each) that, were they not waited for,
    they would still be booking after ``close()`` returned."""
    trace = random_trace(47, Shape(n_requests=24_000, n_workers=8, n_loads=60_000, span_s=600.0, max_matches=6,
                                   queue_max=9))
    configs = Grid.from_texts({"--worker-queue-limit": "none,1..12", "--saturation-queue-floor": "none,1..12",
                               "--min-load-choices": "1,2,3"}).configs
    totals = engine.new_totals(len(configs), threads=2, blocks=2)
    chunks = engine.iter_chunks(trace, configs, threads=2, blocks=2, keep=False, totals=totals)
    engine.CHUNK_REQUESTS, saved = 8_000, engine.CHUNK_REQUESTS
    try:
        first = next(chunks)   # the second chunk's blocks were handed out before this returned
        chunks.close()
    finally:
        engine.CHUNK_REQUESTS = saved
    after_close = totals.acc.copy()
    time.sleep(1.0)
    np.testing.assert_array_equal(totals.acc, after_close)
    # the first chunk, and the blocks of the second that had started (the others
    # were called off): never a block cut short, never the third chunk
    booked = int(totals.merged().acc[0][0, 0])
    assert first.stop == 8_000
    assert 8_000 <= booked <= 16_000 and booked % 4_000 == 0
