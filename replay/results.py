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

from . import labels
from .config import KNOBS
from .engine import Chunk
from .kernels import grid as kg
from .kernels._jit import njit
from .trace import Trace

# ---------------------------------------------------------------------------
# accumulator columns (int64[n_configs, N_ACC])
_ACC = (
    "requests", "routed", "failed",
    *(f"decision_{d}" for d in labels.DECISIONS),
    *(f"policy_{p}" for p in labels.POLICY_REASONS),
    *(f"failure_{f}" for f in labels.FAILURES),
    "query_blocks", "matched_blocks", "selected_blocks",
    "owner_hits", "owner_chances", "diverted", "pinned", "fell_back", "fleet_all_queued",
    "waiting_known", "waiting_sum", "waiting_uncached_known", "waiting_uncached_sum",
    "queue_ms_known", "cold_prefill_tokens", "agree", "agree_known",
    "guard_compared", "guard_overrides", "admission_evaluated", "admission_rejected",
    "gate_rejected",
)
ACC = {name: i for i, name in enumerate(_ACC)}
N_ACC = len(_ACC)
_DEC0 = ACC["decision_cache_hit"]
_POL0 = ACC["policy_cache_candidate"]
_FAIL0 = ACC["failure_prefill_admission_exhausted"]

# selected_waiting histogram: exact integer buckets 0..WAIT_HIST-2, last bucket = larger
WAIT_HIST = 1 << 14
N_DIV = len(labels.DIVERTED_BUCKETS) + 1


ACC_QUERY = ACC["query_blocks"]
ACC_MATCHED = ACC["matched_blocks"]
ACC_SELECTED = ACC["selected_blocks"]
ACC_OWNER_HITS = ACC["owner_hits"]
ACC_OWNER_CHANCES = ACC["owner_chances"]
ACC_DIVERTED = ACC["diverted"]
ACC_PINNED = ACC["pinned"]
ACC_FELL_BACK = ACC["fell_back"]
ACC_ALL_QUEUED = ACC["fleet_all_queued"]
ACC_WAIT_KNOWN = ACC["waiting_known"]
ACC_WAIT_SUM = ACC["waiting_sum"]
ACC_WU_KNOWN = ACC["waiting_uncached_known"]
ACC_WU_SUM = ACC["waiting_uncached_sum"]
ACC_MS_KNOWN = ACC["queue_ms_known"]
ACC_COLD = ACC["cold_prefill_tokens"]
ACC_AGREE = ACC["agree"]
ACC_AGREE_KNOWN = ACC["agree_known"]
ACC_COMPARED = ACC["guard_compared"]
ACC_OVERRIDES = ACC["guard_overrides"]
ACC_EVAL = ACC["admission_evaluated"]
ACC_ADM_REJ = ACC["admission_rejected"]
ACC_GATE_REJ = ACC["gate_rejected"]
PIN = labels.SATURATION_PIN
WORKER_QUEUED = labels.CACHE_WORKER_QUEUED


@njit
def _accumulate_nb(out_i, out_f, query_blocks, sel_worker, acc, acc_ms, hist_wait, hist_div, div_bounds):
    n, n_cfg = out_i.shape[0], out_i.shape[1]
    has_sel = sel_worker.shape[0] == n
    top = hist_wait.shape[1] - 1
    for c in range(n_cfg):
        a = acc[c]
        for i in range(n):
            row = out_i[i, c]
            a[0] += 1
            w = row[kg.O_WORKER]
            if w < 0:
                a[2] += 1
                if row[kg.O_FAILURE] >= 0:
                    a[_FAIL0 + row[kg.O_FAILURE]] += 1
                continue
            a[1] += 1
            dec = row[kg.O_DECISION]
            a[_DEC0 + dec] += 1
            a[_POL0 + row[kg.O_POLICY_REASON]] += 1
            matched = row[kg.O_MATCHED]
            sel = row[kg.O_SELECTED_BLOCKS]
            a[ACC_QUERY] += max(query_blocks[i], 0)
            a[ACC_MATCHED] += matched
            a[ACC_SELECTED] += sel
            if matched > 0:
                a[ACC_OWNER_CHANCES] += 1
                if sel > 0:
                    a[ACC_OWNER_HITS] += 1
            reason = row[kg.O_REASON]
            fell = row[kg.O_FELL_BACK] == 1
            if reason == PIN:
                a[ACC_PINNED] += 1
            elif row[kg.O_GATE_REJECTED] > 0 and not fell:
                a[ACC_DIVERTED] += 1
            if fell:
                a[ACC_FELL_BACK] += 1
            if row[kg.O_ALL_QUEUED] == 1:
                a[ACC_ALL_QUEUED] += 1
            sw = row[kg.O_SEL_WAITING]
            if sw >= 0:
                a[ACC_WAIT_KNOWN] += 1
                a[ACC_WAIT_SUM] += sw
                hist_wait[c, min(sw, top)] += 1
            wu = row[kg.O_SEL_WU]
            if wu >= 0:
                a[ACC_WU_KNOWN] += 1
                a[ACC_WU_SUM] += wu
            ms = out_f[i, c]
            if not np.isnan(ms):
                a[ACC_MS_KNOWN] += 1
                acc_ms[c] += ms
            a[ACC_COLD] += row[kg.O_UNCACHED]
            if has_sel and sel_worker[i] >= 0:
                a[ACC_AGREE_KNOWN] += 1
                if sel_worker[i] == w:
                    a[ACC_AGREE] += 1
            a[ACC_COMPARED] += row[kg.O_COMPARED]
            a[ACC_OVERRIDES] += row[kg.O_OVERRIDES]
            a[ACC_EVAL] += row[kg.O_EVALUATED]
            a[ACC_ADM_REJ] += row[kg.O_ADM_REJECTED]
            a[ACC_GATE_REJ] += row[kg.O_GATE_REJECTED]
            if dec == WORKER_QUEUED:
                v = row[kg.O_BEST_REJECTED]
                b = 0
                while b < div_bounds.shape[0] and v > div_bounds[b]:
                    b += 1
                hist_div[c, b] += 1



