"""Shared, generic fixtures: small real trace directories on disk (session-scoped, read-only).

Tests must not modify these directories; copy them (``shutil.copytree``) to
corrupt or extend them.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import polars as pl
import pytest

from replay.trace.synthetic import generate_trace

NS = 1_000_000_000
T0 = 1_767_225_600 * NS  # 2026-01-01T00:00:00Z
MATCH_T = pl.List(pl.Struct({"worker": pl.String, "blocks": pl.Int64}))


NO_BROWSER_LINE = "browser: NONE - the report's browser tests SKIP; run .ci/browser to bring chromium"


def _browser() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def pytest_report_header(config):
    """Say at the top of every run whether the report's browser tests can run."""
    exe = _browser()
    return f"browser: {exe}" if exe else NO_BROWSER_LINE


def pytest_terminal_summary(terminalreporter):
    """And again at the end, where a quiet (-q) run still shows it."""
    if _browser() is None:
        terminalreporter.write_line(NO_BROWSER_LINE, yellow=True, bold=True)


def tree_digest(d) -> dict[str, tuple[int, str]]:
    """``{file name: (bytes, sha256)}`` of every file directly in ``d``."""
    out = {}
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if os.path.isfile(p):
            data = open(p, "rb").read()
            out[name] = (len(data), hashlib.sha256(data).hexdigest())
    return out


@pytest.fixture(scope="session")
def gen_trace(tmp_path_factory):
    """A generated trace: 1500 requests, 6 prefill workers with dp_size 2, one decode peer.

    Bursts saturate the fleet, so queue gates, pins and fallbacks all fire
    under limits of 2..8; ~60% of requests carry ``selected_worker``.
    """
    d = tmp_path_factory.mktemp("gen") / "trace"
    generate_trace(d, n_requests=1500, n_workers=6, dp_size=2, sample_interval_ms=100,
                   max_matches=6, seed=11)
    return d


@pytest.fixture(scope="session")
def models_trace(tmp_path_factory):
    """A small hand-written trace with three models (no ``selected_worker`` column).

    * model ``a``: 9 requests, fleet ``http://a0..a2`` (dp_size 1);
    * model ``b``: 5 requests, fleet ``http://b0, b1`` (dp_size 1);
    * model ``c``: 2 requests and no fleet worker, so every config fails them
      (``proposal_empty``).
    Every 4th request has no matches; loads are sampled once a second.
    """
    d = tmp_path_factory.mktemp("models") / "trace"
    d.mkdir()
    fleets = {"a": ["http://a0", "http://a1", "http://a2"], "b": ["http://b0", "http://b1"]}
    models = ["a", "b", "a", "a", "b", "c", "a", "b", "a", "a", "b", "a", "c", "a", "b", "a"]
    rows = []
    for i, m in enumerate(models):
        ws = fleets.get(m, ["http://a0"])
        matches = ([{"worker": ws[i % len(ws)], "blocks": 4 + i % 3},
                    {"worker": ws[(i + 1) % len(ws)], "blocks": 2}] if i % 4 else [])
        rows.append(dict(ts=T0 + (i + 1) * NS // 2, request_id=f"{m}-{i}", model=m,
                         input_tokens=2048 + 256 * i, query_blocks=4 + i // 2, matches=matches))
    pl.DataFrame(rows, schema_overrides={"matches": MATCH_T}).write_parquet(d / "requests.parquet")
    all_workers = fleets["a"] + fleets["b"]
    loads = [dict(ts=T0 + t * NS, worker=w, dp_rank=0, num_running_reqs=4,
                  num_waiting_reqs=(t + k) % 5, num_tokens=1000, max_total_num_tokens=100_000)
             for t in range(10) for k, w in enumerate(all_workers)]
    pl.DataFrame(loads).write_parquet(d / "loads.parquet")
    pl.DataFrame({
        "worker": all_workers,
        "model": ["a"] * 3 + ["b"] * 2,
        "role": ["prefill"] * 5,
        "dp_size": [1] * 5,
    }).write_parquet(d / "workers.parquet")
    return d
