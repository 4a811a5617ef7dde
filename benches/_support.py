"""Shared machinery of the speed benchmarks (``benches/``): the cached 1M trace,
grids, sub-trace slicing, engine / reference / CLI runners and the issue's floors.

Used by ``benches/conftest.py`` (pytest-benchmark) and ``benches/measure.py``
(the one-shot figures table).  Nothing here asserts anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SAMPLE_TRACE = REPO / "traces" / "sample"

# The bench trace (section 6): 1M requests, 64 workers, dp_size 2,
# load samples every 100 ms per rank, up to 8 matches a request.
# ``ROUTER_REPLAY_BENCH_REQUESTS`` overrides the request count (smoke runs only).
BENCH_PARAMS = dict(n_requests=int(os.environ.get("ROUTER_REPLAY_BENCH_REQUESTS", 1_000_000)),
                    n_workers=64, dp_size=2, sample_interval_ms=100, max_matches=8, seed=0)

# Grids (router flag -> value spec).  "mixed" is 8 limits x 9 floors = 72
# combinations of which floor > limit ones are refused (60 valid); "all_valid"
# is 8 x 9 with every combination valid (72 configs).
GRIDS: dict[str, dict[str, str]] = {
    "mixed": {"--worker-queue-limit": "2,4,6,8,10,12,14,16", "--saturation-queue-floor": "none,1..8"},
    "all_valid": {"--worker-queue-limit": "8..15", "--saturation-queue-floor": "none,1..8"},
    # the second speed round's grid: 16 limits x 17 floors, 152 valid configs
    "g152": {"--worker-queue-limit": "1..16", "--saturation-queue-floor": "none,1..16"},
}

# Sub-trace for the reference ratio: this many requests.
SUBTRACE_REQUESTS = 2_000
# Loads kept before a sub-trace's first request (the snapshot state warms up on them).
SUBTRACE_LOOKBACK_NS = 60 * 1_000_000_000

# The first speed floors (reported, never asserted).
FLOORS = {
    "decisions_per_s": 20e6,      # >= 20M request-config decisions per second
    "reference_ratio": 100.0,     # >= 100x reference.py
    "peak_rss_bytes": 4 * 2**30,  # < 4 GiB
    "cached_start_s": 3.0,        # cached second start of the CLI < 3 s
    "first_decision_s": 15.0,     # second speed round: first start, empty numba cache, to the first decision < 15 s
    "cached_sample_s": 2.0,       # second speed round: cached start of the sample sweep < 2 s
}


# Figures the benches computed (name -> dict), printed at the end of the
# pytest run by conftest.py's terminal summary.
REPORT: dict[str, dict] = {}


# ---------------------------------------------------------------------------
# the cached bench trace


def bench_root() -> Path:
    """``$ROUTER_REPLAY_BENCH_DIR`` or ``~/.cache/router-replay``."""
    env = os.environ.get("ROUTER_REPLAY_BENCH_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "router-replay"


def _generator_hash() -> str:
    return hashlib.sha256((REPO / "replay" / "trace" / "synthetic.py").read_bytes()).hexdigest()[:16]


def size_label(n: int) -> str:
    """1000000 -> "1M", 20000 -> "20k"."""
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else (f"{n // 1000}k" if n % 1000 == 0 else str(n))


def trace_dir_for(params: dict) -> Path:
    """Cache directory of a generated trace, keyed by the generator parameters."""
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    return bench_root() / f"bench-{size_label(params['n_requests']).lower()}-{key}"


def ensure_trace(params: dict | None = None, *, log=None) -> Path:
    """Generate the bench trace once and reuse it.

    The cache directory is keyed by ``params``; its ``bench-params.json`` also
    records a hash of ``replay/trace/synthetic.py``, and the trace is regenerated (in
    place, atomically) when the generator changed.  Set
    ``ROUTER_REPLAY_BENCH_KEEP=1`` to reuse a trace from an older generator.
    """
    params = dict(BENCH_PARAMS if params is None else params)
    d = trace_dir_for(params)
    meta_path = d / "bench-params.json"
    want = {"params": params, "generator_sha256": _generator_hash()}
    if meta_path.exists():
        have = json.loads(meta_path.read_text())
        if have.get("params") == params and (have.get("generator_sha256") == want["generator_sha256"]
                                             or os.environ.get("ROUTER_REPLAY_BENCH_KEEP")):
            return d
    from replay.trace.synthetic import generate_trace

    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.partial-", dir=d.parent))
    try:
        if log:
            log(f"generating bench trace {params} -> {d} ...")
        t0 = time.perf_counter()
        summary = generate_trace(tmp, **params)
        want["summary"] = {k: v for k, v in summary.items() if k != "out_dir"}
        want["generate_s"] = round(time.perf_counter() - t0, 2)
        (tmp / "bench-params.json").write_text(json.dumps(want, indent=2) + "\n")
        if d.exists():
            shutil.rmtree(d)
        tmp.rename(d)
        if log:
            log(f"generated in {want['generate_s']} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return d


# The trace-set bench trace: 100M requests at 1000/s (about 28 h over two
# dates) in hourly partitions, same fleet as the 1M trace.
# ``ROUTER_REPLAY_BENCH_SET_REQUESTS`` overrides the request count (smoke runs only).
BENCH_SET_REQUESTS = 100_000_000
BENCH_SET_PARAMS = dict(n_workers=64, dp_size=2, sample_interval_ms=100, max_matches=8, seed=0,
                        rate_per_s=1000.0, partition_s=3600)


def bench_set_requests() -> int:
    """``$ROUTER_REPLAY_BENCH_SET_REQUESTS`` or 100M."""
    return int(os.environ.get("ROUTER_REPLAY_BENCH_SET_REQUESTS", BENCH_SET_REQUESTS))


def trace_set_dir_for(params: dict) -> Path:
    """Cache directory of a generated trace set, keyed by the parameters and
    the generator's source (a changed generator gets a new directory)."""
    key = hashlib.sha256((json.dumps(params, sort_keys=True) + _generator_hash()).encode()).hexdigest()[:10]
    return bench_root() / f"bench-set-{size_label(params['n_requests']).lower()}-{key}"


