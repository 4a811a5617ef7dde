"""Fit a simulator fleet to a recorded trace.

:func:`calibrate` reads a :class:`~replay.simulate.tracelog.RecordedTrace`
and fits, per prefill worker (the fleet file's ``[[worker]]`` granularity;
ranks of one worker share their parameters):

* ``max_total_num_tokens`` and ``max_running_requests``: the values the
  worker's ranks publish (exact; the residual counts samples that disagree);
* ``prefill_tokens_per_s``: the native counters, pooled over consecutive
  samples of every rank: sum of ``total_prefill_uncached_tokens`` increments
  over the sum of ``total_prefill_busy_us`` increments;
* ``decode_tokens_per_s`` and ``decode_step_ms_per_request``: per request
  with ``output_tokens >= 2``, ``ttft_ms`` and ``latency_ms``, the time from
  first to last token less the prefill time its rank spent meanwhile (the busy
  counter), per output token; a least-squares line against the rank's mean
  running count over that time gives the step time at batch 1 and its growth
  per request.  Without latencies, Little's law on the running counts
  (running-request time while decoding over generated tokens) gives a
  constant step time;
* the publish policy and interval from the gaps between a rank's samples
  while the rank is busy (an idle engine that publishes on change shows only
  its regular heartbeat, which looks like interval publishing);
* the in-worker dispatch (``load_balance_method``) from which rank served each
  request, when the trace records it (a ``dp_rank`` column in
  ``requests.parquet`` or ``outcomes.parquet``): a round-robin sequence, the
  least-loaded rank by requests or by tokens, or neither;
* ``chunked_prefill_size`` from the prefill counters when every prefill step
  publishes (on-change publishing): the largest step, when many steps stop at it.

``max_prefill_tokens`` and ``schedule_policy`` are not fitted (the engine
flags are not in a trace): SGLang's defaults are used and validation shows
whether that matters.  Every value carries its residual and sample count; a value that
could not be fitted says which default was used.  See docs/calibration.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay.config import RouterConfig
from replay.errors import ParamError
from replay.simulate.fidelity import FLEET_MARKER, recorded_dp_ranks
from replay.simulate.fleet import (
    DEFAULT_PUBLISH_INTERVAL_MS,
    UNKNOWN_GPU_CHUNK,
    FleetSpec,
    build_fleet,
)
from replay.simulate.sim import simulate
from replay.simulate.tracelog import RecordedTrace

NS_PER_MS = 1_000_000
# REPLAY CHOICE: a counter value "at" time x is the rank's latest sample stamped
# <= x + 1 ms: an engine publishes a change about that soon after it happens.
LOOKAHEAD_NS = 1_000_000
MIN_DECODE_SAMPLES = 5
MIN_BUSY_GAPS = 20        # fewer gaps while busy: classify publishing from every gap
RR_MIN = 0.95             # share of consecutive requests on the next rank: round robin
LEAST_LOADED_MIN = 0.8    # share of requests sent to the least-loaded rank: total_requests/_tokens
CHUNK_MIN_STEPS = 3       # prefill steps that must stop at the largest size to call it the chunk
SLOPE_MIN_EFFECT = 0.02   # a batch slope changing the step time by < 2% over the observed batches is 0


@dataclass
class Fitted:
    """One fitted (or defaulted) parameter."""

    name: str
    worker: int | None          # fleet worker index; None = fleet-wide
    value: Any
    samples: int
    residual: float | None      # relative RMS residual (or disagreeing samples, for capacities)
    fitted: bool
    how: str

    def line(self, urls: list[str]) -> str:
        who = "fleet" if self.worker is None else f"worker {self.worker} ({urls[self.worker]})"
        val = f"{self.value:,.6g}" if isinstance(self.value, float) else f"{self.value}"
        if not self.fitted:
            return f"  {who}: {self.name} = {val}  NOT FITTED ({self.how}; default used)"
        if self.residual is None:
            res = ""
        elif self.name in ("max_total_num_tokens", "max_running_requests"):
            res = f", {int(self.residual):,} disagree"
        else:
            res = f", relative residual {self.residual:.3g}"
        return f"  {who}: {self.name} = {val}  ({self.how}; {self.samples:,} samples{res})"


@dataclass
class Calibration:
    """The fitted fleet: per-worker values, fleet-wide publishing, and the report lines."""

    urls: list[str]
    dp_sizes: list[int]
    decode_peers: int
    model: str
    per_worker: list[dict[str, Any]]
    publish: dict[str, Any]
    fitted: list[Fitted] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)   # fleet-wide engine keys fitted

    def lines(self) -> list[str]:
        return [f.line(self.urls) for f in self.fitted]

    def not_fitted(self) -> list[Fitted]:
        return [f for f in self.fitted if not f.fitted]

    @staticmethod
    def unfitted_line() -> str:
        """What calibrate never fits, in one line (the fleet file says the same)."""
        return UNFITTED_LINE

    def to_fleet(self, scale: dict[int, float] | None = None, where: str = "fleet"):
        """The fitted fleet as a simulator :class:`Fleet` (decode speeds times ``scale[k]``), checked by
        the fleet validator (errors begin with ``where``)."""

        spec = FleetSpec(workers=len(self.per_worker), dp_size=self.per_worker[0]["dp_size"],
                         decode_peers=self.decode_peers, model=self.model, **self.publish,
                         **self.engine)
        per = {}
        for k, w in enumerate(self.per_worker):
            per[k] = dict(w)
            if scale:
                per[k]["decode_tokens_per_s"] = w["decode_tokens_per_s"] * scale.get(k, 1.0)
        return build_fleet(spec, per, where)

    def to_toml(self, source: str = "") -> str:
        """An ordinary fleet file (docs/simulator.md): fleet-wide medians, one [[worker]] each."""
        keys = ("dp_size", "prefill_tokens_per_s", "decode_tokens_per_s", "max_running_requests",
                "max_total_num_tokens", "decode_step_ms_per_request")
        top: dict[str, Any] = {}
        for k in keys:
            vals = [w[k] for w in self.per_worker]
            top[k] = sorted(vals)[len(vals) // 2]
        notes = {(f.worker, f.name): f for f in self.fitted}

        out = [FLEET_MARKER + (f" from {source}" if source else ""),
               "# (docs/calibration.md). Edit freely; every key is documented in docs/simulator.md.",
               "# Worker k stands for the trace's k-th prefill worker in URL order.",
               f"model = {_toml(self.model)}",
               f"workers = {len(self.per_worker)}",
               f"decode_peers = {self.decode_peers}"]
        for k in keys:
            out.append(f"{k} = {_toml(top[k])}")
        for k in ("load_balance_method", "chunked_prefill_size"):
            f = notes.get((None, k))
            if k in self.engine:
                out.append(f"{k} = {_toml(self.engine[k])}" + (f"  # {f.how}" if f else ""))
            elif f is not None:
                out.append(f"# {k}: not fitted ({f.how}); SGLang's default used")
        out.append(f"# {UNFITTED_LINE}")
        for k, v in self.publish.items():
            f = notes.get((None, k))
            out.append(f"{k} = {_toml(v)}" + (f"  # {f.how}" if f else ""))
        for i, w in enumerate(self.per_worker):
            out.append("")
            out.append("[[worker]]")
            out.append(f"index = {i}  # {self.urls[i]}")
            for k in keys:
                f = notes.get((i, k))
                c = ""
                if f is not None:
                    c = (f"  # {f.samples:,} samples, residual {f.residual:.3g}" if f.fitted
                         and f.residual is not None else
                         f"  # {f.samples:,} samples" if f.fitted else "  # not fitted: default")
                out.append(f"{k} = {_toml(w[k])}{c}")
        return "\n".join(out) + "\n"


UNFITTED_ENGINE_KEYS = ("max_prefill_tokens", "schedule_policy", "enable_mixed_chunk")
UNFITTED_LINE = (f"{', '.join(UNFITTED_ENGINE_KEYS)}: not fitted (a trace does not record them); "
                 "SGLang's defaults used")
"""What calibrate never fits, said once (the fleet file's comment and the command's output)."""


def _toml(v: Any) -> str:
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(round(v, 6)) if math.isfinite(v) else "0.0"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


# ---------------------------------------------------------------------------
# helpers over one rank's samples (sorted by time)

@dataclass
class _Rank:
    ts: np.ndarray
    running: np.ndarray
    ptok: np.ndarray | None
    pbusy: np.ndarray | None
    cum_run: np.ndarray    # integral of running over time up to each sample (ns * requests)
    busy: np.ndarray | None = None   # running + waiting > 0 at each sample

    def at(self, a: np.ndarray, x: np.ndarray, interpolate: bool = False) -> np.ndarray:
        """Counter ``a`` at times ``x``: the latest sample (on-change publishing: the value
        holds until the next sample), or linear between the two samples around ``x``
        (interval publishing: the counter moved somewhere in between)."""
        if not interpolate:
            k = np.searchsorted(self.ts, x + LOOKAHEAD_NS, side="right") - 1
            return np.where(k >= 0, a[np.maximum(k, 0)], 0)
        return np.interp(x.astype(np.float64), self.ts.astype(np.float64), a.astype(np.float64))

    def run_integral(self, x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(self.ts, x, side="right") - 1
        kk = np.maximum(k, 0)
        val = self.cum_run[kk] + self.running[kk] * (x - self.ts[kk])
        return np.where(k >= 0, val, 0.0)


def _ranks(loads: pl.DataFrame, urls: list[str], t0_ns: int) -> dict[tuple[int, int], _Rank]:
    index = {u: k for k, u in enumerate(urls)}
    cols = loads.columns
    native = all(c in cols for c in ("total_prefill_uncached_tokens", "total_prefill_busy_us"))
    out: dict[tuple[int, int], _Rank] = {}
    df = loads.with_columns(pl.col("worker").replace_strict(index, default=-1, return_dtype=pl.Int64)
                            .alias("_w")).filter(pl.col("_w") >= 0).sort("ts", maintain_order=True)
    for (w, r), g in df.group_by("_w", "dp_rank", maintain_order=True):
        ts = g["ts"].to_numpy().astype(np.int64) - t0_ns
        run = g["num_running_reqs"].fill_null(0).to_numpy().astype(np.float64)
        dt = np.diff(ts).astype(np.float64)
        cum = np.zeros(ts.shape[0])
        np.cumsum(run[:-1] * dt, out=cum[1:])
        ptok = pbusy = None
        if native:
            pt = g["total_prefill_uncached_tokens"]
            pb = g["total_prefill_busy_us"]
            if not pt.null_count() and not pb.null_count():
                ptok = pt.to_numpy().astype(np.int64)
                pbusy = pb.to_numpy().astype(np.int64)
        wait = (g["num_waiting_reqs"].fill_null(0).to_numpy() if "num_waiting_reqs" in cols
                else np.zeros(ts.shape[0]))
        out[(int(w), int(r))] = _Rank(ts, run, ptok, pbusy, cum, (run + wait) > 0)
    return out


def _constant(loads: pl.DataFrame, col: str, urls: list[str]) -> dict[int, tuple[int, int, int]]:
    """Per worker: (mode value, samples, samples disagreeing) of a capacity column."""
    if col not in loads.columns:
        return {}
    index = {u: k for k, u in enumerate(urls)}
    g = (loads.filter(pl.col(col).is_not_null() & (pl.col(col) > 0))
         .group_by("worker", col).agg(pl.len().alias("n")))
    out: dict[int, tuple[int, int, int]] = {}
    for u, part in g.group_by("worker"):
        k = index.get(u[0])
        if k is None:
            continue
        part = part.sort(["n", col], descending=[True, False])
        total = int(part["n"].sum())
        out[k] = (int(part[col][0]), total, total - int(part["n"][0]))
    return out


def _max_running(ranks: dict[tuple[int, int], _Rank], k: int, dp: int) -> int:
    vals = [int(ranks[(k, r)].running.max()) for r in range(dp) if (k, r) in ranks
            and ranks[(k, r)].running.size]
    return max(vals) if vals else 0


def _publish(ranks: dict[tuple[int, int], _Rank]) -> tuple[dict[str, Any], list[Fitted]]:
    gaps = [np.diff(rk.ts) for rk in ranks.values() if rk.ts.shape[0] > 2]
    if not gaps:
        return ({"publish_policy": "interval", "publish_interval_ms": DEFAULT_PUBLISH_INTERVAL_MS},
                [Fitted("publish_policy", None, "interval", 0, None, False, "no load samples")])
    # the gaps that start while the rank is busy (running or waiting): an engine publishing
    # on change re-sends an unchanged load on a regular heartbeat, so an idle recording's
    # gaps are regular whatever the policy
    busy = [np.diff(rk.ts)[rk.busy[:-1]] for rk in ranks.values()
            if rk.ts.shape[0] > 2 and rk.busy is not None]
    gb = np.concatenate(busy) if busy else np.zeros(0, dtype=np.int64)
    g_all = np.concatenate(gaps)
    g = gb if gb.shape[0] >= MIN_BUSY_GAPS else g_all
    while_busy = "while busy" if g is gb else "(too few while busy: all gaps)"
    med = float(np.median(g))
    regular = float(np.mean(np.abs(g - med) <= 0.01 * med + 1000)) if med > 0 else 0.0
    n = int(g.shape[0])
    if regular >= 0.9:
        ms = max(1, int(round(med / NS_PER_MS)))
        return ({"publish_policy": "interval", "publish_interval_ms": ms},
                [Fitted("publish_policy", None, "interval", n, 1 - regular, True,
                        f"{regular:.1%} of sample gaps {while_busy} equal the median"),
                 Fitted("publish_interval_ms", None, ms, n, None, True, "median gap between samples")])
    sgl = _sglang_cadence(ranks)
    if sgl is not None:
        return sgl
    long = g_all[g_all >= 100 * NS_PER_MS]
    if long.size:
        vals, counts = np.unique(np.round(long / NS_PER_MS).astype(np.int64), return_counts=True)
        idle = int(vals[np.argmax(counts)])
        how = "most common gap of 100 ms or more"
        fitted = True
    else:
        idle, how, fitted = 1000, "no gap of 100 ms or more", False
    return ({"publish_policy": "on_change", "idle_publish_ms": idle},
            [Fitted("publish_policy", None, "on_change", n, regular, True,
                    f"irregular sample gaps {while_busy} (only {regular:.1%} equal the median): "
                    "on change"),
             Fitted("idle_publish_ms", None, idle, int(long.size), None, fitted, how)])


SGLANG_SHORT_SHARE = 0.05   # decode-only samples closer than half their median gap: at most this share


def _sglang_cadence(ranks: dict[tuple[int, int], _Rank]) -> tuple[dict[str, Any], list[Fitted]] | None:
    """SGLang's own LoadStat cadence, if the recording shows it (docs/calibration.md).

    A sample taken while a rank stays busy and whose prefill counter did not move is a
    decode-only sample.  SGLang publishes those only every 15th decode step since its last
    sample, so their gaps are all about 15 steps (longer with a bigger batch); an engine
    that publishes on every change also publishes arrivals and completions, so many such
    gaps are much shorter.  And SGLang never publishes an arrival: the first sample after
    an idle one is the end of a prefill step (the counter moved), where an on-change engine
    publishes the arrival itself.  ``None``: not that cadence (either sign fails where it
    has ``MIN_BUSY_GAPS`` samples; neither has them), or no native prefill counters."""
    dec = []
    idle = []
    wake = wake_same = 0
    for rk in ranks.values():
        if rk.ptok is None or rk.busy is None or rk.ts.shape[0] < 3:
            continue
        gap = np.diff(rk.ts)
        same = rk.ptok[1:] == rk.ptok[:-1]
        stay = rk.busy[:-1] & (rk.running[1:] > 0) & same
        dec.append(gap[stay])
        idle.append(gap[~rk.busy[:-1]])
        woke = ~rk.busy[:-1] & rk.busy[1:]
        wake += int(woke.sum())
        wake_same += int((woke & same).sum())
    q = np.concatenate(dec) if dec else np.zeros(0, dtype=np.int64)
    if q.shape[0] < MIN_BUSY_GAPS and wake < MIN_BUSY_GAPS:
        return None
    med = float(np.median(q)) if q.shape[0] else 0.0
    short = float(np.mean(q < 0.5 * med)) if q.shape[0] >= MIN_BUSY_GAPS else 0.0
    woke_alone = wake_same / wake if wake >= MIN_BUSY_GAPS else 0.0
    if short > SGLANG_SHORT_SHARE or woke_alone > SGLANG_SHORT_SHARE:
        return None
    gi = np.concatenate(idle) if idle else np.zeros(0, dtype=np.int64)
    long = gi[gi >= 100 * NS_PER_MS]
    if long.size:
        vals, counts = np.unique(np.round(long / NS_PER_MS).astype(np.int64), return_counts=True)
        hb, how, fitted = int(vals[np.argmax(counts)]), "most common gap of 100 ms or more while idle", True
    else:
        hb, how, fitted = 1000, "no idle gap of 100 ms or more (SGLang's 1 s)", False
    n = int(q.shape[0])
    return ({"publish_policy": "sglang", "idle_publish_ms": hb},
            [Fitted("publish_policy", None, "sglang", n, short, True,
                    f"decode-only samples {med / NS_PER_MS:.0f} ms apart (median), {short:.1%} closer "
                    f"than half that; {woke_alone:.1%} of {wake:,} wake-ups published before a prefill "
                    "step: SGLang's cadence (prefill steps, every 15th decode step)"),
             Fitted("idle_publish_ms", None, hb, int(long.size), None, fitted, how)])


def calibrate(rec: RecordedTrace, *, decode_model: str = "auto") -> Calibration:
    """Fit the fleet of ``rec`` (``decode_model``: ``auto`` fits a batch slope when it matters,
    ``constant`` fixes it at 0, ``linear`` always keeps it)."""
    if decode_model not in ("auto", "constant", "linear"):
        raise ParamError("decode_model", f"must be auto, constant or linear, got {decode_model!r}")
    base = FleetSpec()
    nw = len(rec.urls)
    loads = rec.loads
    fitted: list[Fitted] = []
    per = [dict(dp_size=rec.dp_sizes[k], prefill_tokens_per_s=float(base.prefill_tokens_per_s),
                decode_tokens_per_s=float(base.decode_tokens_per_s),
                max_running_requests=base.max_running_requests,
                max_total_num_tokens=base.max_total_num_tokens, decode_step_ms_per_request=0.0)
           for k in range(nw)]
    ranks = _ranks(loads, rec.urls, rec.t0_ns) if loads is not None and loads.height else {}
    v: float        # a fitted value: a count for the limits below, a rate further on

    for col in ("max_total_num_tokens", "max_running_requests"):
        got = _constant(loads, col, rec.urls) if loads is not None else {}
        for k in range(nw):
            if k in got:
                v, n, bad = got[k]
                per[k][col] = v
                fitted.append(Fitted(col, k, v, n, float(bad), True, "published value"))
            elif col == "max_running_requests" and _max_running(ranks, k, rec.dp_sizes[k]) > 0:
                # REPLAY CHOICE: an engine that does not publish its limit (no native tail) ran
                # at least as many requests as it was seen running: that is a lower bound
                v = _max_running(ranks, k, rec.dp_sizes[k])
                per[k][col] = v
                fitted.append(Fitted(col, k, v, sum(len(ranks[(k, r)].ts) for r in range(rec.dp_sizes[k])
                                                    if (k, r) in ranks), None, True,
                                     "largest num_running_reqs seen (not published): a lower bound"))
            else:
                fitted.append(Fitted(col, k, per[k][col], 0, None, False, f"no {col} samples"))
    # a request needs input + output KV on its rank: never fit a capacity below that
    need = rec.log.input_tokens + rec.log.output_tokens
    anywhere = not (rec.placement >= 0).any()
    for k in range(nw):
        on_k = np.ones(need.shape[0], dtype=bool) if anywhere else rec.placement == k
        if on_k.any() and per[k]["max_total_num_tokens"] < int(need[on_k].max()):
            per[k]["max_total_num_tokens"] = int(need[on_k].max())
            for f in fitted:
                if f.worker == k and f.name == "max_total_num_tokens":
                    f.value = per[k]["max_total_num_tokens"]
                    f.how += "; raised to the largest input + output of a request placed there"

    for k in range(nw):
        dtok = dbus = 0
        rates = []
        n = 0
        for r in range(rec.dp_sizes[k]):
            rk = ranks.get((k, r))
            if rk is None or rk.ptok is None or rk.ts.shape[0] < 2:
                continue
            a = np.diff(rk.ptok)
            b = np.diff(rk.pbusy)
            ok = (a > 0) & (b > 0)
            dtok += int(a[ok].sum())
            dbus += int(b[ok].sum())
            rates.append(a[ok] / b[ok] * 1e6)
            n += int(ok.sum())
        if dbus > 0 and n:
            v = dtok / dbus * 1e6
            rr = np.concatenate(rates)
            resid = float(np.sqrt(np.mean(((rr - v) / v) ** 2)))
            per[k]["prefill_tokens_per_s"] = v
            fitted.append(Fitted("prefill_tokens_per_s", k, v, n, resid, True,
                                 "native counters: tokens over busy time"))
        else:
            fitted.append(Fitted("prefill_tokens_per_s", k, per[k]["prefill_tokens_per_s"], 0, None,
                                 False, "no native prefill counters"))

    publish, pf = _publish(ranks)
    _fit_decode(rec, ranks, per, fitted, decode_model, publish["publish_policy"] == "interval")
    fitted.extend(pf)
    engine: dict[str, Any] = {}
    method, f = infer_dispatch(rec)
    fitted.append(f)
    if f.fitted:
        engine["load_balance_method"] = method
    chunk, f = _chunk(ranks, publish["publish_policy"] in ("on_change", "sglang"))
    fitted.append(f)
    if f.fitted:
        engine["chunked_prefill_size"] = chunk
    model = rec.model or "default"
    return Calibration(list(rec.urls), list(rec.dp_sizes), rec.decode_peers, model, per, publish,
                       fitted, engine)


def _chunk(ranks: dict[tuple[int, int], _Rank], every_step: bool) -> tuple[int, Fitted]:
    """``chunked_prefill_size`` from the prefill-token counter: with a sample after every
    prefill step (on-change publishing) each increment is one step's computed tokens, and a
    chunked engine's long prompts stop many steps at exactly the chunk size."""
    how_default = f"4096 = {UNKNOWN_GPU_CHUNK}, SGLang's value when the device memory is unknown"
    if not every_step:
        return UNKNOWN_GPU_CHUNK, Fitted("chunked_prefill_size", None, UNKNOWN_GPU_CHUNK, 0, None,
                                         False, "samples are not one per prefill step, so step "
                                         f"sizes cannot be read; {how_default}")
    inc = [np.diff(rk.ptok) for rk in ranks.values() if rk.ptok is not None and rk.ts.shape[0] > 1]
    d = np.concatenate(inc) if inc else np.zeros(0, dtype=np.int64)
    d = d[d > 0]
    if d.shape[0] == 0:
        return UNKNOWN_GPU_CHUNK, Fitted("chunked_prefill_size", None, UNKNOWN_GPU_CHUNK, 0, None,
                                         False, f"no prefill counters; {how_default}")
    m = int(d.max())
    at = int((d == m).sum())
    if at >= CHUNK_MIN_STEPS:
        return m, Fitted("chunked_prefill_size", None, m, int(d.shape[0]), None, True,
                         f"{at} prefill steps computed exactly {m} tokens, none more")
    return UNKNOWN_GPU_CHUNK, Fitted("chunked_prefill_size", None, UNKNOWN_GPU_CHUNK,
                                     int(d.shape[0]), None, False,
                                     f"no step size repeats at the top (largest {m:,} tokens, "
                                     f"{at} step(s)): no prompt was cut; {how_default}")


