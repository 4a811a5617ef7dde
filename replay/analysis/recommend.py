"""One recommendation for any finished directory: a capacity plan, a closed-loop grid or an
open-loop run, told apart here; each answer comes from its own module over the shared ranking."""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from replay.analysis import closed_loop, ranking
from replay.analysis import runs as open_loop
from replay.analysis.plan import recommend_plan
from replay.errors import ParamsError
from replay.runs.names import PLAN_TABLE, RUN_JSON

_BOUNDS = ("max_ttft_p99_ms", "max_queue_wait_p99_ms")


@dataclass
class Answer:
    """What ``recommend_dir`` found: ``kind`` (``plan``, ``closed loop``, ``open loop``),
    ``lines`` to print, ``met`` (a config meets the bound for every dp_size / traffic level),
    and for a config answer the router flags per dp_size with the line naming their source."""

    kind: str
    lines: list[str]
    met: bool
    flags: dict[int | None, str] = field(default_factory=dict)
    flags_source: str = ""


def kind_of(path, *, plan: bool = False) -> str:
    """``plan``, ``closed loop`` or ``open loop``: what the directory ``path`` holds."""
    if plan or (Path(path) / PLAN_TABLE).is_file():
        return "plan"
    if closed_loop.is_grid(path) and not (Path(path) / RUN_JSON).is_file():
        return "closed loop"
    return "open loop"


def recommend_dir(path, *, max_p99_waiting: float | None = None, max_ttft_p99_ms: float | None = None,
                  max_queue_wait_p99_ms: float | None = None, plan: bool = False, bound_kind: str = "mean",
                  as_json: bool = False, emit_flags: bool = False) -> Answer:
    """The recommendation for ``path`` (:func:`kind_of`), checked against the bound its kind
    takes: ``max_ttft_p99_ms`` or ``max_queue_wait_p99_ms`` for a plan or a closed-loop grid,
    ``max_p99_waiting`` for an open-loop run.  ``emit_flags``: the caller wants the router
    flags (refused for a plan).  ``as_json``: ``lines`` hold one JSON object."""
    kind = kind_of(path, plan=plan)
    if kind == "plan":
        if max_p99_waiting is not None:
            raise ParamsError("{plan} bounds TTFT p99 ({max_ttft_p99_ms}) or queue wait p99 "
                              "({max_queue_wait_p99_ms}), not {max_p99_waiting}", "plan", *_BOUNDS,
                              "max_p99_waiting")
        if emit_flags:
            raise ParamsError("{emit_flags} applies to a config recommendation, not {plan} (a plan "
                              "answers per traffic level; its flags are in {as_json})", "emit_flags", "plan",
                              ("as_json", "--json"))
        if (max_ttft_p99_ms is None) == (max_queue_wait_p99_ms is None):
            raise ParamsError("{plan} needs exactly one of {max_ttft_p99_ms} and {max_queue_wait_p99_ms}",
                              "plan", *_BOUNDS)
        lines: list[str] = []
        code = recommend_plan(path, max_ttft_p99_ms, max_queue_wait_p99_ms, lines.append, as_json=as_json,
                              bound_kind=bound_kind)
        return Answer(kind, lines, code == 0)
    if kind == "closed loop":
        return _closed_loop(path, max_p99_waiting, max_ttft_p99_ms, max_queue_wait_p99_ms, bound_kind, as_json)
    if max_ttft_p99_ms is not None or max_queue_wait_p99_ms is not None:
        raise ParamsError("{path}: an open-loop run has no TTFT or queue wait; bound it with "
                          "{max_p99_waiting:N}, or give a closed-loop grid (simulate / calibrate --validate)",
                          "max_p99_waiting", path=path)
    if max_p99_waiting is None:
        raise ParamsError("an open-loop run needs {max_p99_waiting:N}", "max_p99_waiting")
    return _open_loop(path, max_p99_waiting, as_json)


def _closed_loop(path, max_p99_waiting, ttft_ms, wait_ms, bound_kind, as_json) -> Answer:
    if max_p99_waiting is not None:
        raise ParamsError("{path}: a closed-loop grid: bound TTFT p99 ({max_ttft_p99_ms}) or queue "
                          "wait p99 ({max_queue_wait_p99_ms}), not {max_p99_waiting} (an open-loop metric)",
                          *_BOUNDS, "max_p99_waiting", path=path)
    if ttft_ms is not None and wait_ms is not None:
        raise ParamsError("give one of {max_ttft_p99_ms} and {max_queue_wait_p99_ms}", *_BOUNDS)
    if ttft_ms is None and wait_ms is None:
        raise ParamsError("{path}: a closed-loop grid needs a bound: {max_ttft_p99_ms:MS} or "
                          "{max_queue_wait_p99_ms:MS}", *_BOUNDS, path=path)
    grid = closed_loop.load_grid(path)
    rec = closed_loop.recommend(grid, bound_ms=ttft_ms if ttft_ms is not None else wait_ms,
                                on="ttft" if ttft_ms is not None else "queue_wait", bound_kind=bound_kind)
    text = json.dumps(rec.to_json(), default=str) if as_json else closed_loop.format_recommendation(rec)
    flags = ranking.deploy_flags(rec.best)
    sizes = closed_loop.dp_sizes(grid) or {None: 0}
    return Answer("closed loop", [text], rec.best is not None, {d: flags for d in sizes},
                  f"{path} (closed loop, {rec.bound_col} <= {rec.bound_ms:g} ms)")


def _open_loop(path, bound: float, as_json: bool) -> Answer:
    run = open_loop.load_run(path)
    recs = open_loop.recommend(run, bound)
    trace = (run.meta.get("trace") or {}).get("path")
    notes = [closed_loop.open_loop_line(trace)]
    found, _notes = closed_loop.find_for_run(run.path, run.meta)
    if found is not None:
        notes.append(f"a closed-loop grid of this trace exists: router-replay recommend {found.path} "
                     "--max-ttft-p99-ms MS")
    if as_json:
        lines = [json.dumps({"run": str(run.path), "kind": "open loop", "answers": [r.to_json() for r in recs],
                             "notes": notes}, default=str)]
    else:
        lines = [open_loop.format_recommendations(recs, run)]
        lines += [textwrap.fill(f"note: {n}", width=100, subsequent_indent="  ", break_on_hyphens=False)
                  for n in notes]
    dp = run.meta.get("dp_size")
    flags = {(r.dp_size if r.dp_size is not None else (dp if isinstance(dp, int) else None)): r.deploy_flags()
             for r in recs}
    return Answer("open loop", lines, all(r.best is not None for r in recs), flags,
                  f"{run.path} (open loop, selected_waiting_p99 <= {bound:g})")