def bench_set_trace(n_requests: int | None = None, *, log=None) -> Path:
    """Path of the cached trace set of ``n_requests`` requests (default
    ``bench_set_requests()``: 100M unless overridden), generating it first if needed.

    ``replay.trace.synthetic.generate_trace_set(n_requests=N, **BENCH_SET_PARAMS)``
    is written into a temporary sibling directory (``.bench-set-...partial-*``)
    and renamed into place only when complete, so a directory under the
    final name is always a whole trace set; an interrupted build leaves only
    its partial sibling, which is never reused (delete it by hand).
    ``log(message)`` gets a line at the start, after each partition and at the end.
    """
    params = {"n_requests": bench_set_requests() if n_requests is None else int(n_requests), **BENCH_SET_PARAMS}
    d = trace_set_dir_for(params)
    if d.is_dir():
        return d
    from replay.trace.synthetic import generate_trace_set, plan_trace_set

    n_parts = len(plan_trace_set(params["n_requests"], rate_per_s=params["rate_per_s"],
                                 partition_s=params["partition_s"]))
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.partial-", dir=d.parent))
    t0 = time.perf_counter()

    def progress(k):
        if log:
            el = time.perf_counter() - t0
            log(f"partition {k}/{n_parts} written, {el:.0f} s elapsed, "
                f"~{el / k * (n_parts - k):.0f} s to go, peak RSS {peak_rss_bytes() / 2**30:.2f} GiB")

    try:
        if log:
            log(f"generating bench trace set {params} ({n_parts} partitions) -> {d} ...")
        summary = generate_trace_set(tmp, progress=progress, **params)
        meta = {"params": params, "generator_sha256": _generator_hash(),
                "summary": {k: v for k, v in summary.items() if k != "out_dir"},
                "generate_s": round(time.perf_counter() - t0, 2), "peak_rss_bytes": peak_rss_bytes()}
        (tmp / "bench-params.json").write_text(json.dumps(meta, indent=2) + "\n")
        try:
            tmp.rename(d)
        except OSError:
            if not d.is_dir():      # not a concurrent build that finished first
                raise
        if log:
            log(f"generated in {meta['generate_s']} s -> {d}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return d


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def grid(name: str):
    from replay.config import Grid

    return Grid.from_texts(GRIDS[name])


def grid_args(name: str) -> list[str]:
    out: list[str] = []
    for flag, spec in GRIDS[name].items():
        out += [flag, spec]
    return out


# ---------------------------------------------------------------------------
# sub-traces


def slice_trace(trace, start: int, stop: int, lookback_ns: int = SUBTRACE_LOOKBACK_NS):
    """Requests ``start:stop`` of a loaded trace, with the load rows from
    ``lookback_ns`` before the first of them up to the last.

    Both engines replay exactly this (smaller) trace; ``req_index`` keeps each
    request's position in the whole trace (the sampler's RNG stream).
    """
    start = max(0, start)
    stop = min(trace.n_requests, stop)
    t_first = int(trace.req_ts[start])
    t_last = int(trace.req_ts[stop - 1])
    a = int(np.searchsorted(trace.load_ts, t_first - lookback_ns, side="left"))
    b = int(np.searchsorted(trace.load_ts, t_last, side="right"))
    off = trace.match_offsets
    m0, m1 = int(off[start]), int(off[stop])
    req = slice(start, stop)
    loads = {f.name: getattr(trace, f.name)[a:b] for f in dataclasses.fields(trace)
             if f.name.startswith("load_")}
    return dataclasses.replace(
        trace,
        request_id=trace.request_id[req], req_ts=trace.req_ts[req], req_model=trace.req_model[req],
        req_input_tokens=trace.req_input_tokens[req], req_query_blocks=trace.req_query_blocks[req],
        req_best_prefix_blocks=trace.req_best_prefix_blocks[req],
        match_offsets=off[start:stop + 1] - m0, match_worker=trace.match_worker[m0:m1],
        match_blocks=trace.match_blocks[m0:m1],
        req_selected_worker=None if trace.req_selected_worker is None else trace.req_selected_worker[req],
        req_index=trace.req_index[req], facts=type(trace.facts)(), **loads,
    )


def burst_start(trace, params: dict | None = None) -> int:
    """Index of the first request 5 s into the generator's first fleet-saturating
    burst (it starts at 25% of the span, see replay/trace/synthetic.py)."""
    t0 = int(trace.req_ts[0])
    span = int(trace.req_ts[-1]) - t0
    return int(np.searchsorted(trace.req_ts, t0 + span // 4 + 5_000_000_000))


def subtraces(trace, n: int = SUBTRACE_REQUESTS) -> dict:
    """The sub-traces the reference ratio is measured on: the head of the
    trace (calm) and a window inside the first saturating burst."""
    b = burst_start(trace)
    return {"head": slice_trace(trace, 0, n), "burst": slice_trace(trace, b, b + n)}


# ---------------------------------------------------------------------------
# runners


def warm_up(configs) -> float:
    """Compile (or load from numba's cache) every kernel on the small sample
    trace, so timed runs exclude compilation.  Returns the seconds it took."""
    from replay.sweep import engine
    from replay.trace import load_trace

    t0 = time.perf_counter()
    engine.decide_all(load_trace(SAMPLE_TRACE), configs)
    return time.perf_counter() - t0


def run_engine(trace, configs, threads: int | None = None) -> int:
    """Replay through ``engine.iter_chunks`` as ``sweep --no-decisions`` does: every
    decision is made and booked into the per-config accumulators, none is kept.
    Returns the number of decisions."""
    from replay.sweep import engine

    n = 0
    totals = engine.new_totals(len(configs), threads=threads)
    for ch in engine.iter_chunks(trace, configs, threads=threads, keep=False, totals=totals):
        n += (ch.stop - ch.start) * len(configs)
    return n


def run_decide_all(trace, configs) -> dict:
    from replay.sweep import engine

    return engine.decide_all(trace, configs)


def run_reference(trace, configs) -> dict:
    from replay import reference

    return reference.replay(trace, configs)


def same_decisions(a: dict, b: dict) -> bool:
    """Field-by-field equality of two decision dicts (NaN equals NaN)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.shape != y.shape:
            return False
        if x.dtype.kind == "f":
            if not np.array_equal(x, y, equal_nan=True):
                return False
        elif not np.array_equal(x, y):
            return False
    return True


TIME_BIN = "/usr/bin/time"


def cli_command() -> list[str]:
    """``router-replay`` of this interpreter's environment."""
    exe = Path(sys.executable).parent / "router-replay"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "replay"]


def run_cli(args: list[str], *, env: dict | None = None, cwd: Path | None = None) -> dict:
    """Run ``router-replay ARGS`` as a subprocess; wall time and peak RSS.

    Peak RSS comes from ``/usr/bin/time -v`` when present, else from
    ``getrusage(RUSAGE_CHILDREN)`` (the maximum over all children so far: an
    upper bound).
    """
    cmd = cli_command() + list(args)
    use_time = os.access(TIME_BIN, os.X_OK)
    if use_time:
        cmd = [TIME_BIN, "-v"] + cmd
    full_env = dict(os.environ)
    full_env.update(env or {})
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=full_env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rss = None
    stderr = p.stderr
    if use_time:
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
        rss = int(m.group(1)) * 1024 if m else None
        stderr = stderr.split("\tCommand being timed:")[0]
    else:
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{stderr[-2000:]}")
    return {"wall_s": wall, "peak_rss_bytes": rss, "rss_source": "time -v" if use_time else "getrusage",
            "stdout": p.stdout, "stderr": stderr}


def run_sweep_cli(trace_dir: Path, grid_name: str, *, decisions: bool, work: Path,
                  env: dict | None = None) -> dict:
    """``router-replay sweep`` into a fresh run dir under ``work``; adds the
    run's own timings (run.json: load, replay, accumulate+write) and the size
    of what it wrote.  The run dir is removed afterwards."""
    out = Path(tempfile.mkdtemp(prefix="run-", dir=work)) / "run"
    try:
        args = ["sweep", str(trace_dir), "--out", str(out), "-q",
                "--decisions" if decisions else "--no-decisions", *grid_args(grid_name)]
        r = run_cli(args, env=env)
        run = json.loads((out / "run.json").read_text())
        r["timings"] = run.get("timings", {})
        r["n_configs"] = len(run.get("config_ids", []))
        r["n_requests"] = run["trace"]["requests"]
        r["out_bytes"] = sum(f.stat().st_size for f in out.iterdir())
        return r
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


def sample_sweep(work: Path, env: dict | None = None) -> float:
    """Wall time of ``router-replay sweep traces/sample`` (decisions written) into a fresh run dir."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work)) / "run"
    try:
        return run_cli(["sweep", str(SAMPLE_TRACE), "--out", str(run_dir), "-q"], env=env)["wall_s"]
    finally:
        shutil.rmtree(run_dir.parent, ignore_errors=True)


def fresh_numba_cache(work: Path) -> dict:
    """Environment with an empty ``NUMBA_CACHE_DIR`` (under ``work``)."""
    return {"NUMBA_CACHE_DIR": tempfile.mkdtemp(prefix="numba-cache-", dir=work)}


def source_stamp() -> dict:
    """(mtime, size) of every module under replay/ that defines numba kernels:
    numba's on-disk cache is keyed by its source file's stamp, so an edit
    between two runs (others working in the tree) makes the second compile again."""
    return {str(p.relative_to(REPO)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted((REPO / "replay").rglob("*.py")) if "njit" in p.read_text()}


# README's first command, in a child process: the real run_sweep, timed from the
# child's first line; its ``progress`` callback fires when the first chunk of
# decisions is done (traces/sample is one chunk under this grid).
_FIRST_START = r"""
import json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
from replay import run_sweep
first = {}
def progress(n):
    if not first:
        first.update(wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0)
run_sweep(sys.argv[1], {"worker_queue_limit": "none,2,4,8", "saturation_queue_floor": "none,1..4"},
          out=sys.argv[2], progress=progress)
import resource
from replay.kernels import warm
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"first_decision_wall_s": first["wall_s"], "first_decision_cpu_s": first["cpu_s"],
                  "total_wall_s": time.perf_counter() - t0, "total_cpu_s": time.process_time() - c0,
                  "compile_child_cpu_s": kids.ru_utime + kids.ru_stime,
                  "compile_mode": warm.LAST.get("mode"), "compile_waited_s": warm.LAST.get("waited_s", 0.0)}))
