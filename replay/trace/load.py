"""``load_trace``: a trace directory read, checked and encoded into a :class:`Trace`."""

from __future__ import annotations

import os

from replay.trace.assemble import (
    finish_trace,
)
from replay.trace.base import PARALLEL_ROWS, run_both
from replay.trace.columns import Columns, map_names
from replay.trace.core import Trace
from replay.trace.encode import (
    read_closed_loop,
    read_loads,
    read_matches,
    read_requests,
    to_ids,
)
from replay.trace.fast import load_fast
from replay.trace.files import Frames, read_frames
from replay.trace.info import TraceInfo, read_trace_info
from replay.trace.workers import Universe, make_universe, parse_workers_table


def load_trace(path: str | os.PathLike, *, model: str | None = None) -> Trace:
    """Read, check and encode a trace directory (see ``traces/README.md``).

    ``path`` holds ``requests.parquet`` (or a ``requests/`` folder of Parquet
    files, optionally hive-partitioned), ``loads.parquet`` (or ``loads/``)
    and optionally ``workers.parquet`` and ``trace.json``.  Rows are sorted by
    ``ts`` (stable) in memory; the files are never modified.  With ``model``,
    only that model's requests are kept (``Trace.req_index`` keeps their
    position in the whole time-sorted trace); an unknown model is an error.

    Raises :class:`TraceError` (one line: file, column, first bad row,
    0-based in the file as given) on any bad input.  Traces larger than
    memory are replayed window by window instead (:class:`TraceSet`).
    """
    info = read_trace_info(path)
    tr = load_fast(path, model=model, info=info)
    if tr is not None:
        return tr
    return build_trace(read_frames(path), model=model, info=info)


def build_trace(fr: Frames, *, model: str | None = None, universe: Universe | None = None,
                index_offset: int = 0, strict_model: bool = True, facts: bool = True,
                info: TraceInfo | None = None) -> Trace:
    """Check and encode frames into a :class:`Trace`.

    With ``universe`` (a window of a trace set), worker ids and models are the
    whole set's, and request ``i`` of the frame has request index
    ``index_offset + i`` (after the stable sort by ts).  ``strict_model=False``
    accepts a ``model`` that has no request in these frames (a window);
    ``facts=False`` skips the data facts that cost memory (per-worker ranks,
    unknown address names), which a window does not need.
    """
    info = TraceInfo() if info is None else info
    R = Columns(fr.req_name, fr.requests, fr.req_locate)
    L = Columns(fr.load_name, fr.loads, fr.load_locate)
    table = parse_workers_table(fr.workers) if fr.workers is not None and universe is None else None

    # requests and loads are independent until the universe: one thread each
    parallel = fr.requests.height + fr.loads.height >= PARALLEL_ROWS

    def requests_side():
        rq = read_requests(R)
        mt = read_matches(R)
        cl = read_closed_loop(R, rq.input_tokens)
        names = None if universe is not None else (mt.worker.unique().to_list(), rq.model.unique().to_list())
        return rq, mt, cl, names

    def loads_side():
        ld = read_loads(L)
        return ld, None if universe is not None else ld.worker.unique().to_list()

    (rq, mt, cl, names), (ld, load_names) = run_both(requests_side, loads_side, parallel=parallel)
    if universe is None:
        universe = make_universe(table, load_names, names[0], names[1], info.page_size)
    req_model, load_worker, match_worker = to_ids(universe, R, L, rq.model, ld.worker, mt.worker,
                                                  parallel=parallel)
    selected = None
    sel_null = sel_unknown = None
    if rq.selected is not None:
        selected = map_names(rq.selected, universe.workers)
        sel_null = int(rq.selected.null_count())
        sel_unknown = int(((selected < 0) & rq.selected.is_not_null().to_numpy()).sum())
    return finish_trace(fr, universe, R, L, rq, mt, cl, ld, req_model, load_worker, match_worker,
                        (selected, sel_null, sel_unknown), model=model, strict_model=strict_model,
                        index_offset=index_offset, facts=facts, info=info)