def infer_dispatch(rec: RecordedTrace) -> tuple[str, Fitted]:
    """Which ``load_balance_method`` the recording's engines used, from which rank served
    each request: ``round_robin`` when nearly every request on a worker went to the rank
    after the previous one's; else ``total_requests`` / ``total_tokens`` when nearly every
    request went to the rank whose latest published load, plus the requests sent to it since,
    was the least; else neither (the default is kept and the scores are reported)."""
    default = "round_robin"
    multi = [k for k, dp in enumerate(rec.dp_sizes) if dp > 1]
    if not multi:
        return default, Fitted("load_balance_method", None, default, 0, None, False,
                               "every worker has one rank: nothing to dispatch")
    ranks = recorded_dp_ranks(rec)
    if ranks is None:
        return default, Fitted("load_balance_method", None, default, 0, None, False,
                               "the trace does not record which rank served each request")
    rr_hit = rr_n = 0
    ll = {"total_requests": [0, 0], "total_tokens": [0, 0]}
    loads = rec.loads
    ts = rec.log.ts_ns + rec.t0_ns
    for k in multi:
        dp = rec.dp_sizes[k]
        on = np.nonzero((rec.placement == k) & (ranks >= 0) & (ranks < dp))[0]
        if on.shape[0] < 2:
            continue
        seq = ranks[on]
        rr_hit += int((seq[1:] == (seq[:-1] + 1) % dp).sum())
        rr_n += int(on.shape[0] - 1)
        if loads is None or not loads.height:
            continue
        lk = loads.filter(pl.col("worker") == rec.urls[k]).sort("ts", maintain_order=True)
        arr = ts[on]
        views = {}
        for method, col in (("total_requests", None), ("total_tokens", "num_total_tokens")):
            if col is not None and col not in lk.columns:
                continue
            v = np.zeros((dp, on.shape[0]))
            for r in range(dp):
                g = lk.filter(pl.col("dp_rank") == r)
                sts = g["ts"].to_numpy().astype(np.int64)
                if col is None:
                    val = (g["num_running_reqs"].fill_null(0) + g["num_waiting_reqs"].fill_null(0)).to_numpy()
                    add = np.ones(on.shape[0])
                else:
                    val = g[col].fill_null(0).to_numpy()
                    add = rec.log.input_tokens[on].astype(np.float64)
                j = np.searchsorted(sts, arr, side="right") - 1
                base = np.where(j >= 0, val[np.maximum(j, 0)], 0).astype(np.float64)
                since = np.where(j >= 0, sts[np.maximum(j, 0)], np.iinfo(np.int64).min)
                mine = seq == r
                csum = np.concatenate([[0.0], np.cumsum(np.where(mine, add, 0.0))])
                # requests sent to r after its sample and before this one
                first = np.searchsorted(arr, since, side="right")
                idx = np.arange(on.shape[0])
                v[r] = base + csum[idx] - csum[np.minimum(first, idx)]
            views[method] = v
        for method, v in views.items():
            pick = np.argmin(v, axis=0)
            ll[method][0] += int((pick == seq).sum())
            ll[method][1] += int(on.shape[0])
    if rr_n == 0:
        return default, Fitted("load_balance_method", None, default, 0, None, False,
                               "fewer than two requests with a recorded rank on any worker")
    rr = rr_hit / rr_n
    scores = {m: (h / n if n else 0.0) for m, (h, n) in ll.items()}
    text = (f"{rr:.1%} of consecutive requests on the next rank; least loaded by requests "
            f"{scores['total_requests']:.1%}, by tokens {scores['total_tokens']:.1%}")
    if rr >= RR_MIN:
        return "round_robin", Fitted("load_balance_method", None, "round_robin", rr_n, 1 - rr, True,
                                     "a round-robin sequence: " + text)
    best = max(scores, key=lambda m: (scores[m], m == "total_requests"))
    if scores[best] >= LEAST_LOADED_MIN:
        return best, Fitted("load_balance_method", None, best, ll[best][1], 1 - scores[best], True,
                            "least-loaded choices: " + text)
    return default, Fitted("load_balance_method", None, default, rr_n, None, False,
                           "neither round robin nor least loaded: " + text)


