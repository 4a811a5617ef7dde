"""Where the grid pass's time goes, per compiled function: a sampled profile of the JIT code.

    python benches/jit_profile.py                 # 1M bench trace, 152-config grid, 1 thread
    python benches/jit_profile.py --threads 2 --grid mixed --top 30

Runs the engine once under ``perf record -e cpu-clock`` (software clock: it works
without hardware counters, as on this VM), then attributes each sample to the
function of the compiled kernel it fell in. numba's JIT code has no symbols for
perf, so the names come from the cached objects themselves: each ``.nbc`` file of
numba's cache holds the ELF object numba loaded, whose symbol table gives every
function's offset and size in its code section, and the process writes down
where ``_decide_request`` and ``run_chunk_nb`` were loaded. A helper that LLVM
inlined has no row of its own (its samples count for its caller); one it left as
a call has (the second speed round's seventh step found ten of those this way).

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


def _symbols(kernel: str) -> list[tuple[int, int, str]]:
    """``(offset from the kernel's entry, size, name)`` of every function in the
    cached object that defines ``kernel`` (the newest such ``.nbc`` file)."""
    from replay.kernels import _jit

    files = sorted(_jit.cache_dir().rglob(f"one_pass.{kernel}-*.nbc"), key=lambda p: p.stat().st_mtime)
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
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    if shutil.which("perf") is None or shutil.which("nm") is None:
        raise SystemExit("needs perf and nm on PATH")
    S.warm_up(S.grid(args.grid).configs)   # compile outside the profile
    with tempfile.TemporaryDirectory() as tmp:
        data, where_file = Path(tmp) / "perf.data", Path(tmp) / "where.json"
        subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-F", "4000", "-o", str(data), "--",
                        sys.executable, __file__, "--grid", args.grid, "--threads", str(args.threads),
                        "--child", str(where_file)], check=True)
        where = json.loads(where_file.read_text())
        ips = [int(x, 16) for x in subprocess.run(["perf", "script", "-i", str(data), "-F", "ip"],
                                                  capture_output=True, text=True, check=True).stdout.split()]
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


if __name__ == "__main__":
    main()
