"""Closed-loop answers: a simulator grid read back, found for a run, and ranked.

A *closed-loop grid* is a directory ``router-replay simulate`` wrote for a grid
of configs (``closed_loop_summary.parquet`` + ``sim.json``; with ``--seeds``
the summary has per-metric means, ``<metric>_lo`` / ``<metric>_hi`` 95%
intervals and a ``stable`` verdict).  ``calibrate --validate DIR`` writes one
as ``DIR/prediction/`` beside ``DIR/fidelity.json``, the model's fidelity
score against the recording.

* :func:`load_grid` reads one (a validation directory is accepted for its
  ``prediction/``), with its fidelity when present;
* :func:`find_for_run` looks for the grid of a run's trace next to the run and
  next to the trace, matched by the trace files' sha256 (or, for grids written
  before the simulator recorded them, by the trace's path);
* :func:`recommend` ranks stable configs by mean served (true) hit rate under
  an upper-95%-bound on TTFT p99 or queue wait p99, and says when the best two
  cannot be told apart;
* :data:`OPEN_LOOP_NOTE` / :func:`open_loop_line` is the one line every
  open-loop ranking carries.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from replay.analysis import ranking
from replay.config import GATE_KNOBS, KNOB_NAMES, KNOB_SHORT, KNOBS
from replay.errors import ParamError, ParamsError, ReplayError
from replay.runs import names
from replay.runs.metrics import HIT_POINTS

SUMMARY = names.CLOSED_LOOP
SIM_JSON = names.SIM_JSON
FIDELITY_JSON = names.FIDELITY_JSON
PREDICTION = names.PREDICTION
SIM_TOOL = names.SIM_TOOL

BOUNDS = {"ttft": ("ttft_ms_p99", "TTFT p99"), "queue_wait": ("queue_wait_ms_p99", "queue wait p99")}
"""The closed-loop metrics a recommendation can bound: option key -> (summary column, label)."""

BOUND_KINDS = {"mean": ("_hi", "the upper end of the 95% interval of the mean over the seeds"),
               "seed-range": ("_max", "the worst seed (the per-seed range: what one day may look like)")}
"""``--bound``: which upper end a seeded grid's bound is checked on -> (column suffix, what it is)."""


def interval_names(n_seeds: int) -> str:
    """The two kinds of interval, named once (pages and terminal)."""
    return (f"[lo..hi] is the 95% interval of the mean over {n_seeds} seeds (where the average lies); "
            "'seeds min..max' is the per-seed range (what one run, one day, may look like)")

OPEN_LOOP_NOTE = ("open-loop estimate (hit_rate is decision-time): the recorded loads do not react to the "
                  "replayed decisions, so a "
                  "config that diverts more can only look worse than the recording, and the no-gate "
                  "config ranks first by construction")
"""What an open-loop ranking is, in one line (shown wherever one ranks configs)."""

HIT_NAMES = ("hit_rate is the decision-time hit rate (blocks the chosen worker held when the router "
             "decided / query blocks); true_hit_rate is the served hit rate (tokens the engine found "
             "cached when it ran the request / input tokens)")
"""The two hit rates, named once (docs/closed-loop.md explains why they differ)."""


def closed_loop_command(trace_path: str | os.PathLike | None) -> str:
    """The commands that give the closed-loop answer for a trace."""
    t = str(trace_path) if trace_path else "TRACE"
    return (f"router-replay calibrate {t} --out fleet.toml --validate fit --seeds 5 <knobs>, then "
            f"router-replay recommend fit/prediction --max-ttft-p99-ms MS")


def open_loop_line(trace_path: str | os.PathLike | None) -> str:
    """:data:`OPEN_LOOP_NOTE` with the command that yields the closed-loop answer."""
    return f"{OPEN_LOOP_NOTE}; closed-loop answer: {closed_loop_command(trace_path)}"


# ---------------------------------------------------------------------------
# reading a grid


