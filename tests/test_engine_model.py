"""The simulator's engine model against small cases worked out by hand from
sglang 0.5.23's rules (docs/simulator.md, "The engine model"): data-parallel
dispatch inside a worker, the prefill budget, retraction when decode runs out
of KV.  Every expected number is derived in the comments, not by running the
code.  Real runs of ``simulate``; no mocks."""

from __future__ import annotations

import numpy as np
import pytest
from test_simulate import _log

from replay.errors import ReplayError
from replay.simulate import FleetSpec, build_fleet, load_fleet, simulate
from replay.simulate.fleet import default_chunked_prefill_size
from replay.simulate.sim import START_NS


def _fleet(**kw):
    # one worker; 1000 prompt tokens/s (1 ms a token), 10 ms decode steps
    base = dict(workers=1, dp_size=1, prefill_tokens_per_s=1000, decode_tokens_per_s=100,
                max_running_requests=64, max_total_num_tokens=10**6, publish_policy="on_change")
    base.update(kw)
    return build_fleet(FleetSpec(**base))


# A t=0 1000 tokens; B t=10 100; C t=30 100; D t=60 500 (no shared prefixes).
FOUR = [(0, 1000, 100, [1, 2]), (10, 100, 2, [3]), (30, 100, 2, [4]), (60, 500, 2, [5])]


@pytest.mark.parametrize("method,ranks,ttft", [
    # round_robin: A0 B1 C0 D1.  Rank 0: A prefills 0-1000 (TTFT 1000), C waits and
    # prefills 1000-1100 (TTFT 1070).  Rank 1: B 10-110 (100), D waits, 110-610 (550).
    ("round_robin", [0, 1, 0, 1], [1000, 100, 1070, 550]),
    # total_requests (snapshots re-read at most every 20 ms; a rank's snapshot is new only
    # after a prefill step, every 15th decode step, or while idle):
    #   A t=0: refresh, both idle (0, 0) -> rank 0 (tie: lowest), counts (1, 0).
    #   B t=10: no refresh (10 ms since) -> rank 1, counts (1, 1).  Rank 1 was idle: its
    #     last snapshot is stamped 10 with 0 requests.
    #   C t=30: refresh: rank 0's snapshot (stamp 0) was applied already, kept at 1; rank 1's
    #     stamp 10 is new: 0 -> rank 1, counts (1, 1).
    #   D t=60: refresh, nothing new; tie -> rank 0.
    # Rank 1: B 10-110, C 110-210 (TTFT 180).  Rank 0: A 0-1000, D 1000-1500 (1440).
    ("total_requests", [0, 1, 1, 0], [1000, 100, 180, 1440]),
    # total_tokens: the same refreshes on (tokens, requests): A -> 0 (1000, 1); B -> 1;
    # C at the refresh sees rank 1 at (0, 0) -> 1 (100, 1); D: (1000, 1) vs (100, 1) -> 1.
    # Rank 1: B 10-110, then C and D in one prefill step 110-710 (TTFTs 680, 650).
    ("total_tokens", [0, 1, 1, 1], [1000, 100, 680, 650]),
])
def test_dispatch_four_requests_dp2(method, ranks, ttft):
    r = simulate(_log(FOUR), _fleet(dp_size=2, load_balance_method=method))
    o = r.outcomes
    assert o["dp_rank"].to_list() == ranks
    assert o["ttft_ms"].to_list() == pytest.approx(ttft)


def test_prefix_affinity_and_router_keep_a_shared_prefix_on_one_rank():
    # every request shares block 100: the original rule (and the DP-aware router, whose index
    # sees block 100 on rank 0 once A is admitted) sends all four to rank 0
    rows = [(t, 1024, 2, [100, i + 1]) for i, (t, _, _, _) in enumerate(FOUR)]
    for method in ("prefix_affinity", "router"):
        o = simulate(_log(rows), _fleet(dp_size=2, load_balance_method=method)).outcomes
        assert o["dp_rank"].to_list() == [0, 0, 0, 0], method
    o = simulate(_log(rows), _fleet(dp_size=2)).outcomes     # the default: round robin
    assert o["dp_rank"].to_list() == [0, 1, 0, 1]


