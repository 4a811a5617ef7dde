"""Faults end to end: a full disk under record and import, and a killed recording imported and validated."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import time

import polars as pl
import pytest
from capture_fixture import rfc3339, spec_hashes
from capture_fleet import FakeEngine, stored
from click.testing import CliRunner
from test_capture_record import (
    every_file_readable,
    read_table,
    start_record,
    wait_rows,
)

from replay.cli import main


@pytest.fixture
def small_disk(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(d)], capture_output=True, check=False)
    if r.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_record_full_disk(small_disk):
    """The disk fills up mid-run: record stops with one line and exit 2; what is on disk reads."""
    e = FakeEngine(dp_size=1)
    out = small_disk / "rec"
    proc = start_record(out, [e.url])
    try:
        e.wait_subscribed()
        payload_tail = (1, 2, 3, 4, 5)
        deadline = time.monotonic() + 40
        i = 0
        while proc.poll() is None and time.monotonic() < deadline:
            e.send_kv(0, [stored(list(range(i * 64, i * 64 + 64)), None, 256, 4, as_map=True)])
            e.send_load(0, i, i, i, 10_000, tail=payload_tail)
            i += 1
            if i % 50 == 0:
                time.sleep(0.01)
        rc = proc.wait(timeout=30)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        e.close()
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: {out}: cannot write (OSError: [Errno 28] No space left on device)")
    assert "Traceback" not in err
    assert every_file_readable(out) >= 1
    assert not [p for p in out.rglob(".*.tmp")]          # no temporary file left behind
    facts = json.loads((out / "record.json").read_text())
    assert facts["complete"] is False


def test_import_full_disk_leaves_nothing(tmp_path, small_disk):
    from capture_fixture import build

    fx = build(tmp_path / "fleet", n_requests=2000)
    st = os.statvfs(small_disk)
    (small_disk / "filler").write_bytes(b"x" * max(0, st.f_bavail * st.f_frsize - 24_000))
    out = small_disk / "trace"
    args = ["import", "--out", str(out), "--token-export", str(fx.token_dir), "--recorded", str(fx.recorded)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2, res.output
    assert res.output.strip() == f"error: {out}: cannot write (No space left on device); nothing was written"
    assert not out.exists()
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


def test_killed_recording_imports_and_validates(tmp_path):
    """A live recording (LoadStat and KV events from a fake engine) killed with -9, imported with a
    token export of the same prompts: the trace validates, and the matches are those the recorded
    events imply."""
    e = FakeEngine(dp_size=2, page_size=4)
    out = tmp_path / "rec"
    proc = start_record(out, [e.url])
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 1, 1, 1, 1], [40, 41, 42, 43, 44, 45, 46, 47]]
    t_store = None
    try:
        e.wait_subscribed()
        for k in range(30):
            for r in range(2):
                e.send_load(r, k % 3, (k + r) % 4, 100 * k, 8000, tail=(0, 10, 16, k, k))
            time.sleep(0.01)
        h0 = spec_hashes(prompts[0], 4)
        e.send_kv(0, [stored(h0[:2], None, 8, 4, as_map=False)])
        e.send_kv(1, [stored(spec_hashes(prompts[2], 4)[:1], None, 4, 4, as_map=True)])
        wait_rows(out, "kv_events", 2)
        t_store = read_table(out, "kv_events")["ts"].max()
        for k in range(30):
            for r in range(2):
                e.send_load(r, 1, 1, 50, 8000, tail=(0, 10, 16, k, k))
            time.sleep(0.01)
        wait_rows(out, "loads", 100)
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        e.close()
    assert json.loads((out / "record.json").read_text())["complete"] is False
    loads = read_table(out, "loads")
    t_first = int(loads["ts"].min())
    # the token export: one request before the stores, three after
    exp = tmp_path / "export" / "slug=a" / "date=x"
    exp.mkdir(parents=True)
    recs = [{"kind": "ingest", "request_id": "early", "model": "m", "input_ids": prompts[0], "ts": rfc3339(t_first)}]
    for i, p in enumerate(prompts):
        recs.append({"kind": "ingest", "request_id": f"late-{i}", "model": "m", "input_ids": p,
                     "ts": rfc3339(int(t_store) + 1_000_000)})
    with gzip.open(exp / "router-1.ndjson.gz", "wt") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in recs))
    trace = tmp_path / "trace"
    res = CliRunner().invoke(main, ["import", "--out", str(trace), "--token-export", str(tmp_path / "export"),
                                    "--recorded", str(out)])
    assert res.exit_code == 0, res.output
    assert "did not finish cleanly" in res.output
    v = CliRunner().invoke(main, ["validate", str(trace)])
    assert v.exit_code == 0, v.output
    req = pl.read_parquet(trace / "requests.parquet")
    m = {r["request_id"]: [(x["worker"], x["blocks"]) for x in r["matches"]] for r in req.iter_rows(named=True)}
    assert m == {"early": [], "late-0": [(e.url, 2)], "late-1": [(e.url, 1)], "late-2": [(e.url, 1)]}
    assert req.filter(pl.col("request_id") == "late-0")["query_blocks"][0] == 3   # partial last block counts
    wk = pl.read_parquet(trace / "workers.parquet")
    assert wk.row(0, named=True) == {"worker": e.url, "model": "m", "role": "plain", "dp_size": 2, "page_size": 4}
    assert os.path.isdir(trace / "loads")
