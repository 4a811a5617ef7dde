"""Results: per-config accumulators, the summary table and the decisions file.

Every metric is mergeable: counts, sums and fixed-bucket histograms, so
chunks (and later shards) combine exactly.  Label codes become strings here
and nowhere earlier.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from replay import labels
from replay.config import KNOBS
from replay.kernels import layout as kl
from replay.kernels import outcomes
from replay.runs import decisions as store
from replay.runs import flat_parquet as fp
from replay.sweep.engine import Chunk, Totals
from replay.trace import Trace, TraceSet

ACC = kl.ACC


class Accumulator:
    """Per-config totals of a sweep, turned into the summary table.

    Wraps the kernels' :class:`replay.sweep.engine.Totals` (counts, integer sums and
    fixed-bucket histograms, so every merge is exact).
    """

    def __init__(self, n_configs: int, totals: Totals | None = None):
        self.totals = totals if totals is not None else Totals(1, n_configs)

    @property
    def acc(self) -> np.ndarray:
        """Merged counts and sums, ``[config, ACC field]``."""
        return self.totals.merged().acc[0].T

    def merge(self, other: Accumulator) -> None:
        """Fold another accumulator (same configs) into this one."""
        merged = self.totals.merged()
        merged.add(other.totals)
        self.totals = merged

    def summary(self, config_rows: list[dict], *, has_selected: bool) -> pl.DataFrame:
        """One row per config: knobs, counts, rates and pressure (see docs/outputs.md)."""
        t = self.totals.merged()
        a = t.acc[0].T  # [config, field]
        hist_wait = t.hist_wait[0].T  # [config, value]
        hist_div = t.hist_div[0].T
        cols: dict[str, object] = {}
        knob_names = [k for k in config_rows[0] if k != "config_id"] if config_rows else []
        cols["config_id"] = [r["config_id"] for r in config_rows]
        for k in knob_names:
            cols[k] = [r[k] for r in config_rows]
        for name in ("requests", "routed", "failed"):
            cols[name] = a[:, ACC[name]]
        for d in labels.DECISIONS:
            cols[d] = a[:, ACC[f"decision_{d}"]]
        for p in labels.POLICY_REASONS:
            cols[f"policy_{p}"] = a[:, ACC[f"policy_{p}"]]
        for f in labels.FAILURES:
            cols[f"failure_{f}"] = a[:, ACC[f"failure_{f}"]]
        for o in labels.REORG_OUTCOMES:  # the replay's own outcomes of a reorg config (0 under legacy)
            cols[f"reorg_{o}"] = a[:, ACC[f"reorg_{o}"]]

        def ratio(num, den):
            num = np.asarray(num, dtype=np.float64)
            den = np.asarray(den, dtype=np.float64)
            with np.errstate(invalid="ignore", divide="ignore"):
                r = num / den
            return [None if not np.isfinite(x) else float(x) for x in r]

        q = a[:, ACC["query_blocks"]]
        cols["query_blocks"] = q
        cols["matched_blocks"] = a[:, ACC["matched_blocks"]]
        cols["selected_blocks"] = a[:, ACC["selected_blocks"]]
        cols["hit_rate"] = ratio(a[:, ACC["selected_blocks"]], q)
        cols["matched_rate"] = ratio(a[:, ACC["matched_blocks"]], q)
        cols["owner_rate"] = ratio(a[:, ACC["owner_hits"]], a[:, ACC["owner_chances"]])
        cols["diverted"] = a[:, ACC["diverted"]]
        cols["pinned"] = a[:, ACC["pinned"]]
        cols["fell_back"] = a[:, ACC["fell_back"]]
        cols["fleet_all_queued"] = a[:, ACC["fleet_all_queued"]]
        cols["selected_waiting_mean"] = ratio(a[:, ACC["waiting_sum"]], a[:, ACC["waiting_known"]])
        cols["selected_waiting_p50"] = _quantiles(hist_wait, 0.50)
        cols["selected_waiting_p99"] = _quantiles(hist_wait, 0.99)
        cols["selected_waiting_max_bucket"] = [
            None if not h.any() else int(np.nonzero(h)[0][-1]) for h in hist_wait
        ]
        cols["selected_waiting_uncached_mean"] = ratio(a[:, ACC["waiting_uncached_sum"]],
                                                       a[:, ACC["waiting_uncached_known"]])
        cols["selected_queue_ms_mean"] = ratio(a[:, ACC["queue_us_sum"]] / 1000.0, a[:, ACC["queue_ms_known"]])
        cols["cold_prefill_tokens"] = a[:, ACC["cold_prefill_tokens"]]
        cols["guard_compared"] = a[:, ACC["guard_compared"]]
        cols["guard_overrides"] = a[:, ACC["guard_overrides"]]
        cols["admission_evaluated"] = a[:, ACC["admission_evaluated"]]
        cols["admission_rejected"] = a[:, ACC["admission_rejected"]]
        cols["gate_rejected"] = a[:, ACC["gate_rejected"]]
        for b, bound in enumerate(labels.DIVERTED_BUCKETS):
            cols[f"diverted_overlap_le_{bound}"] = hist_div[:, b]
        cols["diverted_overlap_le_inf"] = hist_div[:, -1]
        # the locality waterfall: matched_blocks - sum(lost_*) == selected_blocks
        for step in labels.LOSS_STEPS:
            cols[f"lost_{step}"] = a[:, ACC[f"lost_{step}"]]
        if has_selected:
            cols["agreement"] = ratio(a[:, ACC["agree"]], a[:, ACC["agree_known"]])
            cols["agreement_requests"] = a[:, ACC["agree_known"]]
        return pl.DataFrame(cols, schema_overrides=_summary_dtypes(cols), strict=False)


_KIND_DTYPE = {"int": pl.Int64, "float": pl.Float64, "bool": pl.Boolean, "choice": pl.String}
_INT_SUMMARY = ("config_id", "dp_size", "per_rank_limit", "per_rank_floor",
                "selected_waiting_p50", "selected_waiting_p99", "selected_waiting_max_bucket")


def _summary_dtypes(cols: dict) -> dict:
    """Fixed dtypes for the summary columns that can be all-None (a knob left at a
    None default, a metric with no known value), so the schema never depends on values."""
    out = {}
    for name, values in cols.items():
        if name in KNOBS:
            out[name] = _KIND_DTYPE[KNOBS[name].kind]
        elif name in _INT_SUMMARY:
            out[name] = pl.Int64
        elif isinstance(values, list):
            out[name] = pl.Float64  # ratios and means
    return out


def _quantiles(hist: np.ndarray, q: float) -> list:
    """Nearest-rank quantile of each row's integer histogram (None when empty).

    The last bucket holds every value >= its index; a quantile falling there
    reads as that lower bound.
    """
    out: list[int | None] = []
    for h in hist:
        total = int(h.sum())
        if total == 0:
            out.append(None)
            continue
        rank = max(1, int(np.ceil(q * total)))
        out.append(int(np.searchsorted(np.cumsum(h), rank)))
    return out


# ---------------------------------------------------------------------------
# the long layout's columns by how they are taken from the kernels' rows (kernels/layout.py O_*)
_CODE_FIELDS = {   # label codes and nullable counts: null where < 0
    "worker": kl.O_WORKER, "reason": kl.O_REASON, "policy_reason": kl.O_POLICY_REASON,
    "decision": kl.O_DECISION, "failure": kl.O_FAILURE, "uncached_tokens": kl.O_UNCACHED_TOKENS,
    "selected_waiting": kl.O_SELECTED_WAITING, "selected_waiting_uncached": kl.O_SELECTED_WAITING_UNCACHED,
    "pressure_source": kl.O_PRESSURE_SOURCE, "lost_to": kl.O_LOST_TO, "reorg_outcome": kl.O_REORG_OUTCOME,
}
_PLAIN_FIELDS = {  # never null
    "matched_blocks": kl.O_MATCHED_BLOCKS, "selected_blocks": kl.O_SELECTED_BLOCKS,
    "gate_rejected": kl.O_GATE_REJECTED, "admission_evaluated": kl.O_ADMISSION_EVALUATED,
    "admission_rejected": kl.O_ADMISSION_REJECTED, "best_rejected_blocks": kl.O_BEST_REJECTED_BLOCKS,
    "guard_compared": kl.O_GUARD_COMPARED, "guard_overrides": kl.O_GUARD_OVERRIDES,
}
_LOST_FIELDS = {   # null where the decision failed
    "lost_candidates": kl.O_LOST_CANDIDATES, "lost_queue_gate": kl.O_LOST_QUEUE_GATE,
    "lost_capacity": kl.O_LOST_CAPACITY,
}
_INT32_FIELDS = ("gate_rejected", "admission_evaluated", "admission_rejected", "guard_compared", "guard_overrides")


class DecisionWriter:
    """Streams decisions to Parquet, one row group per chunk.

    ``layout`` ``"long"``: one row per (request, config); ``"outcomes"``: one row
    per request with its distinct outcomes and each config's index into them
    (:mod:`replay.runs.decisions` reads either back as the long rows)."""

    def __init__(self, path: str, trace: Trace | TraceSet, config_ids: list[int], layout: str = "long"):
        if layout not in store.LAYOUTS:
            raise ValueError(f"decisions layout {layout!r}: not one of {', '.join(store.LAYOUTS)}")
        self.path = path
        self.layout = layout
        self.trace = trace
        self.config_ids = np.asarray(config_ids, dtype=np.int32)
        self.workers = pa.array(list(trace.workers), type=pa.string())
        self.reasons = pa.array(labels.REASONS, type=pa.string())
        self.policy = pa.array(labels.POLICY_REASONS, type=pa.string())
        self.decisions = pa.array(labels.DECISIONS, type=pa.string())
        self.failures = pa.array(labels.FAILURES, type=pa.string())
        self.sources = pa.array(labels.PRESSURE_SOURCES, type=pa.string())
        self.loss_steps = pa.array(labels.LOSS_STEPS, type=pa.string())
        self.reorg_outcomes = pa.array(labels.REORG_OUTCOMES, type=pa.string())
        self.writer: pq.ParquetWriter | None = None     # the outcomes layout (pyarrow)
        self.flat: fp.FlatParquetWriter | None = None   # the long layout
        self._config_cache: tuple[int, fp.Runs] | None = None
        self.rows = 0
        self.failed = False
        self.closed = False

    @staticmethod
    def _labels(table: pa.Array, codes: np.ndarray) -> pa.Array:
        """Label strings as a dictionary column (codes < 0 are null): no string copies."""
        codes = codes.astype(np.int32)
        return pa.DictionaryArray.from_arrays(pa.array(codes, mask=codes < 0), table)

    @staticmethod
    def _nullable(values: np.ndarray, dtype=np.int64) -> pa.Array:
        return pa.array(values.astype(dtype), mask=values < 0)

    def _label_tables(self) -> dict[str, pa.Array]:
        """The label columns and the strings their codes index."""
        return {"worker": self.workers, "reason": self.reasons, "policy_reason": self.policy,
                "decision": self.decisions, "failure": self.failures, "pressure_source": self.sources,
                "lost_to": self.loss_steps, "reorg_outcome": self.reorg_outcomes}

    def _fields(self, o: np.ndarray, ms: np.ndarray) -> dict[str, pa.Array]:
        """The per-decision columns (all but request_id, config_id and query_blocks) of
        decisions ``o`` (int64[O_NCOLS, m]) with their ``selected_queue_ms`` ``ms``, in the
        long layout's column order, taken from the kernels' rows as the field tables above say."""
        failed = o[kl.O_WORKER] < 0
        labelled = self._label_tables()
        out: dict[str, pa.Array] = {}
        for name in store.LONG_COLUMNS:
            if name in labelled:
                out[name] = self._labels(labelled[name], o[_CODE_FIELDS[name]])
            elif name in _CODE_FIELDS:
                out[name] = self._nullable(o[_CODE_FIELDS[name]])
            elif name in _PLAIN_FIELDS:
                v = o[_PLAIN_FIELDS[name]]
                out[name] = pa.array(v.astype(np.int32) if name in _INT32_FIELDS else v)
            elif name in _LOST_FIELDS:
                out[name] = pa.array(o[_LOST_FIELDS[name]], mask=failed)
            elif name == "blocks_lost":
                # the locality waterfall's drill-down: blocks a routed decision gave away, and where first
                # (the choosing step's term is the rest: blocks_lost minus the lost_* terms; fields.waterfall_terms)
                out[name] = pa.array(o[kl.O_MATCHED_BLOCKS] - o[kl.O_SELECTED_BLOCKS], mask=failed)
            elif name == "fleet_all_queued":
                out[name] = pa.array(o[kl.O_FLEET_ALL_QUEUED] == 1)
            elif name == "fell_back":
                out[name] = pa.array(o[kl.O_FELL_BACK] == 1)
            elif name == "selected_queue_ms":
                out[name] = pa.array(ms, mask=np.isnan(ms))
        return out

    def write(self, chunk: Chunk, trace: Trace | None = None) -> None:
        """Append a chunk's rows; ``trace`` is the window the chunk belongs to
        (default: the writer's trace).  After a failed write the file is left
        unfinished (:meth:`close` then writes nothing)."""
        try:
            self._write(chunk, trace)
        except BaseException:
            self.failed = True
            raise

    def _ids(self, tr, chunk: Chunk) -> tuple[np.ndarray, np.ndarray]:
        """The chunk's request ids and query blocks (at least 0)."""
        ids = getattr(tr, "request_id", np.zeros(0, dtype=object))[chunk.start:chunk.stop]
        qb = np.maximum(getattr(tr, "req_query_blocks", np.zeros(0, dtype=np.int64))[chunk.start:chunk.stop],
                        0).astype(np.int64)
        return ids, qb

    def long_table(self, chunk: Chunk, trace: Trace | None = None) -> pa.Table:
        """A chunk's long rows as one Arrow table, as earlier versions wrote them through
        pyarrow (dictionary columns for labels): the reference the long file is held to
        (``tests/test_decisions_writer.py``)."""
        tr = self.trace if trace is None else trace
        ids, qb = self._ids(tr, chunk)
        n = chunk.stop - chunk.start
        n_cfg = len(self.config_ids)
        o = chunk.out_i.reshape(kl.O_NCOLS, n * n_cfg)
        rep = np.repeat(np.arange(n, dtype=np.int32), n_cfg)
        if ids.dtype == object:  # string ids: the chunk's ids as a dictionary
            rid = pa.DictionaryArray.from_arrays(pa.array(rep), pa.array(ids.tolist(), pa.string()))
        else:
            rid = pa.array(np.asarray(ids, dtype=np.int64)[rep])
        fields = self._fields(o, chunk.out_f[kl.F_SELECTED_QUEUE_MS].reshape(-1))
        head = {"request_id": rid, "config_id": pa.array(np.tile(self.config_ids, n))}
        return pa.table({**head, **{k: v for k, v in fields.items() if k in store.BEFORE_QUERY_BLOCKS},
                         "query_blocks": pa.array(qb[rep]),
                         **{k: v for k, v in fields.items() if k not in store.BEFORE_QUERY_BLOCKS}})

    def _write(self, chunk: Chunk, trace: Trace | None) -> None:
        tr = self.trace if trace is None else trace
        n = chunk.stop - chunk.start
        n_cfg = len(self.config_ids)
        ids, qb = self._ids(tr, chunk)
        if self.layout == store.LONG:
            self._write_long(chunk, ids, qb)
            return
        table = self._outcomes_table(chunk, ids, qb)
        if self.writer is None:
            # Dictionary columns are written as plain Parquet strings (dictionary
            # pages); without the stored Arrow schema, readers get strings back.
            # (statistics on request_id only; no reader uses the lists' min/max)
            self.writer = pq.ParquetWriter(self.path, table.schema, compression="zstd",
                                           store_schema=False, write_statistics=["request_id"])
            self.writer.add_key_value_metadata(store.outcomes_metadata(self.config_ids.tolist()))
        self.writer.write_table(table)
        self.rows += n * n_cfg

    def _long_columns(self, string_ids: bool) -> list[fp.Column]:
        """The long layout's columns (store.LONG_COLUMNS), their kinds and label tables."""
        labelled = self._label_tables()
        kinds = {"request_id": "string" if string_ids else "int64", "config_id": "int32",
                 "selected_queue_ms": "float64", "fleet_all_queued": "bool", "fell_back": "bool",
                 **{c: "int32" for c in _INT32_FIELDS}}
        return [fp.Column(c, "string" if c in labelled else kinds.get(c, "int64"), labelled.get(c))
                for c in store.LONG_COLUMNS]

    def _write_long(self, chunk: Chunk, ids: np.ndarray, qb: np.ndarray) -> None:
        """One row group of the long layout: every column handed over as its runs
        (:mod:`replay.runs.flat_parquet`), the same values and types the Arrow table of
        earlier versions had."""
        n = chunk.stop - chunk.start
        n_cfg = len(self.config_ids)
        string_ids = ids.dtype == object
        if self.flat is None:
            self.flat = fp.FlatParquetWriter(self.path, self._long_columns(string_ids))
        rows = n * n_cfg
        if rows == 0:
            return
        o = chunk.out_i.reshape(kl.O_NCOLS, rows)
        per_req = np.full(n, n_cfg, dtype=np.int64)
        data: dict[str, object] = {}
        if string_ids:
            names = pa.array(ids.tolist(), pa.string())
            null = None if names.null_count == 0 else np.asarray(names.is_null())
            data["request_id"] = (fp.Runs(np.arange(n, dtype=np.int64), per_req, null),
                                  names.fill_null("") if null is not None else names)
        else:
            data["request_id"] = fp.Runs(np.asarray(ids, dtype=np.int64), per_req)
        data["query_blocks"] = fp.Runs(qb, per_req)
        data["config_id"] = self._config_runs(n)
        for name, col in _CODE_FIELDS.items():           # labels and nullable counts: null where < 0
            r = fp.runs_of(o[col])     # (unequal negative values split a null run: harmless)
            data[name] = fp.Runs(r.values, r.lengths, r.values < 0)
        for name, col in _PLAIN_FIELDS.items():
            data[name] = fp.runs_of(o[col])
        data["fleet_all_queued"] = o[kl.O_FLEET_ALL_QUEUED] == 1
        data["fell_back"] = o[kl.O_FELL_BACK] == 1
        ms = chunk.out_f[kl.F_SELECTED_QUEUE_MS].reshape(-1)
        data["selected_queue_ms"] = fp.runs_of(ms.view(np.int64), np.isnan(ms))
        # the waterfall's columns are null where the decision failed (no worker)
        failed = o[kl.O_WORKER] < 0
        fchange = failed[1:] != failed[:-1]
        data["blocks_lost"] = fp.runs_of(o[kl.O_MATCHED_BLOCKS] - o[kl.O_SELECTED_BLOCKS], failed, fchange)
        for name, col in _LOST_FIELDS.items():
            data[name] = fp.runs_of(o[col], failed, fchange)
        self.flat.write_row_group(rows, data)
        self.rows += rows

    def _config_runs(self, n: int) -> fp.Runs:
        """config_id: the grid's ids once per request (runs of one row; kept for the chunk size)."""
        if self._config_cache is None or self._config_cache[0] != n:
            vals = np.tile(self.config_ids.astype(np.int64), n)
            self._config_cache = (n, fp.Runs(vals, np.ones(len(vals), dtype=np.int64)))
        return self._config_cache[1]

    def _outcomes_table(self, chunk: Chunk, ids: np.ndarray, qb: np.ndarray) -> pa.Table:
        """One row per request: its id, query blocks, each config's outcome index and, as
        lists, the fields of its distinct outcomes (:mod:`replay.runs.decisions`)."""
        n = chunk.stop - chunk.start
        n_cfg = len(self.config_ids)
        codes, rep, counts = outcomes.encode(chunk.out_i, chunk.out_f)
        o = chunk.out_i.reshape(kl.O_NCOLS, n * n_cfg)[:, rep]
        ms = chunk.out_f[kl.F_SELECTED_QUEUE_MS].reshape(-1)[rep]
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(counts, out=offsets[1:])
        offsets_pa = pa.array(offsets)
        code_offsets = pa.array(np.arange(0, n * n_cfg + 1, n_cfg, dtype=np.int32))
        rid = (pa.array(ids.tolist(), pa.string()) if ids.dtype == object
               else pa.array(np.asarray(ids, dtype=np.int64)))
        cols: dict[str, pa.Array] = {
            "request_id": rid,
            "query_blocks": pa.array(qb),
            store.CODE_COLUMN: pa.ListArray.from_arrays(code_offsets, pa.array(codes.reshape(-1))),
        }
        for name, values in self._fields(o, ms).items():
            cols[name] = pa.ListArray.from_arrays(offsets_pa, values)
        return pa.table(cols)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.failed:         # a failed write leaves the file unfinished
            if self.flat is not None:
                self.flat.abort()
            if self.writer is not None:
                self.writer.close()
                self.writer = None
            return
        if self.writer is None and self.flat is None:  # no requests: still leave a readable, empty file
            n_cfg = len(self.config_ids)
            self.write(Chunk(0, 0, np.zeros((kl.O_NCOLS, 0, n_cfg), dtype=np.int64),
                             np.zeros((kl.F_NCOLS, 0, n_cfg), dtype=np.float64)))
        if self.flat is not None:
            self.flat.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None