class Accumulator:
    """Per-config running totals over chunks of decisions (exactly mergeable)."""

    def __init__(self, n_configs: int):
        self.acc = np.zeros((n_configs, N_ACC), dtype=np.int64)
        self.acc_ms = np.zeros(n_configs, dtype=np.float64)
        self.hist_wait = np.zeros((n_configs, WAIT_HIST), dtype=np.int64)
        self.hist_div = np.zeros((n_configs, N_DIV), dtype=np.int64)

    def add(self, chunk: Chunk, trace: Trace) -> None:
        sel = trace.req_selected_worker
        sel = (np.asarray(sel[chunk.start:chunk.stop], dtype=np.int64) if sel is not None
               else np.zeros(0, dtype=np.int64))
        _accumulate_nb(chunk.out_i, chunk.out_f,
                       trace.req_query_blocks[chunk.start:chunk.stop].astype(np.int64), sel,
                       self.acc, self.acc_ms, self.hist_wait, self.hist_div,
                       np.array(labels.DIVERTED_BUCKETS, dtype=np.int64))

    def merge(self, other: "Accumulator") -> None:
        """Fold another accumulator (same configs) into this one."""
        self.acc += other.acc
        self.acc_ms += other.acc_ms
        self.hist_wait += other.hist_wait
        self.hist_div += other.hist_div

    def summary(self, config_rows: list[dict], *, has_selected: bool) -> pl.DataFrame:
        """One row per config: knobs, counts, rates and pressure (see docs/outputs.md)."""
        a = self.acc
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

        def ratio(num, den):
            num = np.asarray(num, dtype=np.float64)
            den = np.asarray(den, dtype=np.float64)
            with np.errstate(invalid="ignore", divide="ignore"):
                r = num / den
            return [None if not np.isfinite(x) else float(x) for x in r]

        q = a[:, ACC_QUERY]
        cols["query_blocks"] = q
        cols["matched_blocks"] = a[:, ACC_MATCHED]
        cols["selected_blocks"] = a[:, ACC_SELECTED]
        cols["hit_rate"] = ratio(a[:, ACC_SELECTED], q)
        cols["matched_rate"] = ratio(a[:, ACC_MATCHED], q)
        cols["owner_rate"] = ratio(a[:, ACC_OWNER_HITS], a[:, ACC_OWNER_CHANCES])
        cols["diverted"] = a[:, ACC_DIVERTED]
        cols["pinned"] = a[:, ACC_PINNED]
        cols["fell_back"] = a[:, ACC_FELL_BACK]
        cols["fleet_all_queued"] = a[:, ACC_ALL_QUEUED]
        cols["selected_waiting_mean"] = ratio(a[:, ACC_WAIT_SUM], a[:, ACC_WAIT_KNOWN])
        cols["selected_waiting_p50"] = _quantiles(self.hist_wait, 0.50)
        cols["selected_waiting_p99"] = _quantiles(self.hist_wait, 0.99)
        cols["selected_waiting_max_bucket"] = [
            None if not h.any() else int(np.nonzero(h)[0][-1]) for h in self.hist_wait
        ]
        cols["selected_waiting_uncached_mean"] = ratio(a[:, ACC_WU_SUM], a[:, ACC_WU_KNOWN])
        cols["selected_queue_ms_mean"] = ratio(self.acc_ms, a[:, ACC_MS_KNOWN])
        cols["cold_prefill_tokens"] = a[:, ACC_COLD]
        cols["guard_compared"] = a[:, ACC_COMPARED]
        cols["guard_overrides"] = a[:, ACC_OVERRIDES]
        cols["admission_evaluated"] = a[:, ACC_EVAL]
        cols["admission_rejected"] = a[:, ACC_ADM_REJ]
        cols["gate_rejected"] = a[:, ACC_GATE_REJ]
        for b, bound in enumerate(labels.DIVERTED_BUCKETS):
            cols[f"diverted_overlap_le_{bound}"] = self.hist_div[:, b]
        cols["diverted_overlap_le_inf"] = self.hist_div[:, -1]
        if has_selected:
            cols["agreement"] = ratio(a[:, ACC_AGREE], a[:, ACC_AGREE_KNOWN])
            cols["agreement_requests"] = a[:, ACC_AGREE_KNOWN]
        return pl.DataFrame(cols, schema_overrides=_summary_dtypes(cols), strict=False)


