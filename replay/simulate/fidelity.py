"""Does a fleet model reproduce a recording?

:func:`validate` replays the recorded requests through a fleet twice:

* **forced placement**: every request goes to the worker production chose
  (``selected_worker``), which isolates the engine model from the router;
* **router in the loop** under the production router flags (``trace.json``),

and compares with the recording.  Each *part* has a value, a threshold and a
verdict; the fidelity score is the share of parts that pass, and the model is
``good`` only when every part computed passes.  A part whose inputs the trace
lacks is listed as not computed, with the reason.

Parts (see docs/calibration.md):

``waiting_mae``   largest per-rank mean absolute error of ``num_waiting_reqs``
                  (forced run against the recorded samples, both read as step
                  functions on a 100 ms grid) <= max(0.5, 10% of the mean
                  recorded waiting count).  The three waiting parts are scored
                  over each rank's busy grid points only (the recording or the
                  model has a request running or waiting there): idle hours,
                  where both are trivially zero, would let a wrong queue pass
``waiting_corr``  smallest per-rank correlation of those series >= 0.8 (ranks
                  whose recorded series has a standard deviation >= 0.5)
``waiting_p99``   per-rank p99 of the series within max(1 request, 25%) of the
                  recorded one (the ratio, +1 each, is shown)
``hit_rate``      served hit rate (sum of cached tokens over input tokens)
                  within 1 point of the recorded ``cached_tokens``
``ttft``          forced TTFT p50 and p99 within 15% of the recorded ones
``latency``       the same for end-to-end latency
``router_flags``  the production flags replayed open loop on the recorded loads
                  (``sweep``'s agreement) >= 0.99: the router model, flags and
                  seed reproduce production's decisions given its state
``agreement``     router in the loop picks production's worker for >= 95% of
                  the requests, or, where the loop drifts by itself, for no
                  fewer than the model agrees with itself run with every
                  decode speed 0.1% faster (same seed), less 5 points: on a
                  chaotic fleet (sessions whose cache follows their last
                  turn) one small timing difference changes every later pick,
                  and no model fitted to a recording can agree with
                  production more than with itself nudged by less than a fit
                  resolves
``dispatch``      the share of each worker's requests each data-parallel rank
                  served, forced run against the recording (``dp_rank`` in the
                  trace), within 5 points on every rank: the fleet's
                  ``load_balance_method`` spreads requests as production did
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay.config import RouterConfig
from replay.errors import ReplayError
from replay.runs import names
from replay.simulate.fleet import Fleet
from replay.simulate.sim import START_NS, SimResult, _json, simulate
from replay.simulate.tracelog import RecordedTrace
from replay.sweep.run import run_sweep

GRID_NS = 100_000_000
AGREEMENT_MIN = 0.95      # router-in-the-loop picks equal to production's, on a loop that does not drift
AGREEMENT_SLACK = 0.05    # below the model's agreement with itself nudged by DRIFT, on a loop that does
DRIFT = 1e-3              # the nudge: every decode speed 0.1% faster (what calibrate --refine resolves)
CORR_MIN_STD = 0.5        # a rank's waiting series must vary this much for its correlation to count
FIDELITY_JSON = names.FIDELITY_JSON
FIDELITY_TOOL = names.FIDELITY_TOOL   # fidelity.json's marker (rundir.guard recognises the dir)
FLEET_MARKER = "# Fleet fitted by `router-replay calibrate`"  # first line of a fitted fleet file


@dataclass
class Part:
    name: str
    value: float | None
    threshold: str
    passed: bool | None           # None: not computed
    detail: str = ""

    def line(self) -> str:
        if self.passed is None:
            return f"  {self.name:<13} not computed: {self.detail}"
        verdict = "ok  " if self.passed else "FAIL"
        return f"  {verdict} {self.name:<13} {_fmt(self.value):>10}  (want {self.threshold}) {self.detail}"


def _fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.4g}"


@dataclass
class Fidelity:
    parts: list[Part]
    config: dict[str, Any]
    seed: int
    per_rank: list[dict[str, Any]] = field(default_factory=list)
    runs: dict[str, Any] = field(default_factory=dict)

    @property
    def computed(self) -> list[Part]:
        return [p for p in self.parts if p.passed is not None]

    @property
    def failing(self) -> list[str]:
        return [p.name for p in self.computed if not p.passed]

    @property
    def score(self) -> float:
        c = self.computed
        return sum(1 for p in c if p.passed) / len(c) if c else 0.0

    @property
    def good(self) -> bool:
        return bool(self.computed) and not self.failing

    def verdict(self) -> str:
        if self.good:
            return f"fidelity GOOD: score {self.score:.2f}, every part passes"
        if not self.computed:
            return "fidelity UNKNOWN: the trace has nothing to compare with"
        return (f"fidelity POOR: score {self.score:.2f}; failing: {', '.join(self.failing)} "
                "(predictions from this model are not trustworthy)")

    def lines(self) -> list[str]:
        return [self.verdict()] + [p.line() for p in self.parts]

    def as_dict(self) -> dict[str, Any]:
        return {"tool": FIDELITY_TOOL, "good": self.good, "score": self.score, "failing": self.failing,
                "verdict": self.verdict(), "config": self.config, "seed": self.seed,
                "parts": [{"name": p.name, "value": _clean(p.value), "threshold": p.threshold,
                           "passed": None if p.passed is None else bool(p.passed),
                           "detail": p.detail} for p in self.parts],
                "per_rank": self.per_rank, "runs": self.runs}

    def write(self, out_dir: Path) -> Path:
        p = Path(out_dir) / FIDELITY_JSON
        p.write_text(json.dumps(self.as_dict(), indent=2, allow_nan=False, default=_json) + "\n")
        return p


def _clean(v):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return None
    return float(v)


def recorded_seed(rec: RecordedTrace) -> int:
    """The sampler seed a simulated trace records in ``trace.json`` ``extra.seed``, else 0."""
    v = (rec.info.get("extra") or {}).get("seed")
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 else 0


def production_config(rec: RecordedTrace) -> RouterConfig:
    """The router config of ``trace.json`` (the router's defaults without one); one line if bad."""
    flags = rec.router_flags
    try:
        cfg = RouterConfig(**flags)
    except TypeError:
        known = set(RouterConfig().as_dict())
        bad = sorted(set(flags) - known)
        raise ReplayError(f"{rec.path / names.TRACE_JSON}: key 'router.{bad[0]}': not a router knob") from None
    return cfg.validate()


def _series(ts: np.ndarray, val: np.ndarray, grid: np.ndarray) -> np.ndarray:
    k = np.searchsorted(ts, grid, side="right") - 1
    return np.where(k >= 0, val[np.maximum(k, 0)], 0).astype(np.float64)


def _rank_series(loads: pl.DataFrame, urls: list[str], zero_ns: int, grid: np.ndarray,
                 col: str = "num_waiting_reqs") -> dict[tuple[int, int], np.ndarray]:
    index = {u: k for k, u in enumerate(urls)}
    out: dict[tuple[int, int], np.ndarray] = {}
    if col not in loads.columns:
        return out
    df = loads.select("ts", "worker", "dp_rank", col).sort("ts", maintain_order=True)
    for (u, r), g in df.group_by("worker", "dp_rank", maintain_order=True):
        k = index.get(u)
        if k is None:
            continue
        out[(k, int(r))] = _series(g["ts"].to_numpy().astype(np.int64) - zero_ns,
                                   g[col].fill_null(0).to_numpy(), grid)
    return out


def recorded_dp_ranks(rec: RecordedTrace) -> np.ndarray | None:
    """The data-parallel rank that served each request (log order; -1 unknown), from a
    ``dp_rank`` column of the trace's ``requests.parquet`` or ``outcomes.parquet``."""
    for name in (names.REQUESTS, names.OUTCOMES):
        p = Path(rec.path) / name
        if not p.is_file():
            continue
        try:
            col = pl.read_parquet(p, columns=["dp_rank"])["dp_rank"]
        except (pl.exceptions.ColumnNotFoundError, pl.exceptions.ComputeError, OSError):
            continue
        rows = col.fill_null(-1).to_numpy().astype(np.int64)
        if rows.shape[0] <= int(rec.log.request_id.max(initial=-1)):
            continue
        return rows[rec.log.request_id]
    return None


def _ratio_part(name: str, rec: np.ndarray, sim: np.ndarray, tol: float) -> Part:
    ok = np.isfinite(rec) & np.isfinite(sim)
    if ok.sum() < 10:
        return Part(name, None, f"p50, p99 within {tol:.0%}", None, f"{name}_ms not recorded")
    r50, r99 = np.percentile(rec[ok], [50, 99])
    s50, s99 = np.percentile(sim[ok], [50, 99])
    q50 = s50 / r50 if r50 > 0 else float("inf")
    q99 = s99 / r99 if r99 > 0 else float("inf")
    worst = max(abs(q50 - 1), abs(q99 - 1))
    return Part(name, worst, f"|ratio - 1| <= {tol:g}", worst <= tol,
                f"p50 {s50:.1f} vs {r50:.1f} ms, p99 {s99:.1f} vs {r99:.1f} ms")


def validate(rec: RecordedTrace, fleet: Fleet, *, seed: int | None = None, freshness_ms: int = 5000,
             out_dir: str | Path | None = None, force: bool = False,
             progress: Callable[[int], None] | None = None) -> Fidelity:
    """Compare ``fleet`` with the recording ``rec`` (forced placement and router in the loop);
    ``progress(1)`` after each of the three simulations (forced placement, router in the
    loop, the loop with decode speeds nudged; that one runs only when the loop's agreement
    misses 0.95)."""
    if len(fleet.prefill) != len(rec.urls):
        raise ReplayError(f"the fleet has {len(fleet.prefill)} prefill workers, the trace "
                          f"{len(rec.urls)}")
    cfg = production_config(rec)
    if seed is None:
        seed = recorded_seed(rec)
    pre = np.array(fleet.prefill, dtype=np.int64)
    placement = np.where(rec.placement >= 0, pre[np.maximum(rec.placement, 0)], -1)
    out = Path(out_dir) if out_dir is not None else None
    parts: list[Part] = []
    per_rank: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    has = rec.has_outcomes

    forced: SimResult | None = None
    if has["selected_worker"]:
        forced = simulate(rec.log, fleet, cfg, out / names.FORCED_RUN if out else None, seed=seed,
                          freshness_ms=freshness_ms, placement=placement, force=force)
        runs["forced"] = {"seconds": forced.seconds, "summary": forced.summary}
    if progress is not None:
        progress(1)
    loop = simulate(rec.log, fleet, cfg, out / names.ROUTER_RUN if out else None, seed=seed,
                    freshness_ms=freshness_ms, force=force)
    runs["router"] = {"seconds": loop.seconds, "summary": loop.summary}
    if progress is not None:
        progress(1)
    # the run compared with the recording: forced placement; without selected_worker the
    # router-in-the-loop run stands in (then the router's own choices are part of what is
    # compared, and every part says so)
    base = forced if forced is not None else loop
    via = "" if forced is not None else " (router in the loop: no selected_worker recorded)"

    # --- waiting series
    if rec.loads is not None and "num_waiting_reqs" in rec.loads.columns:
        span = int(rec.log.ts_ns[-1]) if rec.log.n_requests else 0
        grid = np.arange(0, span + GRID_NS, GRID_NS, dtype=np.int64)
        got = _rank_series(rec.loads, rec.urls, rec.t0_ns, grid)
        got_run = _rank_series(rec.loads, rec.urls, rec.t0_ns, grid, "num_running_reqs")
        sim_urls = [fleet.urls[i] for i in fleet.prefill]
        sim = _rank_series(base.loads, sim_urls, START_NS, grid)
        sim_run = _rank_series(base.loads, sim_urls, START_NS, grid, "num_running_reqs")
        maes, corrs, p99s = [], [], []
        mean_rec = []
        n_busy = n_grid = 0
        for key in sorted(got):
            a_all = got[key]
            b_all = sim.get(key, np.zeros_like(a_all))
            # busy grid points: the recording or the model has work on the rank
            busy = ((a_all + got_run.get(key, np.zeros_like(a_all))) > 0) | (
                (b_all + sim_run.get(key, np.zeros_like(a_all))) > 0)
            n_busy += int(busy.sum())
            n_grid += int(busy.shape[0])
            if not busy.any():
                continue
            a = a_all[busy]
            b = b_all[busy]
            mae = float(np.mean(np.abs(a - b)))
            corr = (float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else
                    (1.0 if a.std() == 0 and b.std() == 0 and mae == 0 else float("nan")))
            pa_, pb_ = float(np.percentile(a, 99)), float(np.percentile(b, 99))
            p99 = (pb_ + 1) / (pa_ + 1)
            p99_ok = abs(pb_ - pa_) <= max(1.0, 0.25 * pa_)
            maes.append(mae)
            mean_rec.append(float(a.mean()))
            p99s.append((p99, p99_ok))
            if a.std() >= CORR_MIN_STD:
                corrs.append(corr if math.isfinite(corr) else 0.0)
            per_rank.append({"_k": key[0], "worker": rec.urls[key[0]], "dp_rank": key[1],
                             "busy_share": float(busy.mean()), "waiting_mae": mae,
                             "waiting_corr": _clean(corr), "waiting_p99_ratio": p99,
                             "recorded_p99": pa_, "simulated_p99": pb_,
                             "recorded_mean": float(a.mean()), "simulated_mean": float(b.mean())})
        if maes:
            keys = [(row["_k"], row["dp_rank"]) for row in per_rank]
            i = int(np.argmax(maes))
            tol = max(0.5, 0.1 * float(np.mean(mean_rec)))
            over = (f"; over busy time only ({n_busy / max(n_grid, 1):.1%} of the rank-time "
                    f"grid)")
            parts.append(Part("waiting_mae", maes[i], f"<= {tol:.3g}", maes[i] <= tol,
                              f"worst rank {rec.urls[keys[i][0]]} dp {keys[i][1]}{via}{over}"))
            if corrs:
                c = min(corrs)
                parts.append(Part("waiting_corr", c, ">= 0.8", c >= 0.8,
                                  f"{len(corrs)} ranks whose recorded queue varies"))
            else:
                parts.append(Part("waiting_corr", None, ">= 0.8", None,
                                  f"no rank's recorded queue varies (std >= {CORR_MIN_STD})"))
            bad = [j for j, (_, ok) in enumerate(p99s) if not ok]
            j = bad[0] if bad else int(np.argmax([abs(r - 1) for r, _ in p99s]))
            parts.append(Part("waiting_p99", p99s[j][0], "p99 within max(1, 25%)", not bad,
                              f"rank {rec.urls[keys[j][0]]} dp {keys[j][1]}: "
                              f"{per_rank[j]['simulated_p99']:.3g} vs {per_rank[j]['recorded_p99']:.3g}"))
    else:
        for n in ("waiting_mae", "waiting_corr", "waiting_p99"):
            parts.append(Part(n, None, "", None, "no load samples"))

    # --- served hit rate, TTFT, latency
    if has["cached_tokens"]:
        ok = rec.cached_tokens >= 0
        L = rec.log.input_tokens[ok].astype(np.float64)
        rh = float(rec.cached_tokens[ok].sum() / L.sum())
        sc = base.outcomes["cached_tokens"].to_numpy()
        sh = float(sc[ok].sum() / L.sum())
        d = abs(sh - rh) * 100
        parts.append(Part("hit_rate", d, "<= 1 point", d <= 1.0,
                          f"simulated {sh:.2%} vs recorded {rh:.2%}{via}"))
    else:
        parts.append(Part("hit_rate", None, "", None, "no cached_tokens"))
    for name, recv in (("ttft", rec.ttft_ms), ("latency", rec.latency_ms)):
        simv = base.outcomes[f"{name}_ms"].fill_null(float("nan")).to_numpy().astype(np.float64)
        part = _ratio_part(name, recv, simv, 0.15)
        if part.passed is not None:
            part.detail += via
        parts.append(part)

    # --- the router alone: the production flags replayed open loop on the recorded loads
    # (sweep's agreement).  Below 1 the flags, seed or matches in the trace do not reproduce
    # production's decisions, and no fleet model can make up for that.
    if has["selected_worker"]:

        texts = {k: "none" if v is None else str(v).lower() for k, v in cfg.given_flags().items()}
        why = "no agreement from the open-loop replay"
        try:
            sw = run_sweep(rec.path, texts, seed=seed, freshness_ms=freshness_ms, decisions=False,
                           report=None)
            oa = sw.summary.row(0, named=True).get("agreement")
        except ReplayError as err:
            oa, why = None, f"open-loop replay not possible: {err}"
        if oa is None:
            parts.append(Part("router_flags", None, "", None, why))
        else:
            parts.append(Part("router_flags", float(oa), ">= 0.99", float(oa) >= 0.99,
                              "production flags replayed on the recorded loads (sweep)"))

    # --- router in the loop
    if has["selected_worker"]:
        sel = loop.outcomes["worker"].to_list()
        idx = {u: k for k, u in enumerate(fleet.urls[i] for i in fleet.prefill)}
        got_k = np.array([idx.get(s, -1) if s is not None else -1 for s in sel], dtype=np.int64)
        known = rec.placement >= 0
        same = got_k == rec.placement
        agree = float(same[known].mean())
        # where the simulated router sampled (power-of-k), production's own random draws
        # decide too: shown apart, since no model can reproduce another run's sampler
        # (the no-cache-candidate pair and the capacity fallback draw with the min-load
        # sampler: ROUTER_SEMANTICS.md sections 4.2 and ambiguity 3)
        o = loop.outcomes
        sampled = ((o["decision"] == "cache_miss") | (o["reason"] == "CapacityFallbackPowerOfTwo")
                   ).fill_null(False).to_numpy()
        parts_txt = []
        for name, m in (("affinity", known & ~sampled), ("sampled", known & sampled)):
            if m.any():
                parts_txt.append(f"{name} {float(same[m].mean()):.3f} of {int(m.sum()):,}")
        want, want_t = AGREEMENT_MIN, f">= {AGREEMENT_MIN:g}"
        if agree < AGREEMENT_MIN:
            # the model against itself with every decode speed DRIFT faster (below what a fit
            # resolves), same seed: how far the loop drifts on its own (run only when the fixed
            # bar is missed: the drift can only lower it)
            nudged = Fleet(tuple(replace(w, decode_tokens_per_s=w.decode_tokens_per_s * (1 + DRIFT))
                                 for w in fleet.workers), fleet.spec)
            other = simulate(rec.log, nudged, cfg, None, seed=seed, freshness_ms=freshness_ms)
            runs["router_nudged"] = {"seconds": other.seconds, "summary": other.summary}
            own = float((np.asarray(other.outcomes["worker"].to_list(), dtype=object)
                         == np.asarray(sel, dtype=object))[known].mean())
            if own - AGREEMENT_SLACK < want:
                want = own - AGREEMENT_SLACK
                want_t = (f">= {want:.3f} (the model's agreement with itself {DRIFT:.1%} faster, {own:.3f}, "
                          f"- {AGREEMENT_SLACK:g})")
            parts_txt.append(f"the model agrees with itself {DRIFT:.1%} faster on {own:.3f}")
        parts.append(Part("agreement", agree, want_t, agree >= want,
                          "; ".join(parts_txt) + f"; router flags {cfg.given_flags() or 'defaults'}, "
                          f"seed {seed}" + ("" if rec.info.get("router") is not None else
                                            "; no trace.json: router defaults assumed")))
    else:
        parts.append(Part("agreement", None, "", None, "no selected_worker"))
    if progress is not None:
        progress(1)     # the nudged loop, run or not needed
    parts.append(_dispatch_part(rec, fleet, base, via))
    for row in per_rank:
        row.pop("_k", None)
    return Fidelity(parts, cfg.given_flags(), int(seed), per_rank, runs)


def _dispatch_part(rec: RecordedTrace, fleet: Fleet, run: SimResult, via: str) -> Part:
    method = fleet.spec.load_balance_method
    multi = [k for k, dp in enumerate(rec.dp_sizes) if dp > 1]
    if not multi:
        return Part("dispatch", None, "", None, "no worker has more than one rank")
    ranks = recorded_dp_ranks(rec)
    if ranks is None:
        return Part("dispatch", None, "", None, "the trace does not record which rank served "
                    f"each request (the model uses {method})")
    sim_r = run.outcomes["dp_rank"].fill_null(-1).to_numpy().astype(np.int64)
    worst, where = 0.0, ""
    for k in multi:
        on = (rec.placement == k) & (ranks >= 0)
        if on.sum() < 10:
            continue
        for r in range(rec.dp_sizes[k]):
            a = float((ranks[on] == r).mean())
            b = float((sim_r[on] == r).mean())
            if abs(a - b) * 100 >= worst:
                worst, where = abs(a - b) * 100, (f"worker {rec.urls[k]} dp {r}: {b:.1%} of its "
                                                  f"requests simulated vs {a:.1%} recorded")
    if not where:
        return Part("dispatch", None, "", None, "fewer than 10 requests with a recorded rank")
    return Part("dispatch", worst, "<= 5 points", worst <= 5.0,
                f"load_balance_method {method}; {where}{via}")
