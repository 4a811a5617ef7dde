"""A cold first start compiles on both cores (``replay/kernels/warm.py``).

Every test runs real Python processes with their own, empty numba cache: a
child process compiles ``_decide_request`` into the cache while the sweep's
process compiles the rest, and the grid kernel loads the child's function
from the cache.  Held here: the child's part is a cache hit in the parent,
the helpers' hand-built signatures are the ones a sweep compiles, a warm
start starts no child, a child that dies does not stop the sweep, a child
dies with its parent, and the decisions are those of an in-process compile.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "traces" / "sample"
GRID = '{"worker_queue_limit": "none,2,4,8", "saturation_queue_floor": "none,1..4"}'

# compile (or load) the kernels, run the README's sample sweep, report what happened
_SWEEP = r"""
import json, os, signal, sys, threading, time
from replay.sweep import engine
from replay.kernels import one_pass, warm
from replay import run_sweep
kill = sys.argv[3] == "kill"
if kill:
    thread = engine.compile_in_background()
    while "child_pid" not in warm.LAST and thread.is_alive():
        time.sleep(0.005)
    os.kill(warm.LAST["child_pid"], signal.SIGKILL)
run_sweep(sys.argv[1], json.loads(sys.argv[4]), out=sys.argv[2])
inner = warm.inner_signatures(engine.kernel_signatures()[one_pass.run_chunk_nb])
out = {"last": {k: str(v) for k, v in warm.LAST.items()},
       "stats": {n: [sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values())]
                 for n, (d, _) in inner.items()},
       "signatures": {n: [str(s) for s in d.overloads] for n, (d, _) in inner.items()},
       "built": {n: str(tuple(sig)) for n, (_, sig) in inner.items()}}
print(json.dumps(out))
"""


def _run(cache: Path, out: Path, mode: str = "plain", **env) -> dict:
    p = subprocess.run([sys.executable, "-c", _SWEEP, str(SAMPLE), str(out), mode, GRID],
                       env={**os.environ, "PYTHONPATH": str(REPO), "NUMBA_CACHE_DIR": str(cache), **env},
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _decisions(run: Path) -> pl.DataFrame:
    return pl.read_parquet(run / "decisions.parquet")


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """One cold start with the child; its cache and run directory."""
    d = tmp_path_factory.mktemp("cold")
    return d / "numba", d / "run", _run(d / "numba", d / "run")


def test_child_compiles_what_the_sweep_loads(cold):
    _, _, rep = cold
    assert rep["last"]["mode"] == "child", rep["last"]
    assert rep["last"]["child_returncode"] == "0"
    # the parent loaded the child's _decide_request from the cache and never compiled it
    assert rep["stats"]["_decide_request"] == [1, 0]
    assert rep["signatures"]["_decide_request"] == [rep["built"]["_decide_request"]]
    # what the parent compiled first is exactly what its kernels call (no second specialization)
    for name in ("cache_rung_with_nb", "accumulate_request_nb"):
        assert rep["signatures"][name] == [rep["built"][name]], name


def test_warm_start_starts_no_child(cold, tmp_path):
    cache, first_run, _ = cold
    rep = _run(cache, tmp_path / "run")
    assert rep["last"]["mode"] == "warm"
    assert "child_pid" not in rep["last"]
    assert _decisions(tmp_path / "run").equals(_decisions(first_run))


# a warm start of the sample sweep, then a kernel compiled in the same process
_WARM_THEN_COMPILE = r"""
import json, sys
import numba
from replay import run_sweep
run_sweep(sys.argv[1], json.loads(sys.argv[3]), out=sys.argv[2])
loaded = sorted(m for m in ("numba.cpython.listobj", "numba.cpython.setobj", "numba.core.typing.cffi_utils",
                            "numba.np.random.generator_methods") if m in sys.modules)

@numba.njit
def distinct_sorted(xs):
    seen = set()
    out = []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    out.sort()
    return out

print(json.dumps({"loaded": loaded, "compiled": distinct_sorted([3, 1, 3, 2, 1])}))
"""


def test_warm_start_loads_kernels_without_numbas_registries(cold, tmp_path):
    """Loading the kernels from the cache skips numba's registry refresh
    (``_jit._CacheLoadsOnly``): none of its list, set, cffi or random
    implementations is imported by a warm sweep, whose decisions are the cold
    run's; a kernel compiled afterwards in the same process still finds them."""
    cache, first_run, _ = cold
    p = subprocess.run([sys.executable, "-c", _WARM_THEN_COMPILE, str(SAMPLE), str(tmp_path / "run"), GRID],
                       env={**os.environ, "PYTHONPATH": str(REPO), "NUMBA_CACHE_DIR": str(cache)},
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["loaded"] == []
    assert rep["compiled"] == [1, 2, 3]
    assert _decisions(tmp_path / "run").equals(_decisions(first_run))


def test_a_killed_child_leaves_the_sweep_to_compile_everything(cold, tmp_path):
    """The child is SIGKILLed as soon as it starts: the sweep compiles every
    kernel in-process (its helpers with exactly the signatures warm.py builds)
    and decides as the run the child helped compile."""
    _, first_run, _ = cold
    rep = _run(tmp_path / "numba", tmp_path / "run", "kill")
    assert rep["last"]["mode"] == "child-failed", rep["last"]
    assert rep["last"]["child_returncode"] == str(-signal.SIGKILL)
    assert rep["stats"]["_decide_request"] == [0, 1]
    for name, sigs in rep["signatures"].items():
        assert sigs == [rep["built"][name]], name
    assert _decisions(tmp_path / "run").equals(_decisions(first_run))


def test_switched_off_is_one_process_and_the_same_decisions(cold, tmp_path):
    _, first_run, _ = cold
    rep = _run(tmp_path / "numba", tmp_path / "run", ROUTER_REPLAY_COMPILE_CHILD="0")
    assert rep["last"]["mode"] == "off"
    assert rep["stats"]["_decide_request"] == [0, 1]
    assert _decisions(tmp_path / "run").equals(_decisions(first_run))


_ORPHAN = r"""
import sys, time
from replay.sweep import engine
from replay.kernels import warm
engine.compile_in_background()
while "child_pid" not in warm.LAST:
    time.sleep(0.005)
print(warm.LAST["child_pid"], flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_the_child_dies_with_its_parent(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO), "NUMBA_CACHE_DIR": str(tmp_path)})
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the compile child outlived its parent"


def test_no_child_without_the_jit(tmp_path):
    code = ("from replay.sweep import engine; from replay.kernels import warm\n"
            "with warm.both_cores(engine.kernel_signatures()) as first: assert first == []\n"
            "print(warm.LAST['mode'])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO), "NUMBA_CACHE_DIR": str(tmp_path),
                            "NUMBA_DISABLE_JIT": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "off"


def test_a_cached_start_does_not_import_scipy_linalg(tmp_path):
    """numba's BLAS probe (``import scipy.linalg``, about 0.4 s of a cached start)
    is not made for the sweep's kernels (``_jit._arraymath_without_scipy``);
    a kernel that does use BLAS still compiles and gets it."""
    code = ("import sys\n"
            "import numpy as np, numba\n"
            "from replay.sweep import engine\n"
            "engine.compile_kernels()\n"
            "assert 'scipy.linalg' not in sys.modules, 'scipy.linalg imported'\n"
            "dot = numba.njit(lambda a, b: np.dot(a, b))\n"
            "a = np.arange(6.0).reshape(2, 3)\n"
            "assert np.array_equal(dot(a, a.T), a @ a.T)\n"
            "assert 'scipy.linalg' in sys.modules\n"
            "print('ok')")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "ok"
