"""Several seeds per config: mean, 95% interval and a stability verdict.

A closed-loop run depends on its seed (the power-of-k sampler's draws and the
publishers' phases), and near saturation one seed can melt down while
another does not.  :func:`aggregate` turns one summary row per (config, seed)
into one row per config: every numeric metric's mean over the seeds and the
95% interval of that mean (Student t, ``<metric>_lo`` / ``<metric>_hi``; the
lower end clipped at 0 for metrics that cannot be negative), the per-seed
range (``<metric>_min`` / ``<metric>_max``: what a single run may show), the
seeds run, and a ``stable`` verdict with ``unstable_seeds``: a seed fails
when its true hit rate is more than ``HIT_POINTS`` points from the seeds'
median or its TTFT p99 more than a factor ``P99_FACTOR`` away from the
median.  The verdict is a pure function of the rows, whatever order the runs
finished in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import polars as pl

from replay.errors import ParamError
from replay.runs.metrics import HIT_POINTS, P99_FACTOR


def parse_seeds(text: str | None, base: int) -> list[int] | None:
    """``--seeds``: a count N (seeds base..base+N-1) or a comma list; None when not given."""
    if text is None:
        return None
    t = text.strip()
    try:
        if "," in t:
            seeds = [int(x) for x in t.split(",") if x.strip()]
        else:
            n = int(t)
            if n < 1:
                raise ValueError
            seeds = list(range(base, base + n))
    except ValueError:
        raise ParamError("seeds", f"must be a count >= 1 or a comma list of seeds, got {text!r}") from None
    if not seeds or any(s < 0 or s >= 2**63 for s in seeds):
        raise ParamError("seeds", f"must each be in 0..2**63-1, got {text!r}")
    if len(set(seeds)) != len(seeds):
        raise ParamError("seeds", f"must not list a seed twice (listed twice in {text!r})")
    return seeds


def _t975(n: int) -> float:
    # two-sided 95% Student t quantiles for n - 1 degrees of freedom (n <= 31), else normal
    table = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
             2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074,
             2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
    return table[n - 2] if 2 <= n <= 31 else 1.96


def aggregate(rows: Sequence[dict[str, Any]], knob_cols: Sequence[str]) -> pl.DataFrame:
    """One row per ``config_id`` from rows carrying ``config_id``, ``seed`` and metrics."""
    by: dict[int, list[dict]] = {}
    for r in rows:
        by.setdefault(int(r["config_id"]), []).append(r)
    out = []
    for cid in sorted(by):
        runs = sorted(by[cid], key=lambda r: r["seed"])
        row: dict[str, Any] = {k: runs[0][k] for k in ("config_id", *knob_cols) if k in runs[0]}
        row["seeds"] = [int(r["seed"]) for r in runs]
        n = len(runs)
        for k, v in runs[0].items():
            if k in row or k == "seed" or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            vals = np.array([r[k] if r[k] is not None else np.nan for r in runs], dtype=np.float64)
            ok = vals[np.isfinite(vals)]
            mean = float(ok.mean()) if ok.size else None
            half = (_t975(ok.size) * float(ok.std(ddof=1)) / math.sqrt(ok.size)
                    if ok.size >= 2 else 0.0)
            row[k] = mean
            lo = None if mean is None else mean - half
            if lo is not None and ok.size and ok.min() >= 0:
                lo = max(lo, 0.0)  # every metric here is >= 0: so is its interval
            row[f"{k}_lo"] = lo
            row[f"{k}_hi"] = None if mean is None else mean + half
            # the per-seed range: what one run (one day) may look like, not where the mean lies
            row[f"{k}_min"] = float(ok.min()) if ok.size else None
            row[f"{k}_max"] = float(ok.max()) if ok.size else None
        hits = np.array([r["true_hit_rate"] or 0.0 for r in runs])
        p99 = np.array([r["ttft_ms_p99"] if r["ttft_ms_p99"] is not None else np.nan for r in runs])
        mh, mp = float(np.median(hits)), float(np.nanmedian(p99)) if np.isfinite(p99).any() else 0.0
        failed = []
        for r, h, p in zip(runs, hits, p99, strict=True):
            off_hit = abs(h - mh) * 100 > HIT_POINTS
            off_p99 = mp > 0 and np.isfinite(p) and (p > mp * P99_FACTOR or p < mp / P99_FACTOR)
            if off_hit or off_p99:
                failed.append(int(r["seed"]))
        row["stable"] = (not failed) if n >= 2 else None  # one seed cannot tell
        row["unstable_seeds"] = failed
        out.append(row)
    return pl.DataFrame(out)