def test_bootstrap_room_is_a_seeded_draw():
    rows = [(i, 100, 2, [i + 1]) for i in range(400)]
    a = simulate(_log(rows), _fleet(dp_size=2, load_balance_method="follow_bootstrap_room"), seed=1)
    b = simulate(_log(rows), _fleet(dp_size=2, load_balance_method="follow_bootstrap_room"), seed=1)
    c = simulate(_log(rows), _fleet(dp_size=2, load_balance_method="follow_bootstrap_room"), seed=2)
    ra, rc = a.outcomes["dp_rank"].to_numpy(), c.outcomes["dp_rank"].to_numpy()
    assert (ra == b.outcomes["dp_rank"].to_numpy()).all()
    assert (ra != rc).any()
    assert 150 < ra.sum() < 250          # about half each (binomial sd 10)
    assert ((ra[1:] != ra[:-1]).sum()) not in (0, 399)   # neither constant nor alternating


def test_max_prefill_tokens_without_chunking():
    # chunking off, max_prefill_tokens 1000; three 600-token prompts queued behind a
    # 100-token one (P, t=0, prefill 0-100).  At 100: X is first of the batch (600 <= 1000
    # left), Y is not and 600 >= 400 left: X alone, 100-700; Y 700-1300; Z 1300-1900.
    rows = [(0, 100, 2, [1]), (1, 600, 2, [2, 3]), (2, 600, 2, [4, 5]), (3, 600, 2, [6, 7])]
    o = simulate(_log(rows), _fleet(chunked_prefill_size=0, max_prefill_tokens=1000)).outcomes
    first = (o["first_token_ts"] - o["first_token_ts"][0]).to_list()
    assert [f / 1e6 for f in first] == pytest.approx([0, 600, 1200, 1800])
    # the first request of a batch is admitted even above the budget: one 1500-token prompt
    o = simulate(_log([(0, 1500, 2, [1, 2, 3])]),
                 _fleet(chunked_prefill_size=0, max_prefill_tokens=1000)).outcomes
    assert o["ttft_ms"][0] == pytest.approx(1500)


def test_prompt_longer_than_the_chunk():
    # chunk 2048: a 5000-token prompt takes steps of 2048, 2048, 904 (TTFT 5000 ms, one step
    # never above 2048); a 300-token prompt queued at t=1 joins the last step with the
    # 2048 - 904 = 1144 tokens left: admitted at 4096, first token with the long one at 5300
    rows = [(0, 5000, 2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), (1, 300, 2, [20])]
    r = simulate(_log(rows), _fleet(chunked_prefill_size=2048))
    o = r.outcomes
    assert o["ttft_ms"].to_list() == pytest.approx([5300, 5299])
    assert (o["admit_ts"][1] - o["arrival_ts"][0]) / 1e6 == pytest.approx(4096)
    steps = np.diff(r.loads["total_prefill_uncached_tokens"].to_numpy())
    assert sorted(steps[steps > 0].tolist()) == [1204, 2048, 2048]
    assert r.stats["ss_chunked"] == 1


def test_decode_runs_out_of_kv_and_retracts():
    # KV 1000 tokens, blocks of 100, init_new_token_ratio 0.1 (so admission reserves little).
    # X, Y: t=0, 200-token prompts (2 blocks each), 400 output tokens.
    #  X prefills 0-200 (TTFT 200).  At 200 Y: 200 + min(400, 4096) + 1 = 601 < 1000 - 200
    #  - 399 x 0.1 -> admitted, prefills 200-400 (TTFT 400).  KV used 400.
    #  At 400 both decode; each step needs 2 tokens: 300 steps fit (600 free), 400-3400.
    #  At 3400 (both at 301 output tokens, KV full, nothing evictable: all locked) decode
    #  retracts Y (same output and prompt: the later arrival), freeing its 300 output tokens;
    #  its blocks stay cached.  X decodes its last 98 steps alone, 3400-4390 (Y cannot come
    #  back: 301 recomputed tokens need room X's growing output holds).  X latency 4390.
    #  At 4390 Y is readmitted with its 200 prompt tokens cached: 200 + 301 - 200 = 301 tokens
    #  recomputed, 4390-4691, then its last 98 decode steps, 4691-5671: latency 5671.
    rows = [(0, 200, 400, [1, 2]), (0, 200, 400, [3, 4])]
    r = simulate(_log(rows, block_size=100),
                 _fleet(max_total_num_tokens=1000, init_new_token_ratio=0.1))
    o = r.outcomes
    assert r.stats["ss_retractions"] == 1
    assert r.stats["ss_recomputed"] == 301
    assert o["ttft_ms"].to_list() == pytest.approx([200, 400])
    assert o["latency_ms"].to_list() == pytest.approx([4390, 5671])
    assert o["cached_tokens"].to_list() == [0, 0]      # the prefix it was first served
    assert r.stats["max_kv_used_minus_capacity"] <= 0
    # with SGLang's default ratio (0.7) Y is not admitted at 200 (601 < 800 - 279.3 fails)
    # and waits for X: no retraction
    r = simulate(_log(rows, block_size=100), _fleet(max_total_num_tokens=1000))
    assert r.stats["ss_retractions"] == 0


