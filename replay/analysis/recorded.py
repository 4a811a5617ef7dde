"""What a trace says it was produced under, held against a sweep.

A trace may record the router config, seed and freshness it was produced
with: ``trace.json`` (``router``: the given flags; ``extra.seed``,
``extra.freshness_ms``) or, for a simulated trace, ``sim.json`` (``config``,
``seed``, ``freshness_ms``).  When the trace also has ``selected_worker``,
``sweep`` prints the agreement of the replay with it, and names the knob,
seed or freshness that differs from the recording, so a sweep with the wrong
``--seed`` or without a knob the recording used does not pass silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from replay.config import KNOB_NAMES, KNOBS, RouterConfig
from replay.runs import names as run_files
from replay.runs.names import SIM_JSON, TRACE_JSON
from replay.runs.rundir import read_json
from replay.trace.info import read_trace_info


@dataclass(frozen=True)
class Recorded:
    """The config a trace was produced under, and where that was read from."""

    knobs: dict[str, Any]
    seed: int | None
    freshness_ms: int | None
    source: str
    per_dp_rank: bool = False


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def read_recorded(trace_dir: str | Path) -> Recorded | None:
    """The recorded config of a trace directory, or None when it records none.

    ``trace.json`` is read by the trace's own reader (:func:`replay.trace.info.read_trace_info`:
    a bad one is an error, as it is to every command); ``sim.json``, which a simulation
    writes beside its trace, counts when it holds a readable ``config``."""
    d = Path(trace_dir)
    info = read_trace_info(d)
    if info.path is not None and info.router_given:
        # REPLAY CHOICE: traces/README.md says trace.json's `extra` is never read; the seed and
        # freshness a producer keeps there (simulate writes them) are read here, as calibrate does
        return Recorded(RouterConfig(**info.router).as_dict(), _int(info.extra.get("seed")),
                        _int(info.extra.get("freshness_ms")), str(d / TRACE_JSON), info.per_dp_rank)
    sim = read_json(d / SIM_JSON)
    given = sim.get("config") if sim is not None else None
    if sim is None or not isinstance(given, dict):
        return None
    try:
        cfg = RouterConfig(**{k: v for k, v in given.items() if k in KNOB_NAMES}).as_dict()
    except (TypeError, ValueError):
        return None
    return Recorded(cfg, _int(sim.get("seed")), _int(sim.get("freshness_ms")), str(d / SIM_JSON))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and float(a) == float(b)
    return a == b


def _fmt(v: Any) -> str:
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def agreement_lines(summary: pl.DataFrame, recorded: Recorded | None, *, seed: int,
                    freshness_ms: int) -> list[str]:
    """The lines ``sweep`` prints about agreement with the trace's ``selected_worker``."""
    if "agreement" not in summary.columns:
        return []
    rows = list(summary.iter_rows(named=True))
    known = [r for r in rows if r["agreement"] is not None]
    if not known:
        return ["agreement with the trace's selected_worker: unknown (no request records one)"]
    best = max(known, key=lambda r: (r["agreement"], -r["config_id"]))
    lines = [(f"agreement with the trace's selected_worker: best {best['agreement']:.5f} "
              f"(config {best['config_id']}), worst {min(r['agreement'] for r in known):.5f} "
              f"over {len(known)} configs")]
    if recorded is None:
        lines.append("  the trace records no production config (trace.json router / sim.json config): "
                     "agreement below 1 cannot be traced to a knob or seed")
        return lines
    knobs = [k for k in KNOB_NAMES if k in summary.columns]
    col = {k: k for k in knobs}
    if recorded.per_dp_rank:
        # the recorded limit and floor are per-rank numbers: held against the per-rank columns
        if "per_rank_limit" not in summary.columns or summary["per_rank_limit"].null_count() == summary.height:
            lines.append("  the trace's config is per dp rank (trace.json per_dp_rank): sweep with --per-dp-rank "
                         "to compare with it")
            return lines
        col.update(worker_queue_limit="per_rank_limit", saturation_queue_floor="per_rank_floor")
    match = [r for r in rows if all(_same(r[col[k]], recorded.knobs.get(k)) for k in knobs)]
    where = Path(recorded.source).name
    if match:
        r = match[0]
        ag = r["agreement"]
        lines.append(f"  config {r['config_id']} is the recorded config ({where}): agreement "
                     + ("unknown" if ag is None else f"{ag:.5f}"))
    else:
        diffs = []
        for k in knobs:
            want = recorded.knobs.get(k)
            have = sorted({_fmt(v) for v in summary[col[k]].to_list()})
            if not any(_same(v, want) for v in summary[col[k]].to_list()):
                diffs.append(f"{KNOBS[k].flag} {_fmt(want)} (this grid: {','.join(have)})")
        what = "; ".join(diffs) if diffs else "the recorded combination of knob values"
        lines.append(f"  no config of this grid is the recorded config ({where}): it differs in {what}")
    if recorded.seed is not None and recorded.seed != seed:
        lines.append(f"  the trace was produced with seed {recorded.seed} ({where}); this sweep used --seed {seed}: "
                     "sampled decisions differ (re-run with --seed "
                     f"{recorded.seed})")
    if recorded.freshness_ms is not None and recorded.freshness_ms != freshness_ms:
        lines.append(f"  the trace was produced with freshness {recorded.freshness_ms} ms ({where}); this sweep "
                     f"used --freshness-ms {freshness_ms}")
    return lines


def grid_dir_error(path: str | Path) -> str | None:
    """The one-line error for a simulator grid directory given where a trace is expected."""
    p = Path(path)
    if not p.is_dir() or (p / run_files.REQUESTS).exists() or (p / run_files.REQUESTS_DIR).is_dir():
        return None
    if (p / run_files.PREDICTION / run_files.CLOSED_LOOP).is_file():
        return (f"{p}: a calibrate --validate directory (fidelity.json, prediction/), not a trace; its "
                f"prediction grid is {p / run_files.PREDICTION}: router-replay recommend {p} reads it")
    subs = sorted((c for c in p.iterdir() if c.is_dir() and c.name.startswith("config-")),
                  key=lambda c: (len(c.name), c.name))
    if not subs and not (p / run_files.CLOSED_LOOP).is_file():
        return None
    seeded = [s for s in subs if not (s / run_files.REQUESTS).is_file() and any(s.glob("seed-*"))]
    names = ", ".join(c.name + "/" for c in subs[:8]) + (f" ... ({len(subs)} in all)" if len(subs) > 8 else "")
    example = subs[0] / (min(x.name for x in subs[0].glob("seed-*")) if seeded else "") if subs else p
    return (f"{p}: a closed-loop simulator grid, not a trace: it holds {names or 'no config directory'}; "
            f"sweep one config's trace (e.g. {example}), or read the grid with "
            f"router-replay recommend {p} / router-replay report RUN --closed-loop {p}")
