"""Where the grid pass's time goes, per compiled function: a sampled profile of the JIT code.

    python benches/jit_profile.py                 # 1M bench trace, 152-config grid, 1 thread
    python benches/jit_profile.py --threads 2 --grid mixed --top 30
    python benches/jit_profile.py --simulate on_change   # the simulator, Mooncake, 16 x dp 2

Runs the engine once under ``perf record -e cpu-clock`` (software clock: it works
without hardware counters, as on this VM), then attributes each sample to the
function of the compiled kernel it fell in. numba's JIT code has no symbols for
perf, so the names come from the cached objects themselves: each ``.nbc`` file of
numba's cache holds the ELF object numba loaded, whose symbol table gives every
function's offset and size in its code section, and the process writes down
where ``_decide_request`` and ``run_chunk_nb`` were loaded. A helper that LLVM
inlined has no row of its own (its samples count for its caller); one it left as
a call has (the second speed round's seventh step found ten of those this way).

``--simulate POLICY`` profiles the simulator's event loop instead (``simulate_nb`` and what
it calls; ten ``simulate()`` runs of the Mooncake conversation trace on 16 workers x dp 2,
the bench's fleet): a function's share of the kernel's samples, times the kernel's CPU
seconds per request, is where a request's time goes.

Profile code compiled as users get it: a cache compiled under
``NUMBA_ENABLE_PROFILING=1`` inlines nothing and runs about 20% slower.
Needs ``perf`` and binutils' ``nm``; prints a table, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _support as S  # noqa: E402 - importable once sys.path holds benches/

KERNELS = ("_decide_request", "run_chunk_nb")
SIM_KERNEL = "simulate_nb"
SIM_RUNS = 10


def _sim_child(args) -> None:
    """Under perf: ``SIM_RUNS`` simulations, then where ``simulate_nb`` was loaded (and the
    first bytes of its code, to find the cached object it came from)."""
    import ctypes
    from dataclasses import replace

    from test_bench_simulate import MOONCAKE

    from replay.config import RouterConfig
    from replay.kernels import sim
    from replay.simulate import FleetSpec, build_fleet, read_mooncake, simulate

    log = read_mooncake(MOONCAKE)
    fleet = build_fleet(replace(FleetSpec(workers=16, dp_size=2, prefill_tokens_per_s=10_000,
                                          decode_tokens_per_s=40, max_running_requests=32,
                                          max_total_num_tokens=300_000), publish_policy=args.simulate))
    simulate(log.head(200), fleet)
    for _ in range(SIM_RUNS):
        simulate(log, fleet, RouterConfig(worker_queue_limit=4, saturation_queue_floor=2))
    cres = next(iter(sim.simulate_nb.overloads.values()))
    addr = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    Path(args.child).write_text(json.dumps({SIM_KERNEL: addr, "head": ctypes.string_at(addr, 32).hex(),
                                            "requests": log.n_requests}))


def _child(args) -> None:
    """Under perf: replay once, then write where the two kernels' code was loaded."""
    from replay.kernels import one_pass
    from replay.sweep import engine
    from replay.trace import load_trace

    configs = S.grid(args.grid).configs
    S.warm_up(configs)
    trace = load_trace(S.ensure_trace())
    S.run_engine(trace, configs, threads=args.threads)
    where = {"_decide_request": int(engine.decide_link()[0])}
    for cres in one_pass.run_chunk_nb.overloads.values():
        where["run_chunk_nb"] = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    Path(args.child).write_text(json.dumps(where))