def _fit_decode(rec: RecordedTrace, ranks, per, fitted, decode_model: str, interpolate: bool) -> None:
    log = rec.log
    ts = log.ts_ns
    out = log.output_tokens
    ok_lat = np.isfinite(rec.ttft_ms) & np.isfinite(rec.latency_ms) & (out >= 2) & (rec.placement >= 0)
    for k in range(len(rec.urls)):
        sel = np.nonzero(ok_lat & (rec.placement == k))[0]
        dp = rec.dp_sizes[k]
        rks = [ranks.get((k, r)) for r in range(dp)]
        counters = all(rk is not None and rk.pbusy is not None for rk in rks)
        if sel.size >= MIN_DECODE_SAMPLES:
            first = ts[sel] + np.round(rec.ttft_ms[sel] * NS_PER_MS).astype(np.int64)
            done = ts[sel] + np.round(rec.latency_ms[sel] * NS_PER_MS).astype(np.int64)
            span = (done - first).astype(np.float64)
            ntok = (out[sel] - 1).astype(np.float64)
            cand = np.empty((dp, sel.size))
            batch = np.empty((dp, sel.size))
            hit = np.zeros((dp, sel.size), dtype=bool)
            for r, rk in enumerate(rks):
                busy = ((rk.at(rk.pbusy, done, interpolate)
                         - rk.at(rk.pbusy, first, interpolate)) * 1000.0 if counters else 0.0)
                cand[r] = (span - busy) / ntok / NS_PER_MS
                if rk is None:      # no load samples of this rank: latencies alone
                    batch[r] = 1.0
                    continue
                dur = np.maximum(done - first, 1).astype(np.float64)
                batch[r] = (rk.run_integral(done) - rk.run_integral(first)) / dur
                # the rank that finished a prefill step at the first token published it then
                j = np.searchsorted(rk.ts, first, side="left")
                jj = np.minimum(j, rk.ts.shape[0] - 1)
                prev = np.maximum(jj - 1, 0)
                if counters:
                    hit[r] = ((j < rk.ts.shape[0]) & (rk.ts[jj] <= first + LOOKAHEAD_NS)
                              & (rk.ptok[jj] > rk.ptok[prev]))
            one = hit.sum(axis=0) == 1
            pick = np.argmax(hit, axis=0)
            if one.any():
                ref = float(np.median(cand[pick[one], np.nonzero(one)[0]]))
            else:
                ref = float(np.median(cand))
            closest = np.argmin(np.abs(cand - ref), axis=0)
            pick = np.where(one, pick, closest)
            cols = np.arange(sel.size)
            y = cand[pick, cols]
            x = batch[pick, cols] - 1.0
            good = np.isfinite(y) & (y > 0)
            # a request's error is the prefill time misread at its two ends, spread over
            # its tokens: weigh by tokens (exact counters make every weight moot)
            y, x, wt = y[good], x[good], ntok[good]
            if y.size >= MIN_DECODE_SAMPLES:
                slope = 0.0
                if not counters:
                    # REPLAY CHOICE: without busy counters the prefill time inside a request's
                    # decode span is unknown; it only adds, so the requests that saw the least
                    # of it (a low quantile) estimate the step time; no batch slope is fitted
                    d1 = _wquantile(y, wt, 0.05)
                    per[k]["decode_tokens_per_s"] = 1000.0 / d1
                    fitted.append(Fitted("decode_tokens_per_s", k, 1000.0 / d1, int(y.size), None,
                                         True, "first-to-last token time per token, 5th percentile "
                                         "(no busy counters to subtract prefill time)"))
                    fitted.append(Fitted("decode_step_ms_per_request", k, 0.0, 0, None, False,
                                         "needs the native prefill counters"))
                    continue
                if decode_model != "constant" and np.ptp(x) > 0:
                    sw = np.sqrt(wt)
                    A = np.vstack([np.ones_like(x), x]).T * sw[:, None]
                    (d1, s), *_ = np.linalg.lstsq(A, y * sw, rcond=None)
                    effect = s * float(np.percentile(x, 90)) / d1 if d1 > 0 else 0.0
                    if d1 > 0 and s > 0 and (decode_model == "linear" or effect >= SLOPE_MIN_EFFECT):
                        slope = float(s)
                d1 = _wmedian(y - slope * x, wt)
                pred = d1 + slope * x
                resid = float(np.sqrt(np.mean(((y - pred) / pred) ** 2)))
                per[k]["decode_tokens_per_s"] = 1000.0 / d1
                per[k]["decode_step_ms_per_request"] = slope
                how = "first-to-last token time less prefill busy, per token"
                fitted.append(Fitted("decode_tokens_per_s", k, 1000.0 / d1, int(y.size), resid,
                                     True, how))
                fitted.append(Fitted("decode_step_ms_per_request", k, slope, int(y.size), resid,
                                     True, "least squares on the mean running count"
                                     + (" (fixed at 0: --decode-model constant)"
                                        if decode_model == "constant" else
                                        "" if slope > 0 else " (no effect above 2%: 0)")))
                continue
        # Little's law fallback: running-request time while decoding over generated tokens;
        # without any recorded placement, over the whole fleet (one value for every worker)
        fleet_wide = not (rec.placement >= 0).any()
        mine = np.ones(log.n_requests, dtype=bool) if fleet_wide else rec.placement == k
        if fleet_wide:
            rks = [rk for key, rk in ranks.items() if key[0] < len(rec.urls)]
        tok = float((out[mine] - 1).clip(min=0).sum())
        if tok > 0 and all(rk is not None for rk in rks) and rks:
            integ = 0.0
            for rk in rks:
                integ += float(rk.cum_run[-1])
                if rk.pbusy is not None and rk.ts.shape[0] > 1:
                    integ -= float((rk.running[:-1] * np.diff(rk.pbusy) * 1000.0).sum())
            if integ > 0:
                d1 = integ / tok / NS_PER_MS
                per[k]["decode_tokens_per_s"] = 1000.0 / d1
                fitted.append(Fitted("decode_tokens_per_s", k, 1000.0 / d1, int(mine.sum()), None,
                                     True, "Little's law on running counts (no latencies)"
                                     if not fleet_wide else "Little's law over the whole fleet "
                                     "(no selected_worker: one value for every worker)"))
                fitted.append(Fitted("decode_step_ms_per_request", k, 0.0, 0, None, False,
                                     "needs ttft_ms and latency_ms"))
                continue
        fitted.append(Fitted("decode_tokens_per_s", k, per[k]["decode_tokens_per_s"], 0, None, False,
                             "no latencies and no running counts"))
        fitted.append(Fitted("decode_step_ms_per_request", k, 0.0, 0, None, False,
                             "needs ttft_ms and latency_ms"))