"""


def first_start(work: Path, env: dict | None = None) -> dict:
    """README's ``router-replay sweep traces/sample --out RUN --worker-queue-limit
    none,2,4,8 --saturation-queue-floor none,1..4`` through ``run_sweep`` in a
    child process with ``env`` (default: a fresh, empty ``NUMBA_CACHE_DIR``):
    wall and CPU seconds (the child's own) to the first decision and in total,
    plus the parent's wall time of the whole child (interpreter start included).
    On a cold cache the sweep compiles on both cores (``replay/kernels/warm.py``):
    ``compile_child_cpu_s`` is the CPU time of its compile process (reaped before
    the first decision), ``compile_mode`` what ``warm.both_cores`` did; set
    ``ROUTER_REPLAY_COMPILE_CHILD=0`` in ``env`` for the one-process compile."""
    own = env is None
    env = fresh_numba_cache(work) if own else env
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work)) / "run"
    try:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", _FIRST_START, str(SAMPLE_TRACE), str(run_dir)],
                           env={**os.environ, **env}, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise RuntimeError(f"first start failed ({p.returncode}): {p.stderr[-2000:]}")
        out = json.loads(p.stdout.strip().splitlines()[-1])
        out["process_wall_s"] = wall
        return out
    finally:
        shutil.rmtree(run_dir.parent, ignore_errors=True)
        if own:
            shutil.rmtree(env["NUMBA_CACHE_DIR"], ignore_errors=True)


def cached_start(work: Path) -> dict:
    """``router-replay sweep traces/sample`` twice with a fresh, empty numba
    cache dir: the first run compiles and fills it, the second loads from it.
    ``sources_changed`` tells whether replay/ was edited in between (then the
    second figure includes a compile and is not a cached start)."""
    env = fresh_numba_cache(work)
    try:
        before = source_stamp()
        first = sample_sweep(work, env)
        mid = source_stamp()
        second = sample_sweep(work, env)
        return {"first": first, "second": second,
                "sources_changed": mid != before or source_stamp() != mid}
    finally:
        shutil.rmtree(env["NUMBA_CACHE_DIR"], ignore_errors=True)


def help_start(repeat: int = 3) -> float:
    """Best of ``repeat`` wall times of ``router-replay --help``."""
    return min(run_cli(["--help"])["wall_s"] for _ in range(repeat))


def machine() -> dict:
    import platform

    import numba

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpus": os.cpu_count(), "numba_threads": numba.config.NUMBA_NUM_THREADS,
            "python": platform.python_version(), "numba": numba.__version__,
            "loadavg_at_start": [round(x, 2) for x in load] if load else None}


def git_rev() -> str | None:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "replay"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("+dirty(replay/)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def _main(argv: list[str]) -> int:
    """``python3 benches/_support.py build-set [N]``: build (or find) the cached
    trace set and print its path; progress goes to stderr."""
    if len(argv) not in (1, 2) or argv[0] != "build-set":
        print("usage: python3 benches/_support.py build-set [N]", file=sys.stderr)
        return 2
    n = int(argv[1].replace("_", "")) if len(argv) == 2 else None

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    print(bench_set_trace(n, log=log), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))       # this checkout's replay/ (the one hashed above)
    sys.exit(_main(sys.argv[1:]))


# ---------------------------------------------------------------------------
# scale: the 100M trace set, streaming windows, the Ray executor

# the grid of the scale benches: 3 limits x 3 floors, 7 valid configs
SCALE_GRID = {"--worker-queue-limit": "2,4,8", "--saturation-queue-floor": "none,1,2"}


def scale_args() -> list[str]:
    return [x for kv in SCALE_GRID.items() for x in kv]


def first_partitions(set_dir: Path, n: int, work: Path) -> Path:
    """A trace set of the first ``n`` hourly partitions of ``set_dir`` (symlinks):
    the sub-trace that fits in memory."""
    out = Path(tempfile.mkdtemp(prefix="subset-", dir=work)) / "trace"
    for kind in ("requests", "loads"):
        files = sorted((set_dir / kind).rglob("*.parquet"), key=lambda p: p.relative_to(set_dir).parts)[:n]
        for f in files:
            dst = out / f.relative_to(set_dir)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(f)
    (out / "workers.parquet").symlink_to(set_dir / "workers.parquet")
    return out


def run_scale_sweep(trace_dir: Path, work: Path, *extra: str) -> dict:
    """``router-replay sweep TRACE --no-decisions --no-report`` on the scale grid,
    with ``extra`` flags; wall, peak RSS and the run's own timings/execution."""
    out = Path(tempfile.mkdtemp(prefix="run-", dir=work)) / "run"
    try:
        r = run_cli(["sweep", str(trace_dir), "--out", str(out), "-q", "--no-decisions", "--no-report",
                     *scale_args(), *extra])
        run = json.loads((out / "run.json").read_text())
        r.update(timings=run["timings"], execution=run["execution"], n_requests=run["trace"]["requests"],
                 n_configs=len(run["config_ids"]),
                 summary_sha256=hashlib.sha256((out / "summary.parquet").read_bytes()).hexdigest())
        r["decisions_per_s"] = r["n_requests"] * r["n_configs"] / r["wall_s"]
        return r
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