@dataclass
class ClosedLoopGrid:
    """A simulator grid directory read back: the summary, ``sim.json`` and the fidelity record."""

    path: Path
    summary: pl.DataFrame
    meta: dict
    fidelity: dict | None = None
    fidelity_path: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def seeded(self) -> bool:
        """Whether every config ran under several seeds (intervals and a stable verdict exist)."""
        return "stable" in self.summary.columns and "true_hit_rate_hi" in self.summary.columns

    @property
    def n_seeds(self) -> int:
        seeds = self.meta.get("seeds")
        return len(seeds) if isinstance(seeds, list) else 1

    @property
    def knobs(self) -> list[str]:
        return [k for k in KNOB_NAMES if k in self.summary.columns]

    @property
    def fidelity_good(self) -> bool | None:
        return None if self.fidelity is None else bool(self.fidelity.get("good"))

    def fidelity_line(self) -> str:
        """The model's fidelity in one line: POOR first and loud, GOOD, or not validated."""
        f = self.fidelity
        if f is None:
            return ("model fidelity: not validated (no fidelity.json beside this grid; "
                    "router-replay calibrate TRACE --out fleet.toml --validate DIR checks the model "
                    "against the recording)")
        score = f.get("score")
        score_t = f"{score:.2f}" if isinstance(score, (int, float)) else "?"
        if not f.get("good"):
            failing = ", ".join(map(str, f.get("failing") or [])) or "?"
            return (f"WARNING: model fidelity POOR (score {score_t}, failing: {failing}; "
                    f"{self.fidelity_path}): the closed-loop predictions below come from a model that "
                    "does not reproduce the recording")
        return f"model fidelity GOOD: score {score_t}, every part passes ({self.fidelity_path})"


def _read_json(path: Path) -> dict:
    try:
        rec = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ReplayError(f"{path}: unreadable ({' '.join(str(err).split())[:120]})") from None
    if not isinstance(rec, dict):
        raise ReplayError(f"{path}: not a JSON object")
    return rec


