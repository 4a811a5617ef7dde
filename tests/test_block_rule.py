"""The block-count rule: a request's block ids and its input length agree.

Full-blocks-only lists (``len == floor(L / B)``) and lists with a partial last
block (``len == ceil(L / B)``) are read everywhere; anything else is refused at
read time with one line.  The property test holds that whatever ``simulate``,
its capture writer and ``import`` produce from logs of every shape passes
``validate``, ``sweep`` and ``calibrate`` (real CLI, real Parquet).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.capture.from_sim import engine_dirs
from replay.cli import main
from replay.simulate import read_log
from replay.trace import load_trace, request_log
from replay.trace.blocks import INT64_MIN, check_block_counts, complete_partial_blocks, fresh_ids

S = 10**9
ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# ---------------------------------------------------------------------------
# the rule itself

def test_rule_accepts_both_forms_and_names_the_first_other_row():
    B = 16
    L = np.array([0, 1, 16, 17, 17, 33, 40])
    n = np.array([0, 0, 1, 2, 1, 3, 2])          # row 6: 40 tokens want 3 (or 2): 2 is full-only
    c = check_block_counts(n, L, B)
    assert c.bad is None and c.full_only.tolist() == [False, True, False, False, True, False, True]
    c = check_block_counts(np.array([0, 1, 4]), np.array([0, 16, 40]), B)
    assert c.bad == 2
    assert c.message == "has 4 hashes, expected ceil(input_tokens 40 / page_size 16) = 3 (or 2, its full blocks only)"
    # an exact multiple has one form; an unknown page (< 1) or list is not checked
    c = check_block_counts(np.array([1]), np.array([32]), B)
    assert c.bad == 0 and c.message.endswith("= 2")
    assert check_block_counts(np.array([9]), np.array([32]), -1).bad is None
    assert check_block_counts(np.array([9]), np.array([32]), B, known=np.array([False])).bad is None
    # the writers' form accepts complete lists only
    c = check_block_counts(np.array([2]), np.array([40]), B, full_only_ok=False)
    assert c.bad == 0 and "full blocks" not in c.message


def test_fresh_ids_avoid_every_used_id_even_at_the_bottom_of_int64():
    used = np.array([INT64_MIN, INT64_MIN + 2, 5, 2**63 - 1])
    got = fresh_ids(used, 3)
    assert got.tolist() == [INT64_MIN + 1, INT64_MIN + 3, INT64_MIN + 4]
    assert not np.isin(got, used).any() and len(set(got.tolist())) == 3


def test_complete_partial_blocks_appends_one_id_each():
    off = np.array([0, 2, 2, 5])
    vals = np.array([7, 8, 1, 2, 3])
    off2, vals2 = complete_partial_blocks(off, vals, np.array([True, False, True]))
    assert off2.tolist() == [0, 3, 3, 7]
    assert vals2[[0, 1, 3, 4, 5]].tolist() == [7, 8, 1, 2, 3]
    assert vals2[2] != vals2[6] and not np.isin(vals2[[2, 6]], vals).any()


# ---------------------------------------------------------------------------
# logs of each shape

def _shapes(draw_lengths, block: int, full_only: list[bool], *, rng: np.random.Generator):
    """Mooncake records: three sessions whose full blocks are shared by id; a partial block is
    the request's own; ``full_only[i]`` drops it."""
    recs = []
    t = 0
    own = 10**9
    for i, L in enumerate(draw_lengths):
        s = int(rng.integers(0, 3))
        ids = [s * 100_000 + j for j in range(L // block)]
        if L % block and not full_only[i]:
            own += 1
            ids.append(own)
        t += int(rng.integers(0, 400))
        recs.append({"timestamp": t, "input_length": int(L), "output_length": int(rng.integers(1, 30)),
                     "hash_ids": ids})
    return recs


def _write_jsonl(p: Path, recs) -> Path:
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return p


FLEET = """model = "default"
workers = 4
dp_size = 2
prefill_tokens_per_s = 6000
decode_tokens_per_s = 50
max_running_requests = 6
max_total_num_tokens = 40000
publish_policy = "on_change"
"""


def _closed_loop(tmp: Path, log: Path, block: int) -> dict:
    """simulate (+ capture) -> validate, sweep, calibrate; import of the capture -> the same.
    Returns validate's facts of the simulated trace."""
    fleet = tmp / "fleet.toml"
    fleet.write_text(FLEET)
    sim, cap, imp = tmp / "sim", tmp / "cap", tmp / "imp"
    r = run("simulate", log, "--fleet", fleet, "--out", sim, "--block-size", block, "--capture-out", cap,
            "--worker-queue-limit", 2, "-q")
    assert r.exit_code == 0, r.output
    r = run("import", "--out", imp, "--token-export", cap / "token_export", "--recorded", cap / "recorded",
            "--router-inflight", "derived", *[a for u, p in engine_dirs(cap) for a in ("--engine-export", f"{u}={p}")])
    assert r.exit_code == 0, r.output
    facts = None
    for d in (sim, imp):
        v = run("validate", d, "--json")
        assert v.exit_code == 0, v.output
        facts = facts or json.loads(v.output)
        s = run("sweep", d, "--out", tmp / f"run-{d.name}", "--worker-queue-limit", 2, "--no-report", "-q")
        assert s.exit_code == 0, s.output
        assert pl.read_parquet(tmp / f"run-{d.name}" / "summary.parquet")["agreement"][0] == 1.0
        c = run("calibrate", d, "--out", tmp / f"fit-{d.name}.toml")
        assert c.exit_code == 0, c.output
        # every request's list is complete in what was written
        rl = request_log(d)
        want = -(-rl["input_tokens"].to_numpy() // block)
        assert rl["hash_ids"].list.len().to_numpy().tolist() == want.tolist()
    return facts


length_kind = st.sampled_from(["empty", "one", "multiple", "partial"])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(block=st.sampled_from([1, 16, 64, 512]),
       kinds=st.lists(st.tuples(length_kind, st.integers(1, 6), st.booleans()), min_size=40, max_size=80),
       seed=st.integers(0, 2**16))
def test_every_log_shape_survives_the_closed_loop(tmp_path_factory, block, kinds, seed):
    rng = np.random.default_rng(seed)
    lengths, full_only = [], []
    for kind, k, drop in kinds:
        L = {"empty": 0, "one": 1, "multiple": k * block, "partial": k * block + int(rng.integers(1, block))
             if block > 1 else k}[kind]
        lengths.append(min(L, 4000))
        full_only.append(drop)
    tmp = tmp_path_factory.mktemp("shape")
    log = _write_jsonl(tmp / "log.jsonl", _shapes(lengths, block, full_only, rng=rng))
    touched = sum(1 for L, d in zip(lengths, full_only, strict=True) if d and L % block)
    assert read_log(log, block_size=block).partial_blocks_added == touched
    _closed_loop(tmp, log, block)


# ---------------------------------------------------------------------------
# the case: a full-blocks-only log, and a trace holding one

def test_full_blocks_only_trace_is_read_and_counted(tmp_path):
    B = 64
    lengths = [119748, 64, 130, 5, 0]
    recs = _shapes(lengths, B, [True] * 5, rng=np.random.default_rng(1))
    d = tmp_path / "t"
    d.mkdir()
    n = len(recs)
    pl.DataFrame({
        "ts": [S * (i + 1) for i in range(n)], "request_id": list(range(n)), "input_tokens": lengths,
        "query_blocks": [-(-L // B) for L in lengths],
        "matches": pl.Series([[]] * n, dtype=pl.List(pl.Struct({"worker": pl.String, "blocks": pl.Int64}))),
        "hash_ids": pl.Series([r["hash_ids"] for r in recs], dtype=pl.List(pl.Int64)),
        "output_tokens": [1] * n,
    }).write_parquet(d / "requests.parquet")
    pl.DataFrame({"ts": [S], "worker": ["http://w0"], "num_running_reqs": [0], "num_waiting_reqs": [0],
                  "num_tokens": [0], "max_total_num_tokens": [10**6]}).write_parquet(d / "loads.parquet")
    (d / "trace.json").write_text(json.dumps({"page_size": B}))
    tr = load_trace(d)
    assert tr.facts.hash_ids_full_blocks_only == 3            # 119748, 130, 5 have a partial block
    lens = np.diff(tr.hash_offsets).tolist()
    assert lens == [-(-L // B) for L in lengths]
    last = tr.hash_values[tr.hash_offsets[1] - 1]
    assert last not in set(tr.hash_values[:tr.hash_offsets[1] - 1].tolist())
    r = run("validate", d)
    assert r.exit_code == 0 and "hash_ids with full blocks only: 3 requests" in r.output, r.output
    # one more id than its blocks is refused at read time: one line naming file, row, expectation
    bad = pl.read_parquet(d / "requests.parquet").with_columns(
        pl.when(pl.col("request_id") == 2).then(pl.col("hash_ids").list.concat(pl.lit([1, 2], dtype=pl.List(pl.Int64))))
        .otherwise(pl.col("hash_ids")).alias("hash_ids"))
    bad.write_parquet(d / "requests.parquet")
    r = run("validate", d)
    assert r.exit_code == 2
    assert r.output.strip() == ("error: requests.parquet: column 'hash_ids' row 2: has 4 hashes, expected "
                                "ceil(input_tokens 130 / page_size 64) = 3 (or 2, its full blocks only)")


def test_bad_log_is_refused_before_anything_is_written(tmp_path):
    recs = [{"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [1]},
            {"timestamp": 5, "input_length": 100, "output_length": 1, "hash_ids": [1, 2, 3]}]
    log = _write_jsonl(tmp_path / "log.jsonl", recs)
    r = run("simulate", log, "--block-size", 64, "--out", tmp_path / "o", "--workers", 2)
    assert r.exit_code == 2
    assert r.output.strip() == (f"error: {log}: row 1: hash_ids has 3 hashes, expected ceil(input_length 100 / "
                                "block_size 64) = 2 (or 1, its full blocks only)")
    assert not (tmp_path / "o").exists()
    r = run("import", "--out", tmp_path / "imp", "--mooncake", log, "--page-size", 64)
    assert r.exit_code == 2 and "Mooncake log: record 1: hash_ids has 3 hashes" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "imp").exists()


def test_import_of_a_full_blocks_only_mooncake_log_validates(tmp_path):
    recs = _shapes([100, 128, 1, 0, 300], 64, [True] * 5, rng=np.random.default_rng(3))
    log = _write_jsonl(tmp_path / "log.jsonl", recs)
    r = run("import", "--out", tmp_path / "imp", "--mooncake", log, "--page-size", 64)
    assert r.exit_code == 0, r.output
    rl = request_log(tmp_path / "imp")
    assert rl["hash_ids"].list.len().to_list() == [2, 2, 1, 0, 5]


def test_trace_dir_with_full_blocks_only_simulates_like_the_complete_one(tmp_path):
    """A simulated trace rewritten with full-blocks-only hash_ids: simulate TRACE_DIR and calibrate
    accept it, and since a partial block never matches, the re-simulation places every request
    exactly as the one from the complete lists does."""
    fleet = ROOT / "traces" / "sample-fleet.toml"
    r = run("simulate", ROOT / "traces" / "sample-log" / "requests.jsonl", "--fleet", fleet, "--requests", 400,
            "--out", tmp_path / "t", "--worker-queue-limit", 4, "-q")
    assert r.exit_code == 0, r.output
    full = tmp_path / "full"
    full.mkdir()
    for f in (tmp_path / "t").iterdir():
        if f.suffix in (".parquet", ".json") and f.name not in ("requests.parquet", "sim.json"):
            (full / f.name).write_bytes(f.read_bytes())
    req = pl.read_parquet(tmp_path / "t" / "requests.parquet")
    B = json.loads((tmp_path / "t" / "trace.json").read_text())["page_size"]
    cut = pl.col("input_tokens") // B
    req.with_columns(pl.col("hash_ids").list.head(cut)).write_parquet(full / "requests.parquet")
    n_partial = int((req["input_tokens"] % B != 0).sum())
    assert n_partial > 100
    assert load_trace(full).facts.hash_ids_full_blocks_only == n_partial
    for src, out in ((tmp_path / "t", "a"), (full, "b")):
        r = run("simulate", src, "--fleet", fleet, "--out", tmp_path / out, "--worker-queue-limit", 4, "-q")
        assert r.exit_code == 0, r.output
    a = pl.read_parquet(tmp_path / "a" / "requests.parquet")
    b = pl.read_parquet(tmp_path / "b" / "requests.parquet")
    assert a["selected_worker"].to_list() == b["selected_worker"].to_list()
    assert a["matches"].to_list() == b["matches"].to_list()
    assert a["ttft_ms"].to_list() == b["ttft_ms"].to_list()
    r = run("calibrate", full, "--out", tmp_path / "fit.toml")
    assert r.exit_code == 0, r.output


# ---------------------------------------------------------------------------
# generate's traces carry complete hash_ids and output_tokens

@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(block=st.sampled_from([1, 16, 64, 512]), n=st.integers(0, 120), seed=st.integers(0, 2**16))
def test_generated_traces_follow_the_rule_and_close_the_loop(tmp_path_factory, block, n, seed):
    from replay.trace.synthetic import generate_trace
    tmp = tmp_path_factory.mktemp("gen")
    d = tmp / "g"
    generate_trace(d, n_requests=n, n_workers=3, dp_size=2, seed=seed, block_size=block, rate_per_s=20.0)
    rl = request_log(d)
    L = rl["input_tokens"].to_numpy()
    assert rl["hash_ids"].list.len().to_numpy().tolist() == (-(-L // block)).tolist()
    assert (rl["output_tokens"].to_numpy() >= 1).all()
    assert check_block_counts(rl["hash_ids"].list.len().to_numpy(), L, block, full_only_ok=False).bad is None
    v = run("validate", d, "--json")
    assert v.exit_code == 0, v.output
    assert json.loads(v.output)["hash_ids_full_blocks_only"] == 0
    if n == 0:
        return
    s = run("sweep", d, "--out", tmp / "run", "--worker-queue-limit", 2, "--no-report", "-q")
    assert s.exit_code == 0, s.output
    c = run("calibrate", d, "--out", tmp / "fit.toml")
    assert c.exit_code == 0, c.output
    r = run("simulate", d, "--fleet", tmp / "fit.toml", "--out", tmp / "sim", "--worker-queue-limit", 2, "-q")
    assert r.exit_code == 0, r.output
    assert pl.read_parquet(tmp / "sim" / "requests.parquet")["hash_ids"].list.len().to_list() == \
        rl["hash_ids"].list.len().to_list()


def test_generated_hash_ids_share_a_groups_prefix_and_form_a_tree(tmp_path):
    from replay.trace.synthetic import generate_trace
    generate_trace(tmp_path / "g", n_requests=400, n_workers=3, dp_size=2, seed=5)
    rl = request_log(tmp_path / "g")
    firsts = [h[0] for h in rl["hash_ids"].to_list() if h]
    assert len(set(firsts)) < len(firsts) / 2       # system prompts shared across a group
    ids = rl["hash_ids"].explode().drop_nulls()
    parents: dict[int, int] = {}
    for h in rl["hash_ids"].to_list():               # one parent per block: a tree
        for j in range(1, len(h)):
            assert parents.setdefault(h[j], h[j - 1]) == h[j - 1]
    assert ids.n_unique() > 400