def _symbols(kernel: str, module: str = "one_pass", head: str = "") -> list[tuple[int, int, str]]:
    """``(offset from the kernel's entry, size, name)`` of every function in the
    cached object that defines ``kernel`` (the newest such ``.nbc`` file, holding the
    code bytes ``head`` when given)."""
    from replay.kernels import _jit

    files = sorted(_jit.cache_dir().rglob(f"{module}.{kernel}-*.nbc"), key=lambda p: p.stat().st_mtime)
    files = [f for f in files if bytes.fromhex(head) in f.read_bytes()]
    if not files:
        raise SystemExit(f"no cached object of {kernel} under {_jit.cache_dir()}")
    blob = files[-1].read_bytes()
    with tempfile.NamedTemporaryFile(suffix=".o") as obj:
        obj.write(blob[blob.index(b"\x7fELF"):])
        obj.flush()
        out = subprocess.run(["nm", "-S", "--defined-only", obj.name], capture_output=True, text=True,
                             check=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "TtWw":
            rows.append((int(parts[0], 16), int(parts[1], 16), _short(parts[3])))
    entry = next(off for off, _size, name in rows if name.endswith(kernel))
    return [(off - entry, size, name) for off, size, name in rows]


def _short(mangled: str) -> str:
    """``replay.kernels.decide.resolve_cache_with_nb`` from numba's mangled name."""
    name = mangled.removeprefix("_ZN")
    words = []
    while name and name[0].isdigit():
        digits = len(name) - len(name.lstrip("0123456789"))
        n = int(name[:digits])
        words.append(name[digits:digits + n])
        name = name[digits + n:]
    return ".".join(words) or mangled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", default="g152", choices=sorted(S.GRIDS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=20, help="rows to print")
    ap.add_argument("--simulate", choices=("interval", "on_change"),
                    help="profile the simulator with this publish policy instead")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        (_sim_child if args.simulate else _child)(args)
        return
    if shutil.which("perf") is None or shutil.which("nm") is None:
        raise SystemExit("needs perf and nm on PATH")
    if args.simulate:
        _profile_simulate(args)
        return
    S.warm_up(S.grid(args.grid).configs)   # compile outside the profile
    with tempfile.TemporaryDirectory() as tmp:
        ips, where = _record(["--grid", args.grid, "--threads", str(args.threads)], Path(tmp))
    counts: Counter = Counter()
    for kernel in KERNELS:
        for off, size, name in _symbols(kernel):
            lo = where[kernel] + off
            counts[name] += sum(1 for ip in ips if lo <= ip < lo + size)
    in_kernels = sum(counts.values())
    print(f"{len(ips)} samples, {in_kernels} in the two kernels' code ({100 * in_kernels / max(len(ips), 1):.0f}%; "
          "the rest: Python, loading the trace, compiling)")
    print(f"{'samples':>8} {'share':>6}  function")
    for name, n in counts.most_common(args.top):
        print(f"{n:8d} {100 * n / max(in_kernels, 1):5.1f}%  {name}")


def _record(child_args: list[str], tmp: Path) -> tuple[list[int], dict]:
    """``perf record`` of this script as a child with ``child_args``: the sampled
    instruction addresses and what the child wrote down."""
    data, where_file = tmp / "perf.data", tmp / "where.json"
    subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-F", "4000", "-o", str(data), "--",
                    sys.executable, __file__, *child_args, "--child", str(where_file)], check=True)
    ips = [int(x, 16) for x in subprocess.run(["perf", "script", "-i", str(data), "-F", "ip"],
                                              capture_output=True, text=True, check=True).stdout.split()]
    return ips, json.loads(where_file.read_text())


def _profile_simulate(args) -> None:
    """Where the simulator's kernel spends its samples, per compiled function."""
    with tempfile.TemporaryDirectory() as tmp:
        ips, where = _record(["--simulate", args.simulate], Path(tmp))
    counts: Counter = Counter()
    for off, size, name in _symbols(SIM_KERNEL, "sim", where["head"]):
        lo = where[SIM_KERNEL] + off
        counts[name] += sum(1 for ip in ips if lo <= ip < lo + size)
    total = sum(counts.values())
    per_run_ms = total / 4000 / SIM_RUNS * 1000
    print(f"{len(ips)} samples, {total} in the simulator's kernel ({per_run_ms:.0f} ms per run, "
          f"{per_run_ms * 1000 / where['requests']:.2f} us per request at 4 kHz sampling)")
    print(f"{'samples':>8} {'share':>6} {'us/request':>10}  function")
    for name, n in counts.most_common(args.top):
        print(f"{n:8d} {100 * n / max(total, 1):5.1f}% {n / 4000 / SIM_RUNS / where['requests'] * 1e6:10.2f}  {name}")


if __name__ == "__main__":
    main()