def is_grid(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a closed-loop grid directory (or a validation directory holding one)."""
    p = Path(path)
    return (p / SUMMARY).is_file() or (p / PREDICTION / SUMMARY).is_file()


# columns of a closed-loop summary or a plan that are not numbers: choice and switch knobs, the
# fleet's label, the seeds and the stable verdict
_NOT_NUMERIC = frozenset({"fleet", "seeds", "stable", "unstable_seeds"})


def check_numeric(table: pl.DataFrame, where: str | os.PathLike) -> None:
    """Every count, rate and time of a summary table is a number (a rate written as strings is
    unusable input, not "no config qualifies"): one line naming the file and the column."""
    for name, dtype in table.schema.items():
        if name in _NOT_NUMERIC or (name in KNOBS and KNOBS[name].kind in ("choice", "bool")):
            continue
        if not (dtype.is_numeric() or dtype == pl.Null):
            raise ReplayError(f"{where}: column '{name}': must be numeric, got {dtype}")


def load_grid(path: str | os.PathLike) -> ClosedLoopGrid:
    """Read a closed-loop grid directory (one-line :class:`ReplayError` when it is not one)."""
    p = Path(path)
    if not p.is_dir():
        raise ReplayError(f"{p}: no such closed-loop grid directory")
    if not (p / SUMMARY).is_file() and (p / PREDICTION / SUMMARY).is_file():
        p = p / PREDICTION          # a calibrate --validate directory: its prediction grid
    sm = p / SUMMARY
    if not sm.is_file():
        raise ReplayError(f"{p}: not a closed-loop grid (no {SUMMARY}; write one with "
                          "router-replay simulate ... --out DIR and a grid of knobs)")
    try:
        summary = pl.read_parquet(sm)
    except Exception as err:  # noqa: BLE001 - polars / arrow raise many kinds
        raise ReplayError(f"{sm}: unreadable Parquet ({type(err).__name__})") from None
    for col in ("config_id", "true_hit_rate"):
        if col not in summary.columns:
            raise ReplayError(f"{sm}: column '{col}': missing (not a closed-loop summary)")
    if summary.height == 0:
        raise ReplayError(f"{sm}: no configs")
    check_numeric(summary, sm)
    meta = _read_json(p / SIM_JSON) if (p / SIM_JSON).is_file() else {}
    fid_path = next((q for q in (p / FIDELITY_JSON, p.parent / FIDELITY_JSON) if q.is_file()), None)
    fidelity = _read_json(fid_path) if fid_path is not None else None
    return ClosedLoopGrid(p, summary, meta, fidelity, fid_path)


# ---------------------------------------------------------------------------
# finding the grid of a run's trace


def _obj(v: Any) -> dict:
    """``v`` when it is a JSON object, else an empty one (records read from disk)."""
    return v if isinstance(v, dict) else {}


def grid_matches_run(grid: ClosedLoopGrid, run_meta: dict) -> str | None:
    """How ``grid`` was produced from the run's trace ("sha256" / "path"), or None."""
    tr = _obj(run_meta.get("trace"))
    run_files = {n: (i.get("sha256") if isinstance(i, dict) else i) for n, i in (tr.get("files") or {}).items()}
    ident = _obj(grid.meta.get("log_identity"))
    grid_files = {n: i.get("sha256") for n, i in (ident.get("files") or {}).items() if isinstance(i, dict)}
    if run_files and grid_files:
        common = set(run_files) & set(grid_files)
        if names.REQUESTS in common and all(run_files[n] == grid_files[n] for n in common):
            return "sha256"
        return None
    run_path = tr.get("path")
    src = ident.get("path") or grid.meta.get("log")
    if run_path and src and _same_simulation(grid.meta, Path(run_path)):
        return "the request log and fleet the trace was simulated from"
    if run_path and src:
        try:
            if Path(src).resolve() == Path(run_path).resolve():
                return "path"
        except OSError:
            return None
    return None


def _same_simulation(grid_meta: dict, trace_dir: Path) -> bool:
    """Whether a simulated trace (its ``sim.json``) and a grid were simulated from the same
    request log, as many of its requests, on the same fleet (the bundled sample and its grid)."""
    # REPLAY CHOICE: a simulated trace is matched to a grid of the same log and fleet: the log's path
    # as given to simulate, the request count and the fleet record must all be equal
    try:
        rec = json.loads((trace_dir / SIM_JSON).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    if not isinstance(rec, dict) or not rec.get("log"):
        return False
    return all(rec.get(k) == grid_meta.get(k) for k in ("log", "requests", "fleet", "freshness_ms"))


def _candidates(root: Path) -> list[Path]:
    out: list[Path] = []
    if not root.is_dir():
        return out
    try:
        kids = sorted(c for c in root.iterdir() if c.is_dir() and not c.name.startswith("."))
    except OSError:
        return out
    for c in kids:
        if (c / SUMMARY).is_file():
            out.append(c)
        elif (c / PREDICTION / SUMMARY).is_file():
            out.append(c / PREDICTION)
    return out


def find_for_run(run_path: str | os.PathLike, run_meta: dict) -> tuple[ClosedLoopGrid | None, list[str]]:
    """The closed-loop grid of this run's trace, looked for inside and beside the run directory
    and inside and beside the trace directory; with notes naming what was found (or why not)."""
    run_p = Path(run_path)
    tr = _obj(run_meta.get("trace"))
    places = [run_p, run_p.parent]
    if tr.get("path"):
        t = Path(tr["path"])
        places += [t, t.parent]
    seen: set[Path] = set()
    found: list[tuple[ClosedLoopGrid, str]] = []
    for place in places:
        for c in ([place] if (place / SUMMARY).is_file() and place == run_p else []) + _candidates(place):
            try:
                key = c.resolve()
            except OSError:
                continue
            if key in seen:
                continue
            seen.add(key)
            try:
                g = load_grid(c)
            except ReplayError:
                continue
            how = grid_matches_run(g, run_meta)
            if how is None and c == run_p and not g.meta:
                how = "placed in the run directory"
            if how is not None:
                found.append((g, how))
    if not found:
        return None, []
    # REPLAY CHOICE: several matching grids - the validated one with most seeds, then the path order
    found.sort(key=lambda gh: (gh[0].fidelity is None, -gh[0].n_seeds, str(gh[0].path)))
    g, how = found[0]
    notes = [f"closed-loop grid {g.path} (matched to this run's trace by {how})"]
    if len(found) > 1:
        notes.append("other matching grids: " + ", ".join(str(x.path) for x, _ in found[1:]))
    return g, notes


# ---------------------------------------------------------------------------
# ranking


def num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


@dataclass
class ClosedLoopRecommendation:
    """The closed-loop answer: the best config, the runner-up, whether they can be told apart."""

    grid: ClosedLoopGrid
    bound_col: str
    bound_ms: float | None
    ranked: list[dict]          # eligible configs, best first
    excluded: dict[str, list[dict]]   # unstable / over_bound / unknown
    knobs: list[str]
    bound_kind: str = "mean"    # --bound: mean (95% interval of the mean) or seed-range (worst seed)

    @property
    def checked_on(self) -> str:
        return BOUND_KINDS[self.bound_kind][1] if self.grid.seeded else "the point value (one seed)"

    @property
    def best(self) -> dict | None:
        return self.ranked[0] if self.ranked else None

    @property
    def runner_up(self) -> dict | None:
        return self.ranked[1] if len(self.ranked) > 1 else None

    @property
    def distinguishable(self) -> bool | None:
        """Whether the best's 95% interval of mean true hit rate lies above the runner-up's
        (None without a runner-up or without intervals)."""
        b, r = self.best, self.runner_up
        if b is None or r is None or not self.grid.seeded:
            return None
        lo, hi = num(b.get("true_hit_rate_lo")), num(r.get("true_hit_rate_hi"))
        if lo is None or hi is None:
            return None
        return lo > hi

    def flags(self, row: dict | None = None) -> str:
        row = row if row is not None else self.best
        if row is None:
            return ""
        return ranking.router_flags(row)


    def to_json(self) -> dict:
        """The answer as JSON (``recommend --json``): fidelity first, bound, pick, runner-up, counts."""
        g = self.grid

        def row(r: dict | None) -> dict | None:
            if r is None:
                return None
            keep = ("true_hit_rate", self.bound_col, "ttft_ms_p50")
            return {"config": r["config"], "config_id": r["config_id"],
                    "knobs": {k: r.get(k) for k in g.knobs},
                    "values": {c: {"mean": num(r.get(c)), "mean_95_lo": num(r.get(f"{c}_lo")),
                                   "mean_95_hi": num(r.get(f"{c}_hi")),
                                   "seed_min": num(r.get(f"{c}_min")), "seed_max": num(r.get(f"{c}_max"))}
                               for c in keep if c in r},
                    "stable": r.get("stable"), "seeds": r.get("seeds")}
        flags = ranking.deploy_flags(self.best)
        return {"fidelity": {"good": g.fidelity_good, "line": g.fidelity_line()}, "grid": str(g.path),
                "configs": g.summary.height, "seeds": g.n_seeds,
                "bound": {"metric": self.bound_col, "max_ms": self.bound_ms, "kind": self.bound_kind,
                          "checked_on": self.checked_on},
                "recommended": row(self.best), "router_flags": flags,
                "router_flags_per_dp_size": {str(d): flags for d in dp_sizes(g)} if flags is not None else {},
                "runner_up": row(self.runner_up), "distinguishable": self.distinguishable,
                "qualifying": len(self.ranked), "excluded": {k: len(v) for k, v in self.excluded.items()}}


def config_text(row: dict, knobs: Sequence[str]) -> str:
    return " ".join(f"{KNOB_SHORT.get(k, k)}={'none' if row.get(k) is None else row.get(k)}" for k in knobs)


def varying(grid: ClosedLoopGrid) -> list[str]:
    s = grid.summary
    ks = [k for k in grid.knobs if s.get_column(k).n_unique() > 1]
    return ks or [k for k in GATE_KNOBS if k in s.columns]


def disagrees(row: dict, col: str, bound_ms: float | None) -> bool:
    """Whether a config's seeds disagree in a way that can change the answer.

    A config without a verdict (one seed of several) does; one whose seeds all agree
    (``stable``) does not.  One whose seeds disagree does when some seed meets the bound
    on ``col`` and another does not (the SLO verdict depends on the day), or when the
    seeds' served hit rates span more than ``2 * HIT_POINTS`` points (the ranking metric
    is bimodal: its mean is a value no seed produced).  Seeds that disagree only on how
    far under the bound they stay leave the config in, its verdict shown."""
    stable = row.get("stable")
    if stable is None:
        return True
    if stable:
        return False
    lo, hi = num(row.get(f"{col}_min")), num(row.get(f"{col}_max"))
    if bound_ms is not None and (lo is None or hi is None or (lo <= bound_ms < hi)):
        return True
    hlo, hhi = num(row.get("true_hit_rate_min")), num(row.get("true_hit_rate_max"))
    return hlo is None or hhi is None or (hhi - hlo) * 100 > 2 * HIT_POINTS


def recommend(grid: ClosedLoopGrid, *, bound_ms: float | None, on: str = "ttft",
              bound_kind: str = "mean") -> ClosedLoopRecommendation:
    """Best mean true hit rate among the configs whose upper 95% bound of ``on``'s
    metric (TTFT p99 or queue wait p99, ms) is at most ``bound_ms`` (no bound: None) and
    whose seeds do not disagree in a way that changes the answer (:func:`disagrees`);
    ``bound_kind="seed-range"`` checks the worst seed's value instead.

    A one-seed grid has no interval and no verdict: its point values are used and
    :func:`format_recommendation` says so.  Ties go to the lower bounded metric, then
    the lower config id.
    """
    if on not in BOUNDS:
        raise ReplayError(f"bound on {on!r}: expected one of {', '.join(BOUNDS)}")
    if bound_ms is not None and (not math.isfinite(float(bound_ms)) or bound_ms < 0):
        raise ReplayError(f"the bound must be a finite number of ms >= 0, got {bound_ms!r}")
    col = BOUNDS[on][0]
    if col not in grid.summary.columns:
        raise ReplayError(f"{grid.path / SUMMARY}: column '{col}': missing (cannot bound {BOUNDS[on][1]})")
    if bound_kind not in BOUND_KINDS:
        raise ParamError("bound_kind", f"{bound_kind}: expected one of {', '.join(BOUND_KINDS)}", flag="--bound")
    upper_col = col + BOUND_KINDS[bound_kind][0]
    if grid.seeded and upper_col not in grid.summary.columns:
        raise ParamsError("{path}: column '{col}': missing (a grid written before the per-seed range was kept; "
                          "re-run simulate with --seeds N, or use {bound_kind:mean})", ("bound_kind", "--bound"),
                          path=grid.path / SUMMARY, col=upper_col)
    knobs = varying(grid)
    rows = []
    for r in grid.summary.iter_rows(named=True):
        r = dict(r)
        r["config"] = config_text(r, knobs)
        rows.append(r)

    def value(r: dict) -> float | None:
        if num(r.get("true_hit_rate")) is None:
            return None
        return num(r.get(upper_col)) if grid.seeded else num(r.get(col))

    checks = [("unstable", lambda r: disagrees(r, col, bound_ms))] if grid.seeded else []
    ranked = ranking.rank(rows, value=value, bound=bound_ms, checks=checks,
                          order=lambda r: (-(num(r["true_hit_rate"]) or 0.0), num(r[col]) or 0.0, r["config_id"]))
    excluded = {"unstable": [], **ranked.excluded}
    return ClosedLoopRecommendation(grid, col, bound_ms, ranked.ranked, excluded, knobs, bound_kind)


def pct(v: Any) -> str:
    x = num(v)
    return "-" if x is None else f"{100 * x:.2f}%"


def seconds(v: Any) -> str:
    x = num(v)
    return "-" if x is None else f"{x / 1000:.2f} s"


def interval(row: dict, col: str, fmt=pct) -> str:
    """``mean [lo..hi]`` of a summary column (just the value without an interval)."""
    lo, hi = row.get(f"{col}_lo"), row.get(f"{col}_hi")
    if num(lo) is None or num(hi) is None:
        return fmt(row.get(col))
    return f"{fmt(row.get(col))} [{fmt(lo)}..{fmt(hi)}]"


def seed_range(row: dict, col: str, fmt=pct) -> str:
    """``seeds min..max`` of a summary column ('' for a grid without the per-seed range)."""
    lo, hi = row.get(f"{col}_min"), row.get(f"{col}_max")
    if num(lo) is None or num(hi) is None:
        return ""
    return f"seeds {fmt(lo)}..{fmt(hi)}"


def _both(row: dict, col: str, fmt=pct) -> str:
    r = seed_range(row, col, fmt)
    return interval(row, col, fmt) + (f", {r}" if r else "")


def dp_sizes(grid: ClosedLoopGrid) -> dict[int, int]:
    """``{dp_size: workers}`` of the simulated fleet's prefill workers (sim.json)."""
    ws = _obj(grid.meta.get("fleet")).get("workers") or []
    out: dict[int, int] = {}
    for w in ws:
        if isinstance(w, dict) and w.get("role", "prefill") != "decode" and isinstance(w.get("dp_size"), int):
            out[w["dp_size"]] = out.get(w["dp_size"], 0) + 1
    return dict(sorted(out.items()))


def format_recommendation(rec: ClosedLoopRecommendation) -> str:
    """The terminal answer; the model's fidelity comes first, before any prediction."""
    g = rec.grid
    label = BOUNDS["ttft" if rec.bound_col == "ttft_ms_p99" else "queue_wait"][1]
    lines = [g.fidelity_line()]
    bound_t = ("no bound" if rec.bound_ms is None
               else f"{label} <= {rec.bound_ms / 1000:g} s, checked on {rec.checked_on}")
    lines.append(f"recommend (closed loop, {g.path}, {g.summary.height} configs x {g.n_seeds} seed"
                 f"{'s' if g.n_seeds != 1 else ''}): best mean true (served) hit rate with {bound_t}, among "
                 "configs whose seeds agree on the bound and on hit rate")
    if not g.seeded:
        lines.append("  one seed per config: no 95% interval and no stability verdict; the point values are "
                     "used (re-run simulate with --seeds 5 for an answer that holds across seeds)")
    ex = rec.excluded
    b = rec.best
    if b is None:
        lines.append(f"NO CONFIG QUALIFIES: {len(ex['unstable'])} unstable, {len(ex['over_bound'])} above the "
                     f"bound, {len(ex['unknown'])} without a value")
        if ex["unstable"]:
            u = max(ex["unstable"], key=lambda r: (num(r["true_hit_rate"]) or 0.0, -r["config_id"]))
            lines.append(f"  best unstable config: {u['config']} (config {u['config_id']}), true hit rate "
                         f"{_both(u, 'true_hit_rate')}, seeds that disagree: "
                         f"{','.join(map(str, u.get('unstable_seeds') or []))}; run more seeds or a lighter load")
        cands = list(ex["over_bound"])
        if cands:
            up = rec.bound_col + BOUND_KINDS[rec.bound_kind][0]
            lo = min(cands, key=lambda r: num(r.get(up)) or num(r[rec.bound_col]) or math.inf)
            lines.append(f"  lowest {label} among the configs above the bound: {_both(lo, rec.bound_col, seconds)} "
                         f"({lo['config']}); "
                         "raise the bound or simulate tighter limits")
        return "\n".join(lines)
    lines.append(f"recommended: {b['config']} (config {b['config_id']})")
    lines.append(f"  router flags: {rec.flags()}")
    sizes = dp_sizes(g)
    if sizes:
        lines.append("  deploy per dp_size: " + "; ".join(
            f"dp_size {d} ({n} worker{'s' if n != 1 else ''}): {rec.flags()}" for d, n in sizes.items())
            + " (one router config for the whole simulated fleet)")
    lines.append(f"  true hit rate {_both(b, 'true_hit_rate')}, {label} {_both(b, rec.bound_col, seconds)}, "
                 f"TTFT p50 {interval(b, 'ttft_ms_p50', seconds)}"
                 + (f", stable over seeds {','.join(map(str, b.get('seeds') or []))}"
                    if g.seeded and b.get("stable") else ""))
    if g.seeded and b.get("stable") is False:
        lines.append(f"  its seeds disagree on {label} (seeds {','.join(map(str, b.get('unstable_seeds') or []))}"
                     " off the median) but every seed stays within the bound and within "
                     f"{2 * HIT_POINTS:g} points of hit rate; more seeds (simulate --seeds N) firm it up")
    r = rec.runner_up
    if r is not None:
        d = rec.distinguishable
        head = ("NOT DISTINGUISHABLE from the next best within their 95% intervals" if d is False
                else "next best" if d is None else "better than the next best beyond their 95% intervals")
        lines.append(f"  {head}: {r['config']} (config {r['config_id']}), true hit rate "
                     f"{interval(r, 'true_hit_rate')}, {label} {interval(r, rec.bound_col, seconds)}")
        if d is False:
            lines.append(f"    either is as good on this evidence; its flags: {rec.flags(r)}; more seeds "
                         "(simulate --seeds N) narrow the intervals")
    else:
        lines.append("  the only config that qualifies")
    if g.seeded:
        lines.append(f"  {interval_names(g.n_seeds)}")
    lines.append(f"  {len(rec.ranked)} of {g.summary.height} configs qualify ({len(ex['unstable'])} unstable"
                 + (", seeds failing: " + "; ".join(f"config {u['config_id']}: "
                                                   f"{','.join(map(str, u.get('unstable_seeds') or []))}"
                                                   for u in ex["unstable"][:5]) if ex["unstable"] else "")
                 + f", {len(ex['over_bound'])} above the bound, {len(ex['unknown'])} without a value)")
    return "\n".join(lines)