def test_chunk_default_resolution(tmp_path):
    assert [default_chunked_prefill_size(g) for g in (None, 16, 24, 40, 80, 141, 192)] == \
        [4096, 2048, 4096, 4096, 8192, 8192, 16384]
    f = tmp_path / "f.toml"
    f.write_text("workers = 1\ngpu_memory_gb = 80\n")
    assert load_fleet(f).workers[0].chunked_prefill_size == 8192
    f.write_text("workers = 1\n")
    assert load_fleet(f).workers[0].chunked_prefill_size == 4096
    f.write_text("workers = 1\nload_balance_method = \"least_loaded\"\n")
    with pytest.raises(ReplayError, match="load_balance_method must be"):
        load_fleet(f)


# A t=0 1024 tokens (two 512-token blocks), 40 out; C t=1100 50 tokens, 2 out; B t=3000 100, 2.
CADENCE = [(0, 1024, 40, [1, 2]), (1100, 50, 2, [4]), (3000, 100, 2, [3])]


def test_sglang_loadstat_cadence():
    """publish_policy "sglang": a LoadStat after each prefill step, after every 15th decode
    step since the last one, on going idle, and a 1 s heartbeat while idle; never on an
    arrival or mid-step.  Samples are stamped 1 us after the moment."""
    r = simulate(_log(CADENCE), _fleet(publish_policy="sglang"))
    got = [((t - START_NS) / 1e6, run, wait, tok) for t, run, wait, tok in r.loads.select(
        ["ts", "num_running_reqs", "num_waiting_reqs", "num_tokens"]).iter_rows()]
    assert got == [
        (-0.001, 0, 0, 0),        # every rank publishes just before the first request
        # A prefills 0-1024 (the heartbeat due at 999 is dropped: the rank is busy)
        (1024.001, 1, 0, 1024),
        # A decodes from 1024 in 10 ms steps; C arrives at 1100 (not published), is admitted
        # after the 8th step (1104) and prefills 1104-1154: published after the prefill with
        # A's 8 output tokens and C's 50 (C's 1100 arrival is never a sample of its own)
        (1154.001, 2, 0, 1024 + 8 + 50),
        # the counter restarts: C finishes at the 1st decode step after (1164, not
        # published); the 15th is at 1304, A holding 8 + 1 + 14 = 23 decoded tokens' KV
        (1304.001, 1, 0, 1024 + 23),
        (1454.001, 1, 0, 1024 + 38),   # 15 steps later
        (1464.001, 0, 0, 0),           # A's last step: the rank goes idle and publishes at once
        (2464.001, 0, 0, 0),           # the idle heartbeat, 1 s on (written once B arrives)
        (3100.001, 1, 0, 100),         # B prefills 3000-3100
    ]
    assert r.outcomes["ttft_ms"].to_list() == pytest.approx([1024, 54, 100])
    # on_change publishes the arrival and the admission instead (1 ms after each change)
    oc = simulate(_log(CADENCE), _fleet(publish_policy="on_change")).loads
    assert (oc["ts"] - START_NS).to_list()[:5] == [-1_000_000, 1_000_000, 1_001_000_000,
                                                   1_025_000_000, 1_101_000_000]
