"""``router-replay record`` as a subprocess against fake engines on real loopback ZMQ sockets.

The engines (tests/capture_fleet.py) encode frames independently of the
recorder; every sent message is compared with the recorded row.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from capture_fleet import FakeEngine, cleared, free_ports, removed, seq_frame, stored

ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def start_record(out, urls, *extra):
    args = [sys.executable, "-m", "replay", "record", "--out", str(out), "--flush-interval", "0.3s",
            "--retry", "0.5s"]
    for u in urls:
        args += ["--worker", u]
    return subprocess.Popen(args + [str(x) for x in extra], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def stop(proc, sig=signal.SIGTERM, timeout=30):
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def read_stderr_until(proc, needle: str, timeout: float = 60.0) -> str:
    """The child's stderr lines up to and including the first holding ``needle``
    (waiting for the child to say it, however slow its start), '' on timeout."""
    seen: list[str] = []
    found = threading.Event()

    def read():
        for line in proc.stderr:
            seen.append(line)
            if needle in line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    found.wait(timeout)
    return "".join(seen)


def read_table(d: Path, name: str) -> pl.DataFrame:
    files = sorted(p for p in (d / name).rglob("*.parquet") if not p.name.startswith("."))
    if not files:
        return pl.DataFrame()
    return pl.concat([pl.read_parquet(f, hive_partitioning=False) for f in files], how="vertical_relaxed")


def wait_rows(d: Path, name: str, n: int, timeout=20.0) -> pl.DataFrame:
    deadline = time.monotonic() + timeout
    while True:
        df = read_table(d, name)
        if df.height >= n or time.monotonic() > deadline:
            return df
        time.sleep(0.1)


def every_file_readable(d: Path) -> int:
    n = 0
    for p in d.rglob("*.parquet"):
        if p.name.startswith("."):
            continue
        pq.read_table(p)  # raises on a torn file
        n += 1
    return n


@pytest.fixture
def engines():
    made = []

    def make(**kw):
        e = FakeEngine(**kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_record_frame_by_frame(tmp_path, engines):
    """Two engines (array and map KV encodings, two info styles), one unreachable URL;
    tails, extras, a LoadStat gap, a recoverable and an unrecoverable KV gap, a restart, garbage."""
    a = engines(dp_size=2, info_style="kv_events")
    b = engines(dp_size=1, info_style="kv_events_config", kv_topic="kv")
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    out = tmp_path / "rec"
    proc = start_record(out, [a.url, b.url, dead])
    try:
        a.wait_subscribed()
        b.wait_subscribed()
        # LoadStat: old (6 elements), native tail, tail + extras
        a.send_load(0, 1, 2, 300, 1000)
        a.send_load(0, 3, 4, 500, 1000, tail=(10, 20, 32, 40, 50))
        a.send_load(1, 5, 6, 700, 1000, tail=(11, 21, 33, 41, 51), extra=(99, "future"))
        b.send_load(0, 0, 0, 0, 2000, tail=(0, 0, 8, 0, 0))
        a.send_load(0, 2, 2, 200, 1000, skip=2)                 # seqs 2, 3 never sent: a gap
        # KV: array encoding on a, map encoding on b
        a.send_kv(0, [stored([11, 12], None, 8, 4, as_map=False), stored([13], 12, 4, 4, as_map=False,
                                                                          medium="CPU_PINNED")])
        a.send_kv(1, [stored([21], None, 4, 4, as_map=False)])
        b.send_kv(0, [stored([31, 32], None, 8, 4, as_map=True), removed([32], as_map=True, medium="GPU")])
        b.send_kv(0, [cleared(as_map=True)])
        a.send_kv(0, [removed([13], as_map=False)], publish=False)            # seq 1: lost live, in buffer
        a.send_kv(0, [stored([14], 12, 4, 4, as_map=False)], publish=False, keep=False)  # seq 2: gone
        a.send_kv(0, [cleared(as_map=False)])                                  # seq 3: the gap shows
        # garbage: wrong frame count, short sequence, not msgpack, not a LoadStat
        a.send_raw("load", 1, [b"load", seq_frame(1)])
        a.send_raw("load", 1, [b"load", b"\x00\x01", b"\x90"])
        a.send_raw("kv", 1, [b"", seq_frame(1), b"\xc1\xc1\xc1"])
        a.send_raw("load", 1, [b"load", seq_frame(1), b"\x93\x01\x02\x03"])
        # restart of b: sequences start over
        b.restart()
        b.send_load(0, 7, 7, 70, 2000)
        b.send_kv(0, [stored([41], None, 4, 4, as_map=True, lora=None)])
        loads = wait_rows(out, "loads", 6)
        kv = wait_rows(out, "kv_events", 10)
        time.sleep(0.8)
        rc, _, se = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, se
    assert f"{dead}: no /server_info answer" in se
    facts = json.loads((out / "record.json").read_text())
    assert facts["complete"] is True
    assert list(facts["unreachable"]) == [dead]
    assert sorted(facts["workers"]) == sorted([a.url, b.url])

    # --- LoadStat rows, frame by frame (in send order per stream)
    loads = read_table(out, "loads")
    sent_loads = [m for e in (a, b) for m in e.sent if m["kind"] == "load"]
    assert loads.height == len(sent_loads) == 6
    for e in (a, b):
        for r in range(e.dp_size):
            mine = [m for m in e.sent if m["kind"] == "load" and m["rank"] == r]
            got = loads.filter((pl.col("worker") == e.url) & (pl.col("dp_rank") == r)).sort("ts", maintain_order=True)
            assert got.height == len(mine)
            for m, row in zip(mine, got.iter_rows(named=True), strict=True):
                assert (row["seq"], row["num_running_reqs"], row["num_waiting_reqs"], row["num_tokens"],
                        row["max_total_num_tokens"]) == (m["seq"], m["running"], m["waiting"], m["tokens"],
                                                         m["max_total"])
                tail = [row[k] for k in ("num_waiting_uncached_tokens", "num_total_tokens", "max_running_requests",
                                         "total_prefill_uncached_tokens", "total_prefill_busy_us")]
                assert tail == (m["tail"] or [None] * 5)
    for e in (a, b):
        assert loads.filter(pl.col("worker") == e.url)["ts"].min() > facts["started_ns"]

    # --- KV events: every published or replayed batch's events, in order; never the lost one
    kv = read_table(out, "kv_events")
    expect = []
    for e in (a, b):
        for m in e.sent:
            if m["kind"] == "kv" and (m["published"] or m["kept"]):
                for j, ev in enumerate(m["events"]):
                    kind = ev["type"] if isinstance(ev, dict) else ev[0]
                    hashes = (ev.get("block_hashes") if isinstance(ev, dict) else (ev[1] if len(ev) > 1 else None))
                    expect.append((e.url, m["rank"], m["seq"], j, kind, hashes, not m["published"]))
    # b's publisher restart: the recorder's AllBlocksCleared (seq -1, index -1) empties that rank
    expect.append((b.url, 0, -1, -1, "AllBlocksCleared", None, False))
    got = [(r["worker"], r["dp_rank"], r["seq"], r["event_index"], r["type"], r["block_hashes"], r["replayed"])
           for r in kv.iter_rows(named=True)]
    assert sorted(got, key=str) == sorted(expect, key=str)
    row13 = kv.filter(pl.col("block_hashes").list.first() == 13).row(0, named=True)
    assert row13["medium"] == "CPU_PINNED" and row13["parent_block_hash"] == 12 and row13["n_tokens"] == 4
    rm = kv.filter((pl.col("type") == "BlockRemoved") & (pl.col("worker") == b.url)).row(0, named=True)
    assert rm["medium"] == "GPU"
    # the recorder asked for the missing range from seq 1, and for seq 0 (the last batch it saw) with
    # it, to check that the same publisher answers
    assert (0, 0) in a.replay_requests and facts["unverified_gaps"] == 0
    assert sum(s["restarts"] for s in facts["streams"] if s["worker"] == a.url) == 0

    # --- gaps, restarts, malformed frames
    gaps = read_table(out, "gaps")
    g = {(r["worker"], r["dp_rank"], r["stream"], r["kind"], r["from_seq"], r["to_seq"])
         for r in gaps.iter_rows(named=True)}
    assert (a.url, 0, "load", "gap", 2, 3) in g
    assert (a.url, 0, "kv", "gap", 2, 2) in g
    assert not any(k[2] == "kv" and k[3] == "gap" and k[4] == 1 for k in g)   # seq 1 was recovered
    assert (b.url, 0, "load", "restart", 0, 0) in g    # seq 0 again after seq 0
    assert (b.url, 0, "kv", "restart", 0, 1) in g
    assert (a.url, 1, "kv", "malformed", 1, 1) in g
    for r in gaps.iter_rows(named=True):
        if r["kind"] == "gap":
            assert r["from_ts"] is not None and r["to_ts"] >= r["from_ts"]
    assert facts["malformed_frames"] == 4
    reasons = " ".join(x["reason"] for x in facts["malformed_examples"])
    assert "2 frames" in reasons and "not msgpack" in reasons
    assert facts["restarts"] == 2
    assert every_file_readable(out) >= 4


def test_record_sigkill_leaves_readable_files(tmp_path, engines):
    """kill -9 mid-run: every file on disk reads, record.json says incomplete, and at
    most the last flush interval of samples is missing."""
    e = engines(dp_size=1)
    out = tmp_path / "rec"
    proc = start_record(out, [e.url])
    try:
        e.wait_subscribed()
        for i in range(400):
            e.send_load(0, i, i % 7, 10 * i, 5000, tail=(i, i, 8, i, i))
            time.sleep(0.005)
        time.sleep(0.8)              # a few flushes pass
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert every_file_readable(out) >= 1
    facts = json.loads((out / "record.json").read_text())
    assert facts["complete"] is False
    loads = read_table(out, "loads")
    assert 0 < loads.height <= 400
    # what is there is a prefix of what was sent, no hole in the middle
    assert loads["seq"].sort().to_list() == list(range(loads.height))


def test_record_engine_killed_and_restarted(tmp_path, engines):
    """The publisher process dies and comes back on the same ports: both lives recorded, a restart noted."""
    e = engines(dp_size=1)
    out = tmp_path / "rec"
    proc = start_record(out, [e.url])
    try:
        e.wait_subscribed()
        for i in range(5):
            e.send_load(0, i, 0, 0, 100)
        wait_rows(out, "loads", 5)
        ports = (e.http_port, e.load_base, e.kv_base, e.replay_base)
        e.close()
        time.sleep(0.3)
        # a new engine process on the same ports (the recorder reconnects by itself)
        e2 = _engine_on(ports)
        try:
            e2.wait_subscribed()
            for i in range(3):
                e2.send_load(0, 100 + i, 0, 0, 100)
            wait_rows(out, "loads", 8)
            time.sleep(0.5)
            rc, _, se = stop(proc)
        finally:
            e2.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, se
    loads = read_table(out, "loads")
    assert loads["num_running_reqs"].to_list() == [0, 1, 2, 3, 4, 100, 101, 102]
    facts = json.loads((out / "record.json").read_text())
    assert facts["restarts"] == 1 and facts["complete"] is True


def _engine_on(ports):
    import capture_fleet as cf

    http, lb, kb, rb = ports
    orig = cf.free_ports, cf.free_block
    it = iter([lb, kb, rb])
    cf.free_ports = lambda n: [http]
    cf.free_block = lambda n: next(it)
    try:
        return FakeEngine(dp_size=1)
    finally:
        cf.free_ports, cf.free_block = orig


def run_record(*args):
    return subprocess.run([sys.executable, "-m", "replay", "record", *map(str, args)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=60, check=False)


def test_record_nothing_answers(tmp_path):
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    r = run_record("--worker", dead, "--out", tmp_path / "rec", "--duration", "1s", "--retry", "0.3s")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: no worker answered /server_info: {dead}")
    assert "Traceback" not in r.stderr
    facts = json.loads((tmp_path / "rec" / "record.json").read_text())
    assert facts["complete"] is False and list(facts["unreachable"]) == [dead]
    # the failed run's folder is this tool's output: --force may replace it, nothing else may
    r = run_record("--worker", dead, "--out", tmp_path / "rec", "--duration", "0.5s", "--retry", "0.3s")
    assert r.returncode == 2 and "exists and is not empty (use --force" in r.stderr
    r = run_record("--worker", dead, "--out", tmp_path / "rec", "--duration", "0.5s", "--retry", "0.3s", "--force")
    assert r.returncode == 2 and "no worker answered" in r.stderr


def test_record_refuses_foreign_out(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for force in ([], ["--force"]):
        r = run_record("--worker", "http://127.0.0.1:9", "--out", out, "--duration", "1s", *force)
        assert r.returncode == 2 and "error:" in r.stderr and "Traceback" not in r.stderr
    assert (out / "notes.txt").read_text() == "keep me"


def test_record_sigint_and_status_line_on_a_terminal(tmp_path, engines):
    """On a terminal (a pty) the status line shows streams and rows/s; SIGINT stops cleanly."""
    import pty

    e = engines(dp_size=1)
    out = tmp_path / "rec"
    master, slave = pty.openpty()
    args = [sys.executable, "-m", "replay", "record", "--out", str(out), "--flush-interval", "0.3s",
            "--worker", e.url]
    proc = subprocess.Popen(args, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    try:
        e.wait_subscribed()
        for i in range(40):
            e.send_load(0, i, 0, 0, 100)
            time.sleep(0.05)
        time.sleep(1.2)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert proc.returncode == 0
    text = seen.decode(errors="replace")
    assert "\rrecording 1/1 workers, 2/2 streams live" in text or "\rrecording 1/1 workers, 1/2 streams live" in text
    assert "rows/s, 0 gaps, 0 restarts, 0 malformed" in text
    assert json.loads((out / "record.json").read_text())["complete"] is True
    assert read_table(out, "loads").height == 40


def test_record_piped_is_quiet(tmp_path, engines):
    e = engines(dp_size=1)
    out = tmp_path / "rec"
    proc = start_record(out, [e.url])
    try:
        e.wait_subscribed()
        for i in range(20):
            e.send_load(0, i, 0, 0, 100)
            time.sleep(0.06)
        time.sleep(0.5)
        rc, so, se = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0 and se == ""
    assert so.count("\n") == 1 and so.startswith("recorded 20 load rows and 0 KV events from 1 workers (2 streams)")


def test_record_late_engine_and_silent_replay_socket(tmp_path, engines):
    """An engine whose /server_info answers only later is picked up by the retry; a replay socket
    that never answers turns the missing range into a gap after --replay-timeout."""
    e = engines(dp_size=1, answer_http=False)
    out = tmp_path / "rec"
    dead_replay = free_ports(1)[0]
    proc = start_record(out, [e.url], "--replay-port-base", dead_replay, "--replay-timeout", "0.5s")
    try:
        first = read_stderr_until(proc, "no /server_info answer")   # named while it was down
        e._start_http()                      # the engine comes up
        e.wait_subscribed()
        e.send_kv(0, [stored([1], None, 4, 4, as_map=True)])
        e.send_kv(0, [stored([2], 1, 4, 4, as_map=True)], publish=False)
        e.send_kv(0, [stored([3], 2, 4, 4, as_map=True)])
        time.sleep(1.5)
        rc, _, se = stop(proc)
        se = first + se
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, se
    assert f"{e.url}: no /server_info answer" in se          # named while it was down
    facts = json.loads((out / "record.json").read_text())
    assert facts["unreachable"] == {} and list(facts["workers"]) == [e.url]
    gaps = read_table(out, "gaps")
    row = gaps.filter(pl.col("kind") == "gap").row(0, named=True)
    assert (row["stream"], row["from_seq"], row["to_seq"]) == ("kv", 1, 1)
    assert row["reason"] == "the replay socket did not answer in time"
    assert read_table(out, "kv_events")["seq"].to_list() == [0, 2]


def test_record_publisher_process_killed_and_restarted(tmp_path):
    """An engine process killed with -9 mid-stream and started again on the same ports: the first
    life's samples are a gap-free prefix, the second life's all there, one restart counted."""
    http, = free_ports(1)
    from capture_fleet import free_block

    ports = [http, free_block(1), free_block(1), free_block(1)]
    url = f"http://127.0.0.1:{http}"
    out = tmp_path / "rec"
    helper = str(Path(__file__).with_name("capture_fleet.py"))

    def engine(count, first):
        p = subprocess.Popen([sys.executable, helper, *map(str, ports), str(count), str(first)], cwd=ROOT,
                             env=_env(), stdout=subprocess.PIPE, text=True)
        return p

    first = engine(100_000, 0)                 # would publish for minutes: it is killed mid-stream
    time.sleep(0.5)
    proc = start_record(out, [url])
    second = None
    try:
        assert first.stdout.readline().strip() == "ready"
        wait_rows(out, "loads", 200)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        time.sleep(0.3)
        second = engine(50, 1_000_000)
        assert second.stdout.readline().strip() == "ready"
        assert second.stdout.readline().strip() == "done"
        time.sleep(0.8)
        rc, _, se = stop(proc)
    finally:
        for p in (proc, first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert rc == 0, se
    loads = read_table(out, "loads").sort("ts", maintain_order=True)
    life1 = loads.filter(pl.col("num_running_reqs") < 1_000_000)
    life2 = loads.filter(pl.col("num_running_reqs") >= 1_000_000)
    assert life1.height >= 200
    assert life1["seq"].to_list() == list(range(life1.height))          # a prefix, no hole
    assert life1["num_running_reqs"].to_list() == list(range(life1.height))
    assert life2["seq"].to_list() == list(range(50))
    assert life2["num_running_reqs"].to_list() == list(range(1_000_000, 1_000_050))
    facts = json.loads((out / "record.json").read_text())
    assert facts["restarts"] == 1 and facts["gaps"] == 0 and facts["complete"] is True


def test_record_workers_file_and_duration(tmp_path, engines):
    e = engines(dp_size=1)
    wf = tmp_path / "fleet.txt"
    wf.write_text(f"# the fleet\n\n{e.url}   # engine a\n")
    out = tmp_path / "rec"
    proc = subprocess.Popen([sys.executable, "-m", "replay", "record", "--workers-file", str(wf), "--out", str(out),
                             "--duration", "4s", "--flush-interval", "0.5s"], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        e.wait_subscribed()
        for i in range(10):
            e.send_load(0, i, 0, 0, 100)
        _, se = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, se
    assert json.loads((out / "record.json").read_text())["complete"] is True
    assert read_table(out, "loads").height == 10
    wf.write_text(f"{e.url}\nnot-a-url\n")
    r = run_record("--workers-file", wf, "--out", tmp_path / "rec2", "--duration", "1s")
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {wf}: line 2: not a worker URL: 'not-a-url'"
