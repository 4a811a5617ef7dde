"""Measure every figure of the first speed floors once; print a Markdown table.

    python benches/measure.py            # all figures, writes benches/results.json
    python benches/measure.py --quick    # skip the 1M CLI sweep that writes decisions.parquet

Figures (1M-request bench trace, generated once and cached, see _support.py):

* engine request-config decisions per second (``engine.iter_chunks``,
  chunks dropped, compile excluded), on the "mixed" grid (8 limits x 9 floors,
  floor > limit skipped) and the "all_valid" grid (8 x 9, all valid);
* ``load_trace`` time of the 1M trace;
* ratio to ``reference.py`` on 2,000-request sub-traces (head and burst);
* ``router-replay sweep`` end to end as a subprocess, with and without
  decisions.parquet: wall time, the run's own split (load / replay /
  accumulate+write) and peak RSS;
* cached second start of the CLI (traces/sample, fresh numba cache dir) and
  ``router-replay --help``.

The floors of the issue are reported as pass/fail; nothing is asserted.
The machine may be shared: figures are wall-clock and noisy.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _support as S  # noqa: E402 - importable once sys.path holds benches/


def log(msg: str) -> None:
    print(f"[measure {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _fmt_rate(x: float) -> str:
    return f"{x / 1e6:.2f} M/s"


def _gib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**30:.2f} GiB"


def _verdict(ok: bool | None) -> str:
    return "" if ok is None else ("pass" if ok else "**FAIL**")


def measure(args) -> dict:
    res: dict = {"machine": S.machine(), "git": S.git_rev(), "started_unix": int(time.time()),
                 "params": S.BENCH_PARAMS, "floors": S.FLOORS}
    log(f"machine {res['machine']}")
    t0 = time.perf_counter()
    trace_dir = S.ensure_trace(log=log)
    res["trace_dir"] = str(trace_dir)
    res["ensure_trace_s"] = round(time.perf_counter() - t0, 2)
    meta = json.loads((trace_dir / "bench-params.json").read_text())
    res["trace_summary"] = meta.get("summary")

    grids = {}
    for name in S.GRIDS:
        g = S.grid(name)
        grids[name] = {"spec": S.GRIDS[name], "combinations": g.n_combinations,
                       "valid": g.n_configs, "skipped": len(g.skipped)}
    res["grids"] = grids

    log("warm-up (compile or load numba cache) on traces/sample")
    res["warmup_s"] = round(S.warm_up(S.grid("mixed").configs), 3)

    S.bench_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="measure-work-", dir=S.bench_root()) as wd:
        work = Path(wd)
        # --- CLI figures first, while this process is still small ----------------
        log("cached start: sweep traces/sample twice with a fresh NUMBA_CACHE_DIR")
        res["cli_start"] = S.cached_start(work)
        res["cli_help_s"] = S.help_start()
        log("CLI warm-up: sweep traces/sample with the default numba cache")
        res["cli_warm_sample_s"] = S.sample_sweep(work)
        res["cli_sweep"] = {}
        runs = [False] if args.quick else [False, True]
        size = S.size_label(S.BENCH_PARAMS["n_requests"])
        for dec in runs:
            key = "decisions" if dec else "no_decisions"
            log(f"router-replay sweep {size} --{'decisions' if dec else 'no-decisions'} (grid mixed)")
            r = S.run_sweep_cli(trace_dir, "mixed", decisions=dec, work=work)
            r.pop("stdout", None)
            r.pop("stderr", None)
            res["cli_sweep"][key] = r
            log(f"  {r['wall_s']:.1f} s, peak RSS {_gib(r['peak_rss_bytes'])}, timings {r['timings']}")

    # --- in-process engine --------------------------------------------------------
    from replay.trace import load_trace

    log(f"load_trace {S.size_label(S.BENCH_PARAMS['n_requests'])}")
    t0 = time.perf_counter()
    trace = load_trace(trace_dir)
    res["load_trace_s"] = round(time.perf_counter() - t0, 3)
    res["engine"] = {}
    for name in S.GRIDS:
        configs = S.grid(name).configs
        times = []
        for _ in range(args.rounds):
            gc.collect()
            t0 = time.perf_counter()
            n = S.run_engine(trace, configs)
            times.append(time.perf_counter() - t0)
        best = min(times)
        res["engine"][name] = {"configs": len(configs), "decisions": n, "times_s": [round(t, 3) for t in times],
                               "best_s": round(best, 3), "decisions_per_s": n / best}
        log(f"engine {name}: {n:,} decisions, times {res['engine'][name]['times_s']} "
            f"-> {_fmt_rate(n / best)}")

    # --- reference ratio on sub-traces ------------------------------------------
    res["reference"] = {}
    configs = S.grid("mixed").configs
    for window, sub in S.subtraces(trace).items():
        log(f"reference vs engine on the {window} sub-trace ({sub.n_requests} requests x {len(configs)} configs)")
        eng_times = []
        S.run_decide_all(sub, configs)  # warm (chunk shapes)
        for _ in range(3):
            t0 = time.perf_counter()
            out = S.run_decide_all(sub, configs)
            eng_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref_out = S.run_reference(sub, configs)
        ref_s = time.perf_counter() - t0
        eng = min(eng_times)
        n = sub.n_requests * len(configs)
        res["reference"][window] = {
            "requests": sub.n_requests, "configs": len(configs), "load_rows": int(sub.load_ts.shape[0]),
            "engine_s": round(eng, 5), "reference_s": round(ref_s, 3), "ratio": ref_s / eng,
            "engine_decisions_per_s": n / eng, "reference_decisions_per_s": n / ref_s,
            "same_decisions": S.same_decisions(out, ref_out),
        }
        log(f"  engine {eng * 1e3:.1f} ms, reference {ref_s:.2f} s, ratio {ref_s / eng:.0f}x, "
            f"same={res['reference'][window]['same_decisions']}")
    # full-trace engine rate against the reference's sub-trace rate
    res["reference_ratio_full_rate"] = {
        w: res["engine"]["mixed"]["decisions_per_s"] / r["reference_decisions_per_s"]
        for w, r in res["reference"].items()}
    del trace
    gc.collect()
    res["finished_unix"] = int(time.time())
    res["machine"]["loadavg_at_end"] = [round(x, 2) for x in __import__("os").getloadavg()]
    return res


def table(res: dict) -> str:
    F = S.FLOORS
    size = S.size_label(res["params"]["n_requests"])
    rows: list[tuple[str, str, str, str]] = []
    ts = res.get("trace_summary") or {}
    rows.append(("bench trace", f"{res['params']['n_requests']:,} requests, {res['params']['n_workers']} workers "
                 f"x dp {res['params']['dp_size']}, {ts.get('load_rows', 0):,} load rows, "
                 f"{ts.get('match_entries', 0):,} match entries", "", ""))
    for name, g in res["grids"].items():
        spec = " ".join(f"{k} {v}" for k, v in g["spec"].items())
        rows.append((f"grid `{name}`", f"`{spec}`: {g['combinations']} combinations, {g['valid']} valid, "
                     f"{g['skipped']} skipped (floor > limit)", "", ""))
    for name, e in res["engine"].items():
        ok = e["decisions_per_s"] >= F["decisions_per_s"]
        rows.append((f"engine decisions/s, `{name}` ({e['configs']} configs)",
                     f"{_fmt_rate(e['decisions_per_s'])} ({e['decisions']:,} in {e['best_s']:.2f} s, "
                     f"best of {len(e['times_s'])})", ">= 20 M/s", _verdict(ok)))
    rows.append((f"`load_trace` of the {size} trace", f"{res['load_trace_s']:.2f} s", "", ""))
    for w, r in res["reference"].items():
        ok = r["ratio"] >= F["reference_ratio"]
        rows.append((f"ratio to reference.py, {w} sub-trace ({r['requests']:,} req x {r['configs']} cfg)",
                     f"{r['ratio']:.0f}x (engine {r['engine_s'] * 1e3:.1f} ms, reference {r['reference_s']:.2f} s"
                     f" = {r['reference_decisions_per_s'] / 1e3:.1f} k/s; outputs equal: "
                     f"{'yes' if r['same_decisions'] else 'NO'})", ">= 100x", _verdict(ok)))
    for w, x in res.get("reference_ratio_full_rate", {}).items():
        rows.append((f"full-trace engine rate / reference rate ({w})", f"{x:.0f}x", "", ""))
    for key, r in res["cli_sweep"].items():
        t = r.get("timings", {})
        n = r["n_requests"] * r["n_configs"]
        split = (f"load {t.get('load_s', 0):.1f} s, replay {t.get('replay_s', 0):.1f} s, "
                 f"accumulate+write {t.get('accumulate_and_write_s', 0):.1f} s") if t else ""
        flag = "--decisions" if key == "decisions" else "--no-decisions"
        rows.append((f"`router-replay sweep` {size} `{flag}` wall", f"{r['wall_s']:.1f} s "
                     f"({n / r['wall_s'] / 1e6:.2f} M decisions/s end to end; {split}; "
                     f"output {r['out_bytes'] / 2**20:.0f} MiB)", "", ""))
        rss = r.get("peak_rss_bytes")
        rows.append((f"`router-replay sweep` {size} `{flag}` peak RSS", f"{_gib(rss)} ({r['rss_source']})",
                     "< 4 GiB", _verdict(None if rss is None else rss < F["peak_rss_bytes"])))
    cs = res["cli_start"]
    note = ("; a numba kernel source in replay/ was edited during these runs, so the second "
            "may have compiled again" if cs.get("sources_changed") else "")
    rows.append(("CLI cached second start (`sweep traces/sample`)",
                 f"{cs['second']:.2f} s (first start, empty numba cache: {cs['first']:.1f} s{note})", "< 3 s",
                 _verdict(cs["second"] < F["cached_start_s"])))
    rows.append(("`router-replay --help`", f"{res['cli_help_s']:.2f} s (best of 3)", "", ""))
    m = res["machine"]
    lines = ["| figure | measured | floor | |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    lines.append("")
    lines.append(f"Machine: {m['cpus']} CPUs, numba threads {m['numba_threads']}, Python {m['python']}, "
                 f"numba {m['numba']}; load average {m.get('loadavg_at_start')} at start, "
                 f"{m.get('loadavg_at_end')} at end (shared machine: wall-clock figures are noisy). "
                 f"Code: {res.get('git')}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="skip the 1M sweep that writes decisions.parquet")
    ap.add_argument("--rounds", type=int, default=2, help="engine rounds per grid (best is reported)")
    ap.add_argument("--out", default=str(HERE / "results.json"), help="results JSON (default benches/results.json)")
    ap.add_argument("--no-write", action="store_true", help="print only, do not write the JSON")
    args = ap.parse_args(argv)
    res = measure(args)
    md = table(res)
    res["table_markdown"] = md
    print(md)
    if not args.no_write:
        Path(args.out).write_text(json.dumps(res, indent=2, default=float) + "\n")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