def _wquantile(v: np.ndarray, w: np.ndarray, q: float) -> float:
    o = np.argsort(v, kind="stable")
    c = np.cumsum(w[o])
    return float(v[o][np.searchsorted(c, c[-1] * q)])


def _wmedian(v: np.ndarray, w: np.ndarray) -> float:
    return _wquantile(v, w, 0.5)


REFINE_STEPS = ((0.03, 13), (0.005, 11))   # (half width, points): coarse, then around the best


def refine_decode(rec: RecordedTrace, cal: Calibration, *, seed: int = 0,
                  freshness_ms: int = 5000) -> list[str]:
    """Refine every worker's decode speed by forced-placement replays.

    With each request on the worker production chose, workers do not interact, so one
    replay per candidate scale scores every worker at once: the scale whose replay has the
    smallest mean absolute latency error on that worker's requests wins, first on a coarse
    grid of +-3%, then +-0.5% around it.  Returns one line per worker (before -> after).
    """

    ok = (rec.placement >= 0) & np.isfinite(rec.latency_ms)
    if not ok.any():
        return ["decode refinement skipped: it needs selected_worker and latency_ms"]
    placement = rec.placement
    nw = len(cal.per_worker)
    best = {k: 1.0 for k in range(nw)}

    def errors(scale: dict[int, float]) -> np.ndarray:
        fleet = cal.to_fleet(scale)
        pre = np.array(fleet.prefill, dtype=np.int64)
        forced = np.where(placement >= 0, pre[np.maximum(placement, 0)], -1)
        r = simulate(rec.log, fleet, RouterConfig(), seed=seed, freshness_ms=freshness_ms,
                     placement=forced)
        lat = r.outcomes["latency_ms"].fill_null(float("nan")).to_numpy()
        err = np.abs(lat - rec.latency_ms)
        out = np.full(nw, np.inf)
        for k in range(nw):
            m = ok & (placement == k) & np.isfinite(err)
            if m.any():
                out[k] = float(err[m].mean())
        return out

    start = errors(best)
    score = start.copy()
    for half, n in REFINE_STEPS:
        centers = dict(best)
        for off in np.linspace(-half, half, n):
            trial = {k: float(centers[k] * (1 + off)) for k in range(nw)}
            e = errors(trial)
            for k in range(nw):
                if e[k] < score[k]:
                    score[k] = e[k]
                    best[k] = trial[k]
    lines = []
    for k, w in enumerate(cal.per_worker):
        before = w["decode_tokens_per_s"]
        w["decode_tokens_per_s"] = before * best[k]
        for f in cal.fitted:
            if f.worker == k and f.name == "decode_tokens_per_s":
                f.value = w["decode_tokens_per_s"]
                f.how += f"; refined by forced replays (latency error {start[k]:.4g} -> {score[k]:.4g} ms)"
        lines.append(f"  worker {k}: decode_tokens_per_s {before:,.6g} -> {w['decode_tokens_per_s']:,.6g} "
                     f"(mean latency error {start[k]:.4g} -> {score[k]:.4g} ms)")
    return lines


def write_fleet(cal: Calibration, path: str | Path, source: str = "") -> None:
    """Write the fleet file (whole file or nothing)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.partial")
    tmp.write_text(cal.to_toml(source))
    tmp.replace(p)