_KIND_DTYPE = {"int": pl.Int64, "float": pl.Float64, "bool": pl.Boolean}
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
    out = []
    for h in hist:
        total = int(h.sum())
        if total == 0:
            out.append(None)
            continue
        rank = max(1, int(np.ceil(q * total)))
        out.append(int(np.searchsorted(np.cumsum(h), rank)))
    return out


# ---------------------------------------------------------------------------
class DecisionWriter:
    """Streams decisions to Parquet, one row group per chunk, rows (request, config)."""

    def __init__(self, path: str, trace: Trace, config_ids: list[int]):
        self.path = path
        self.trace = trace
        self.config_ids = np.asarray(config_ids, dtype=np.int32)
        self.workers = pa.array(list(trace.workers) + [None], type=pa.string())
        self.reasons = pa.array(list(labels.REASONS) + [None], type=pa.string())
        self.policy = pa.array(list(labels.POLICY_REASONS) + [None], type=pa.string())
        self.decisions = pa.array(list(labels.DECISIONS) + [None], type=pa.string())
        self.failures = pa.array(list(labels.FAILURES) + [None], type=pa.string())
        self.sources = pa.array(list(labels.PRESSURE_SOURCES) + [None], type=pa.string())
        self.writer: pq.ParquetWriter | None = None
        self.rows = 0
        self.closed = False

    @staticmethod
    def _labels(table: pa.Array, codes: np.ndarray) -> pa.Array:
        idx = np.where(codes < 0, len(table) - 1, codes).astype(np.int32)
        return table.take(pa.array(idx))

    @staticmethod
    def _nullable(values: np.ndarray) -> pa.Array:
        return pa.array(values, mask=values < 0)

    def write(self, chunk: Chunk) -> None:
        n = chunk.stop - chunk.start
        n_cfg = len(self.config_ids)
        o = chunk.out_i.reshape(n * n_cfg, kg.O_NCOLS)
        ids = self.trace.request_id[chunk.start:chunk.stop]
        rid = pa.array(ids.tolist() if ids.dtype == object else ids)
        qb = self.trace.req_query_blocks[chunk.start:chunk.stop].astype(np.int64)
        rep = np.repeat(np.arange(n, dtype=np.int32), n_cfg)
        ms = chunk.out_f.reshape(-1)
        table = pa.table({
            "request_id": rid.take(pa.array(rep)),
            "config_id": pa.array(np.tile(self.config_ids, n)),
            "worker": self._labels(self.workers, o[:, kg.O_WORKER]),
            "reason": self._labels(self.reasons, o[:, kg.O_REASON]),
            "policy_reason": self._labels(self.policy, o[:, kg.O_POLICY_REASON]),
            "decision": self._labels(self.decisions, o[:, kg.O_DECISION]),
            "failure": self._labels(self.failures, o[:, kg.O_FAILURE]),
            "query_blocks": pa.array(np.maximum(qb, 0)[rep]),
            "matched_blocks": pa.array(o[:, kg.O_MATCHED]),
            "selected_blocks": pa.array(o[:, kg.O_SELECTED_BLOCKS]),
            "uncached_tokens": self._nullable(o[:, kg.O_UNCACHED]),
            "gate_rejected": pa.array(o[:, kg.O_GATE_REJECTED].astype(np.int32)),
            "admission_evaluated": pa.array(o[:, kg.O_EVALUATED].astype(np.int32)),
            "admission_rejected": pa.array(o[:, kg.O_ADM_REJECTED].astype(np.int32)),
            "best_rejected_blocks": pa.array(o[:, kg.O_BEST_REJECTED]),
            "fleet_all_queued": pa.array(o[:, kg.O_ALL_QUEUED] == 1),
            "fell_back": pa.array(o[:, kg.O_FELL_BACK] == 1),
            "selected_waiting": self._nullable(o[:, kg.O_SEL_WAITING]),
            "selected_waiting_uncached": self._nullable(o[:, kg.O_SEL_WU]),
            "selected_queue_ms": pa.array(ms, mask=np.isnan(ms)),
            "pressure_source": self._labels(self.sources, o[:, kg.O_SOURCE]),
            "guard_compared": pa.array(o[:, kg.O_COMPARED].astype(np.int32)),
            "guard_overrides": pa.array(o[:, kg.O_OVERRIDES].astype(np.int32)),
        })
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, table.schema, compression="zstd")
        self.writer.write_table(table)
        self.rows += table.num_rows

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.writer is None:  # no requests: still leave a readable, empty file
            n_cfg = len(self.config_ids)
            self.write(Chunk(0, 0, np.zeros((0, n_cfg, kg.O_NCOLS), dtype=np.int64),
                             np.zeros((0, n_cfg), dtype=np.float64)))
        if self.writer is not None:
            self.writer.close()
            self.writer = None
