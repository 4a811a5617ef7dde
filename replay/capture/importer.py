"""``router-replay import``: what a fleet left on disk -> a replayable trace directory.

Inputs (docs/capture.md): one request source (the router's token export, a
Dynamo request trace or a Mooncake log), optionally the engines' request
exports (joined by request id for ``selected_worker``, ``output_tokens``,
``cached_tokens``, ``latency_ms``), a recorded trace set (``record``'s
``loads/``, ``kv_events/``, ``workers.parquet``) and/or polled ``/v1/loads``
lines or Prometheus scrapes.  Output: ``requests.parquet``, ``loads/``,
``workers.parquet`` and ``trace.json`` (the capture facts under
``extra.capture``), built aside and moved into place only when complete.

``matches`` come from the recorded KV events exactly as the router's indexer
answers (:mod:`.index`); without events, from the placement model (stated as
approximate in the facts); without either, empty (no prefix signal).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from replay import __version__
from replay.capture import outguard
from replay.capture.blockhash import block_hashes_csr
from replay.capture.index import EV_CODES, TIER_BITS, IndexSweep, placement_matches
from replay.capture.sources import (
    LOAD_COLUMNS,
    LOAD_TYPES,
    Facts,
    ImportError_,
    iter_token_export,
    read_dynamo,
    read_engine_export,
    read_mooncake_requests,
    read_prometheus,
    read_v1_loads,
)
from replay.config import ConfigError, knob_spec, validate_router_flags
from replay.errors import ParamsError
from replay.runs import names, rundir
from replay.trace.blocks import conform_blocks

NS = 1_000_000_000
MS = 1_000_000
MATCHES_EVENTS = "kv_events"
MATCHES_PLACEMENT = "placement model (approximate)"
MATCHES_NONE = "none (no prefix signal)"


@dataclass
class ImportSpec:
    out: Path
    token_export: list = field(default_factory=list)
    dynamo: list = field(default_factory=list)
    mooncake: list = field(default_factory=list)
    engine_exports: list = field(default_factory=list)      # [(url, path)]
    recorded: Path | None = None
    v1_loads: list = field(default_factory=list)            # [(url, path)]
    prometheus: list = field(default_factory=list)          # [(url, path)]
    page_size: int | None = None
    index_lag_ms: float = 0.0
    matches: str = "auto"                                   # auto | events | placement | none
    kv_capacity_tokens: int | None = None
    dynamo_workers: dict = field(default_factory=dict)      # prefill_worker_id -> URL
    mooncake_start_ns: int = 1_767_225_600 * NS
    mooncake_block_size: int = 512
    skip_bad_lines: bool = False
    router_inflight: str = "none"                           # none | derived
    router_flags: dict | None = None                        # production router flags (knob -> value)
    kv_format: str | None = None                            # default | dynamo (else: record.json's)
    force: bool = False

    def inputs(self) -> list[Path]:
        out = [*map(Path, self.token_export), *map(Path, self.dynamo), *map(Path, self.mooncake)]
        out += [Path(p) for _, p in (*self.engine_exports, *self.v1_loads, *self.prometheus)]
        if self.recorded is not None:
            out.append(Path(self.recorded))
        return out


@dataclass
class ImportResult:
    out: Path
    facts: dict
    warnings: list


def _hash_requests(f: Path, df: pl.DataFrame, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR block hashes of every request's ``input_ids`` (cache salt honoured)."""
    ids = df["input_ids"]
    lens = ids.list.len().to_numpy().astype(np.int64)
    # the list values as one array, without Series.explode's copy (an empty list holds no value)
    arr = ids.rechunk().to_arrow()
    flat = (arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr).flatten().to_numpy(
        zero_copy_only=False).astype(np.int64, copy=False) if lens.sum() else np.zeros(0, np.int64)
    tok_off = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=tok_off[1:])
    if flat.size and (flat.min() < 0 or flat.max() > 0xFFFFFFFF):
        bad = int(np.nonzero((flat < 0) | (flat > 0xFFFFFFFF))[0][0])
        row = int(np.searchsorted(tok_off, bad, side="right") - 1)
        raise ImportError_(f"{f}: request {df['request_id'][row]!r}: input_ids holds {int(flat[bad])}, "
                           "not an unsigned 32-bit token id")
    salts = df["cache_salt"].to_list() if df["cache_salt"].drop_nulls().len() else None
    return block_hashes_csr(flat, tok_off, page_size, salts)


def csr_take(off: np.ndarray, vals: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``idx`` (in that order) of the CSR ``(off, vals)``."""
    sizes = np.diff(off)[idx]
    starts = off[:-1][idx]
    noff = np.zeros(len(idx) + 1, dtype=np.int64)
    np.cumsum(sizes, out=noff[1:])
    return noff, vals[np.repeat(starts - noff[:-1], sizes) + np.arange(noff[-1])]


def csr_concat(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    offs, vals, base = [np.zeros(1, dtype=np.int64)], [], 0
    for off, v in parts:
        offs.append(off[1:] + base)
        vals.append(v)
        base += int(off[-1])
    return np.concatenate(offs), (np.concatenate(vals) if vals else np.zeros(0, np.int64))


def _csr(lists: pl.Series) -> tuple[np.ndarray, np.ndarray]:
    lens = lists.list.len().fill_null(0).to_numpy().astype(np.int64)
    off = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    flat = lists.explode().drop_nulls().to_numpy().astype(np.int64) if off[-1] else np.zeros(0, np.int64)
    return off, flat


def _read_table_dir(d: Path, columns=None) -> list[tuple[Path, pa.Table]]:
    out: list[tuple[Path, pa.Table]] = []
    if not d.is_dir():
        return out
    for p in sorted(d.rglob("*.parquet")):
        if any(part.startswith((".", "_")) for part in p.relative_to(d).parts):
            continue
        try:
            t = pq.read_table(p, columns=columns, partitioning=None)
        except Exception as err:  # noqa: BLE001 - one line for the user
            raise ImportError_(f"{p}: unreadable Parquet ({type(err).__name__}: {str(err).splitlines()[0]})") from None
        out.append((p, t))
    return out


class Importer:
    def __init__(self, spec: ImportSpec, progress=None):
        self.s = spec
        self.progress = progress
        self.facts = Facts(skip_bad_lines=spec.skip_bad_lines)
        self.kv_format = spec.kv_format
        self.router_flags = dict(spec.router_flags or {})
        self.wide_events = 0
        self.wide_from: int | None = None
        self.salted = np.zeros(0, dtype=bool)

    # ------------------------------------------------------------ recorded set
    def _recorded(self):
        rec = Path(self.s.recorded) if self.s.recorded is not None else None
        self.rec_workers = None
        self.rec_facts = {}
        self.kv_uncertain_from: int | None = None
        if rec is None:
            return
        if not rec.is_dir():
            raise ImportError_(f"{rec}: not a folder (expected record's output)")
        if (rec / names.RECORD_JSON).is_file():
            try:
                self.rec_facts = json.loads((rec / names.RECORD_JSON).read_text())
            except ValueError:
                raise ImportError_(f"{rec / names.RECORD_JSON}: not JSON") from None
        if (rec / names.WORKERS).is_file():
            self.rec_workers = pl.read_parquet(rec / names.WORKERS)
        f = self.facts.data
        rf = self.rec_facts
        if self.s.kv_format is None and rf.get("kv_format") in ("default", "dynamo"):
            self.kv_format = rf["kv_format"]
        if not self.s.router_flags and isinstance(rf.get("router"), dict):
            self.router_flags = _checked_flags(rf["router"], rec / names.RECORD_JSON)
        f["recorded"] = {"complete": rf.get("complete"), "gaps": rf.get("gaps"), "restarts": rf.get("restarts"),
                         "malformed_frames": rf.get("malformed_frames"), "unreachable": rf.get("unreachable"),
                         "silent_streams": rf.get("silent_streams")}
        if rf and not rf.get("complete"):
            self.facts.warnings.append(f"{rec}: record.json says the recording did not finish cleanly "
                                       "(killed?): at most its last flush interval is missing")
        gaps = _read_table_dir(rec / names.GAPS_DIR)
        if gaps:
            g = pl.concat([pl.from_arrow(t) for _, t in gaps], how="vertical_relaxed")
            kinds = g.group_by("stream", "kind").len().sort("stream", "kind")
            f["recorded"]["gap_rows"] = {f"{r['stream']} {r['kind']}": r["len"] for r in kinds.iter_rows(named=True)}
            lost = g.filter(pl.col("kind").is_in(["gap", "malformed"]) & (pl.col("stream") == "kv"))
            if lost.height:
                # from then on, some rank's KV state is unknown (until nothing: a later clear would
                # settle it, but the importer does not claim that)
                self.kv_uncertain_from = int(lost.select(pl.coalesce("from_ts", "ts").min()).item())
            if lost.height:
                f["recorded"]["kv_gap_examples"] = [
                    {k: r[k] for k in ("worker", "dp_rank", "from_seq", "to_seq", "from_ts", "to_ts", "reason")}
                    for r in lost.head(5).iter_rows(named=True)]
                self.facts.warnings.append(
                    f"{lost.height} KV-event gaps could not be recovered: the rebuilt matches may miss or keep "
                    "blocks of those ranks after them (trace.json extra.capture.recorded)")

    # ------------------------------------------------------------ requests
    def _page_size(self) -> int | None:
        if self.s.page_size:
            return int(self.s.page_size)
        if self.rec_workers is not None and "page_size" in self.rec_workers.columns:
            sizes = self.rec_workers["page_size"].drop_nulls().unique().to_list()
            if len(sizes) > 1:
                raise ParamsError("{where}: workers disagree on page_size ({sizes}); give {page_size}", "page_size",
                                  where=Path(self.s.recorded) / names.WORKERS, sizes=sorted(sizes))
            if sizes:
                return int(sizes[0])
        return None

    def _requests(self) -> pl.DataFrame:
        s = self.s
        given = [n for n, v in (("--token-export", s.token_export), ("--dynamo-trace", s.dynamo),
                                ("--mooncake", s.mooncake)) if v]
        if len(given) != 1:
            named = [f"{{{p}}}" for p, v in (("token_export", s.token_export), ("dynamo", s.dynamo),
                                             ("mooncake", s.mooncake)) if v]
            raise ParamsError("give exactly one request source: {token_export}, {dynamo} or {mooncake}"
                              + (f" (got {', '.join(named)})" if named else ""),
                              "token_export", ("dynamo", "--dynamo-trace"), "mooncake")
        self.source = given[0]
        f = self.facts.data
        if s.token_export:
            self.page = self._page_size()
            if self.page is None:
                raise ParamsError("the token export needs the engines' page_size: record's {workers} has none; "
                                  "give {page_size}", "page_size", workers=names.WORKERS)
            frames, hashes = [], []
            n_files = None
            for k, (path, df) in enumerate(iter_token_export(s.token_export, self.facts)):
                # one file at a time: its token ids are dropped once hashed
                n_files = n_files or self.facts.data["token_export_files"]
                hashes.append(_hash_requests(path, df, self.page))
                frames.append(df.select("ts", "request_id", pl.col("model").fill_null("default"),
                                        pl.col("input_ids").list.len().cast(pl.Int64).alias("input_tokens"),
                                        "output_tokens",
                                        (pl.col("cache_salt").fill_null("") != "").alias("_salted")))
                if self.progress is not None:
                    self.progress("hashing token export files", k + 1, n_files)
            req = pl.concat(frames)
            off, hv = csr_concat(hashes)
            req, off, hv = self._dedupe(req, off, hv)
            self.hash_kind = "sglang"
            f["requests_source"] = "router token export"
        elif s.dynamo:
            df, block = read_dynamo(s.dynamo, self.facts, s.dynamo_workers)
            self.page = int(s.page_size or block or 0) or None
            off, hv = self._block_rule(df, *_csr(df["hash_ids"]), "Dynamo request trace: request_end record")
            df, off, hv = self._dedupe(df, off, hv)
            self.hash_kind = "dynamo"
            over = (df["cached_tokens"] > df["input_tokens"]).fill_null(False)
            if over.any():
                f["cached_tokens_clipped_to_input_tokens"] = int(over.sum())
            req = df.select("ts", "request_id", pl.lit("default").alias("model"), "input_tokens", "output_tokens",
                            _clip_cached(),
                            "ttft_ms", "latency_ms", "selected_worker")
            f["requests_source"] = "Dynamo request trace (hash_ids are Dynamo's sequence hashes, not SGLang's)"
        else:
            df = read_mooncake_requests(s.mooncake, self.facts, s.mooncake_start_ns)
            self.page = int(s.page_size or s.mooncake_block_size)
            off, hv = self._block_rule(df, *_csr(df["hash_ids"]), "Mooncake log: record")
            df, off, hv = self._dedupe(df, off, hv)
            self.hash_kind = "mooncake"
            req = df.select("ts", "request_id", pl.lit("default").alias("model"), "input_tokens", "output_tokens")
            f["requests_source"] = "Mooncake log (hash_ids are the log's remapped block ids; no worker, no loads)"
        if req.height == 0:     # a trace of no requests replays nothing: never a silent empty import
            src = s.token_export or s.dynamo or s.mooncake
            raise ImportError_(f"{', '.join(str(x) for x in src)}: no requests ({given[0]}); nothing was written")
        # time order (stable), hashes permuted along
        order = np.argsort(req["ts"].to_numpy(), kind="stable")
        if np.any(order != np.arange(len(order))):
            off, hv = csr_take(off, hv, order)
            req = req[order]
        self.h_off, self.h_val = off, hv
        if "_salted" in req.columns:
            self.salted = req["_salted"].to_numpy()
            req = req.drop("_salted")
        else:
            self.salted = np.zeros(req.height, dtype=bool)
        f["requests"] = req.height
        return req

    def _block_rule(self, df: pl.DataFrame, off: np.ndarray, hv: np.ndarray, what: str):
        """The block-count rule (replay.trace.blocks) on a log's own hash_ids, where the page is known:
        full-blocks-only lists get a fresh partial-block id, any other length is refused here."""
        if not self.page:
            return off, hv
        off, hv, counts = conform_blocks(off, hv, df["input_tokens"].to_numpy(), self.page,
                                         known=df["hash_ids"].is_not_null().to_numpy())
        if counts.bad is not None:
            raise ImportError_(f"{what} {counts.bad}: hash_ids {counts.message}")
        if counts.n_full_only:
            self.facts.add("hash_ids_full_blocks_only", counts.n_full_only)
        return off, hv

    def _dedupe(self, df: pl.DataFrame, off: np.ndarray, hv: np.ndarray):
        dup = df["request_id"].is_duplicated() & ~df["request_id"].is_first_distinct()
        if dup.any():
            self.facts.add("duplicate_request_records_dropped", int(dup.sum()))
            self.facts.data["duplicate_request_id_examples"] = df["request_id"].filter(dup).head(5).to_list()
            self.facts.warnings.append(f"{int(dup.sum())} request records repeat an earlier request_id "
                                       "(n > 1 choices or retries): the first is kept")
            keep = np.nonzero(~dup.to_numpy())[0]
            df = df[keep]
            off, hv = csr_take(off, hv, keep)
        return df, off, hv

    # ------------------------------------------------------------ engine join
    def _join_engines(self, req: pl.DataFrame) -> pl.DataFrame:
        f = self.facts.data
        if not self.s.engine_exports:
            if "selected_worker" not in req.columns:
                req = req.with_columns(pl.lit(None, dtype=pl.String).alias("selected_worker"))
            return req
        by_url: dict[str, list] = {}
        for url, p in self.s.engine_exports:
            by_url.setdefault(url, []).append(p)
        eng = pl.concat([read_engine_export(u, ps, self.facts) for u, ps in sorted(by_url.items())])
        f["engine_records"] = eng.height
        twice = eng["id"].is_duplicated()
        if twice.any():
            n = eng.filter(twice)["id"].n_unique()
            f["engine_records_ambiguous_ids"] = n
            self.facts.warnings.append(f"{n} request ids appear in more than one engine record: the first "
                                       "(URL order, then file order) is used")
            eng = eng.filter(eng["id"].is_first_distinct())
        ids = set(req["request_id"].cast(pl.String).to_list())
        orphan = eng.filter(~pl.col("id").is_in(list(ids)))
        f["engine_records_without_router_record"] = orphan.height
        if orphan.height:
            self.facts.data["engine_records_without_router_record_examples"] = orphan["id"].head(5).to_list()
        joined = req.with_columns(pl.col("request_id").cast(pl.String).alias("_rid")).join(
            eng, left_on="_rid", right_on="id", how="left", maintain_order="left")
        missing = int(joined["engine_worker"].is_null().sum())
        f["requests_without_engine_record"] = missing
        over = (joined["cached_tokens"] > joined["input_tokens"]).fill_null(False)
        if over.any():
            f["cached_tokens_clipped_to_input_tokens"] = int(over.sum())
        mism = (joined["prompt_tokens"] != joined["input_tokens"]).fill_null(False)
        if mism.any():
            f["engine_prompt_tokens_differ_from_input_ids"] = int(mism.sum())
        # the engine's completion count wins over the router's own output_tokens field
        req = joined.select(
            "ts", "request_id", "model", "input_tokens",
            pl.coalesce("completion_tokens", "output_tokens").alias("output_tokens"),
            _clip_cached(),
            (pl.col("e2e_latency") * 1000.0).alias("latency_ms"),
            pl.col("engine_worker").alias("selected_worker"))
        if missing or orphan.height:
            self.facts.warnings.append(
                f"engine join: {missing:,} of {req.height:,} requests have no engine record (selected_worker "
                f"null), {orphan.height:,} engine records have no router record (not in the trace)")
        return req

    # ------------------------------------------------------------ workers
    def _workers(self, req: pl.DataFrame, load_workers: set[str]) -> pl.DataFrame:
        names = set(load_workers)
        dp, page, model_of = {}, {}, {}
        if self.rec_workers is not None:
            for r in self.rec_workers.iter_rows(named=True):
                names.add(r["worker"])
                dp[r["worker"]] = r.get("dp_size")
                page[r["worker"]] = r.get("page_size")
                model_of[r["worker"]] = r.get("model")
        names |= {u for u, _ in self.s.engine_exports}
        names |= set(self.s.dynamo_workers.values())
        sel = set(req["selected_worker"].drop_nulls().unique().to_list())
        unknown = sorted(sel - names)
        f = self.facts.data
        if unknown:
            f["selected_workers_not_in_fleet"] = unknown[:10]
            n = int(req["selected_worker"].is_in(unknown).sum())
            f["requests_whose_worker_is_unknown"] = n
            self.facts.warnings.append(f"{n:,} requests name a worker no recording or export lists "
                                       f"({', '.join(unknown[:3])}): it is not a fleet member")
        models = sorted(req["model"].unique().to_list())
        urls = sorted(names)
        wm = []
        for u in urls:
            # REPLAY CHOICE: the engine's served model name need not equal the
            # router's model id; with one model in the requests, every worker
            # serves it; with several, a worker must name one of them.
            if len(models) <= 1:
                wm.append(models[0] if models else "default")
            elif model_of.get(u) in models:
                wm.append(model_of[u])
            else:
                raise ImportError_(f"worker {u}: serves model {model_of.get(u)!r}, not one of the requests' "
                                   f"models {models}; the fleet of each model cannot be told")
        pages = [page.get(u) if page.get(u) is not None else self.page for u in urls]
        if self.hash_kind != "sglang":
            pages = [None] * len(urls)
        return pl.DataFrame({"worker": urls, "model": wm, "role": ["plain"] * len(urls),
                             "dp_size": [dp.get(u) for u in urls], "page_size": pages},
                            schema={"worker": pl.String, "model": pl.String, "role": pl.String,
                                    "dp_size": pl.Int64, "page_size": pl.Int64})

    # ------------------------------------------------------------ loads
    def _inflight_fn(self, req: pl.DataFrame):
        """``router_inflight`` derived from the served requests: per worker, requests that
        arrived before the sample minus those completed at or before it.

        REPLAY CHOICE: the router's in-flight count is not on any wire; for a fleet
        behind one router replica it is exactly this count (dispatch at arrival,
        release at completion = arrival + latency).  Behind several replicas each
        one knows only its own share, so the derived count overstates it: off by
        default (``--router-inflight derived`` turns it on).
        """
        if self.s.router_inflight != "derived":
            return None
        if "latency_ms" not in req.columns:
            raise ParamsError("{router_inflight:derived} needs each served request's latency (engine exports)",
                              "router_inflight")
        served = req.filter(pl.col("selected_worker").is_not_null())
        if served["latency_ms"].null_count():
            raise ParamsError("{router_inflight:derived}: {n} served requests have no latency", "router_inflight",
                              n=served["latency_ms"].null_count())
        done = served["ts"] + (served["latency_ms"] * 1e6).round().cast(pl.Int64)
        per = {}
        for (url,), g in served.with_columns(done.alias("_done")).group_by("selected_worker"):
            per[url] = (np.sort(g["ts"].to_numpy()), np.sort(g["_done"].to_numpy()))
        self.facts.data["router_inflight"] = "derived from dispatch (arrival) and completion (arrival + latency)"
        empty = np.zeros(0, dtype=np.int64)

        def fn(t: pl.DataFrame) -> pa.Array:
            ts = t["ts"].to_numpy()
            out = np.zeros(len(ts), dtype=np.int64)
            wk = t["worker"].to_numpy()
            for url in np.unique(wk):
                m = wk == url
                arr, dn = per.get(url, (empty, empty))
                out[m] = np.searchsorted(arr, ts[m], "left") - np.searchsorted(dn, ts[m], "right")
            return pa.array(out, type=pa.int64())

        return fn

    def _loads(self, tmp: Path, req: pl.DataFrame) -> set[str]:
        """Copy the recorded loads (file by file: bounded memory) and write polled ones."""
        inflight = self._inflight_fn(req)
        dest = tmp / names.LOADS_DIR
        dest.mkdir()
        workers: set[str] = set()
        rows = 0
        self.load_caps: dict[str, int] = {}
        self.max_rank: dict[str, int] = {}

        def note(t: pl.DataFrame):
            nonlocal rows
            rows += t.height
            g = t.group_by("worker").agg(pl.col("dp_rank").max().alias("r"),
                                         pl.col("max_total_num_tokens").max().alias("cap"))
            for r in g.iter_rows(named=True):
                workers.add(r["worker"])
                self.max_rank[r["worker"]] = max(self.max_rank.get(r["worker"], 0), int(r["r"] or 0))
                self.load_caps[r["worker"]] = max(self.load_caps.get(r["worker"], 0), int(r["cap"] or 0))

        sources = []
        if self.s.recorded is not None:
            rec = Path(self.s.recorded) / names.LOADS_DIR
            for p, t in _read_table_dir(rec):
                cols = [c for c in LOAD_COLUMNS if c in t.column_names]
                t = t.select(cols)
                if inflight is not None:
                    t = t.append_column("router_inflight", inflight(pl.from_arrow(t)))
                rel = p.relative_to(rec)
                (dest / rel.parent).mkdir(parents=True, exist_ok=True)
                pq.write_table(t, dest / rel, compression="zstd")
                note(pl.from_arrow(t))
            if rows:
                sources.append("record (LoadStat PUB stream, receive-stamped)")
        polled = []
        for url, p in self.s.v1_loads:
            polled.append(read_v1_loads(url, Path(p), self.facts))
        if self.s.v1_loads:
            sources.append("polled /v1/loads (coarser than the PUB stream)")
        for url, p in self.s.prometheus:
            polled.append(read_prometheus(url, Path(p), self.facts))
        if self.s.prometheus:
            sources.append("Prometheus scrapes (coarser: no native tail, no uncached-token queue; "
                           "max_total_num_tokens from token_usage)")
        if polled:
            t = pl.concat(polled).sort("ts", maintain_order=True)
            at = t.to_arrow()
            if inflight is not None:
                at = at.append_column("router_inflight", inflight(t))
            pq.write_table(at, dest / "polled.parquet", compression="zstd")
            note(t)
        if not rows:
            empty = pl.DataFrame(schema=LOAD_TYPES)
            pq.write_table(empty.to_arrow(), dest / "empty.parquet")
            self.facts.warnings.append("no load source (--recorded with loads/, --v1-loads or --prometheus): "
                                       "the trace has no load samples, so every worker reads as unknown")
        self.facts.data["load_rows"] = rows
        self.facts.data["loads_source"] = sources or ["none"]
        return workers

    # ------------------------------------------------------------ matches
    def _kv_parts(self) -> list[Path]:
        rec = Path(self.s.recorded) / names.KV_EVENTS_DIR if self.s.recorded is not None else None
        if rec is None or not rec.is_dir():
            return []
        return [p for p in sorted(rec.rglob("*.parquet"))
                if not any(part.startswith((".", "_")) for part in p.relative_to(rec).parts)]

    def _read_part(self, p: Path, columns: list[str]) -> pl.DataFrame:
        try:
            return pl.from_arrow(pq.read_table(p, columns=columns, partitioning=None))
        except Exception as err:  # noqa: BLE001 - one line for the user
            raise ImportError_(f"{p}: unreadable Parquet ({type(err).__name__}: {str(err).splitlines()[0]})") from None

    def _event_plan(self, parts: list[Path], urls: list[str], dp: np.ndarray):
        """First pass over the KV-event parts, two columns at a time: each part's earliest
        ``ts`` (the order and horizons of the second pass) and the ranks each worker publishes."""
        wid = {u: i for i, u in enumerate(urls)}
        need = dp.copy()
        starts, rows = [], 0
        for p in parts:
            t = self._read_part(p, ["ts", "worker", "dp_rank"])
            rows += t.height
            starts.append(int(t["ts"].min()) if t.height else None)
            for u, r in t.group_by("worker").agg(pl.col("dp_rank").max()).iter_rows():
                if u not in wid:
                    raise ImportError_(f"{p}: column 'worker': events of a worker not in the fleet table: {u}")
                need[wid[u]] = max(need[wid[u]], int(r) + 1)
        rank_off = np.zeros(len(urls) + 1, dtype=np.int64)
        np.cumsum(need, out=rank_off[1:])
        keep = [(s, k) for k, s in enumerate(starts) if s is not None]
        keep.sort()
        return [parts[k] for _, k in keep], [s for s, _ in keep], rank_off, rows, wid

    def _part_events(self, p: Path, wid: dict, rank_off: np.ndarray, uniq: np.ndarray) -> np.ndarray:
        """One part's events as a (8, n) int64 array: ts, worker, rank, seq, index (the sort
        keys), then global rank, kind, tier, dense block (-1: no request holds it)."""
        names = set(pq.read_schema(p).names)
        extra = [c for c in ("lora_name", "wide_tokens") if c in names]
        ev = self._read_part(p, ["ts", "worker", "dp_rank", "seq", "event_index", "type", "block_hashes", "medium",
                                 "lora_id", "block_size", *extra])
        for col in ("lora_id", "lora_name"):
            if col in ev.columns and ev[col].drop_nulls().len():
                raise ImportError_(f"{p}: column {col!r}: BlockStored events name a LoRA adapter: LoRA changes the "
                                   "block hash and is out of scope")
        if "wide_tokens" in ev.columns:
            wide = ev.filter(pl.col("wide_tokens").fill_null(False))
            if wide.height:
                self.wide_events += wide.height
                t0 = int(wide["ts"].min())
                self.wide_from = t0 if self.wide_from is None else min(self.wide_from, t0)
        sizes = ev.filter(pl.col("type") == "BlockStored")["block_size"].drop_nulls().unique().to_list()
        bad = [b for b in sizes if b != self.page]
        if bad:
            raise ImportError_(f"{p}: column 'block_size': events of block size {bad[0]}, but requests are "
                               f"hashed with page_size {self.page}")
        # the string columns coded per event, before a row per hash is made
        ex = ev.select(pl.col("worker").replace_strict(wid, return_dtype=pl.Int64).alias("w"),
                       "ts", "dp_rank", "seq", "event_index", "block_hashes",
                       pl.col("type").replace_strict(EV_CODES, return_dtype=pl.Int64).alias("kind"),
                       pl.col("medium").replace_strict(TIER_BITS, default=0, return_dtype=pl.Int64).fill_null(0)
                       .alias("tier")).explode("block_hashes")
        w = ex["w"].to_numpy()
        rank = ex["dp_rank"].to_numpy().astype(np.int64)
        h = ex["block_hashes"].fill_null(0).to_numpy().astype(np.int64)
        pos = np.searchsorted(uniq, h)
        pos_c = np.minimum(pos, max(len(uniq) - 1, 0))
        dense = np.where((pos < len(uniq)) & (uniq[pos_c] == h), pos_c, -1) if len(uniq) else np.full(len(h), -1)
        return np.stack([ex["ts"].to_numpy().astype(np.int64), w, rank, ex["seq"].to_numpy().astype(np.int64),
                         ex["event_index"].cast(pl.Int64).to_numpy(), rank_off[w] + rank,
                         ex["kind"].to_numpy(), ex["tier"].to_numpy(), dense.astype(np.int64)])

    def _matches_from_events(self, parts, urls, dp, ts):
        """The indexer replayed part by part (bounded by a part plus the events not yet due):
        parts in order of their earliest event; after reading one, every event earlier than
        the next part's earliest is known, so the requests that can only see those are answered."""
        order, starts, rank_off, rows, wid = self._event_plan(parts, urls, dp)
        if rows == 0:
            return None
        if self.kv_format == "dynamo":
            raise ParamsError("{rec}: the fleet publishes KV events in the dynamo format (hashes namespaced by "
                              "extra_key and cache salt), which the importer does not rebuild; use {matches:placement} "
                              "or none", "matches", rec=self.s.recorded)
        self.wide_events, self.wide_from = 0, None
        uniq, dense = np.unique(self.h_val, return_inverse=True)
        dense = dense.astype(np.int64).reshape(-1)
        lag = int(round(self.s.index_lag_ms * MS))
        sweep = IndexSweep(int(rank_off[-1]), len(uniq), rank_off, ts, self.h_off, dense, lag)
        buf = np.zeros((9, 0), dtype=np.int64)
        seen_by = ts - lag           # a request sees the events stamped at or before this
        for k, p in enumerate(order):
            buf = np.concatenate([buf, self._part_events(p, wid, rank_off, uniq)], axis=1)
            buf = buf[:, np.lexsort(buf[4::-1])]          # by ts, worker, rank, seq, event index
            horizon = starts[k + 1] if k + 1 < len(order) else None
            upto = len(ts) if horizon is None else int(np.searchsorted(seen_by, horizon, "left"))
            due = buf.shape[1] if horizon is None else int(np.searchsorted(buf[0], horizon, "left"))
            used = sweep.run(tuple(np.ascontiguousarray(buf[r, :due]) for r in (0, 5, 6, 7, 8)), upto)
            buf = buf[:, used:]
            if self.progress is not None:
                self.progress("replaying KV events", k + 1, len(order))
        self.facts.data["kv_events"] = rows
        return sweep.result()

    def _matches(self, req: pl.DataFrame, workers: pl.DataFrame):
        urls = workers["worker"].to_list()
        f = self.facts.data
        dp = np.array([max(int(d or 0), self.max_rank.get(u, -1) + 1, 1)
                       for u, d in zip(urls, workers["dp_size"].to_list(), strict=True)], dtype=np.int64)
        mode = self.s.matches
        ts = req["ts"].to_numpy().astype(np.int64)
        res = None
        if mode in ("auto", "events") and self.hash_kind == "sglang":
            res = self._matches_from_events(self._kv_parts(), urls, dp, ts)
        if mode == "events" and res is None:
            raise ParamsError("{matches:events}: no recorded KV event (give {recorded} with kv_events/, and a "
                              "token export)", "matches", "recorded")
        if res is not None:
            m_off, m_w, m_b = res
            f["matches_source"] = MATCHES_EVENTS
            f["index_lag_ms"] = self.s.index_lag_ms
            self._exactness(ts)
        elif mode in ("auto", "placement") and req["selected_worker"].drop_nulls().len():
            wid = {u: i for i, u in enumerate(urls)}
            worker = np.array([wid.get(x, -1) if x is not None else -1 for x in req["selected_worker"].to_list()],
                              dtype=np.int64)
            lat = req["latency_ms"].to_numpy() if "latency_ms" in req.columns else np.full(len(ts), np.nan)
            done = np.where(np.isfinite(lat), ts + np.nan_to_num(lat * MS).astype(np.int64), ts)
            done = np.maximum(done, ts + 1)   # a request never matches its own blocks
            cap_tok = np.array([self.s.kv_capacity_tokens or self.load_caps.get(u, 0) * int(d)
                                for u, d in zip(urls, dp, strict=True)], dtype=np.int64)
            if not np.all(cap_tok[np.unique(worker[worker >= 0])] > 0):
                raise ParamsError("the placement model needs each serving worker's KV capacity: the loads have no "
                                  "max_total_num_tokens; give {kv_capacity_tokens}", "kv_capacity_tokens")
            page = self.page or 1
            cap_blocks = cap_tok // page
            m_off, m_w, m_b = placement_matches(ts, done, self.h_off, self.h_val, worker, cap_blocks)
            f["matches_source"] = MATCHES_PLACEMENT
            f["matches_exact"] = False
            f["placement_model"] = ("each worker holds the blocks of the requests it served from their "
                                    "completion (arrival + latency_ms, else arrival) on, least recently used "
                                    "evicted beyond its KV capacity (max_total_num_tokens summed over ranks, or "
                                    "--kv-capacity-tokens) in blocks of page_size")
            self.facts.warnings.append("matches come from the placement model, not from KV events: approximate")
        else:
            m_off = np.zeros(len(ts) + 1, dtype=np.int64)
            m_w = m_b = np.zeros(0, dtype=np.int64)
            f["matches_source"] = MATCHES_NONE
            f["matches_exact"] = False
            self.facts.warnings.append("no KV events and no served worker: matches are empty (no prefix signal)")
        # decoded from a dictionary in C++: millions of Python strings would dominate
        wcol = pa.DictionaryArray.from_arrays(pa.array(m_w.astype(np.int32)),
                                              pa.array(urls, type=pa.string())).dictionary_decode()
        struct = pa.StructArray.from_arrays([wcol, pa.array(m_b, type=pa.int64())], names=["worker", "blocks"])
        return pa.ListArray.from_arrays(pa.array(m_off, type=pa.int32()), struct), m_off, m_b

    def _exactness(self, ts: np.ndarray) -> None:
        """``matches_exact`` only when every KV gap was recovered and nothing made a hash
        uncertain; otherwise what is approximate, and for how many requests."""
        f = self.facts.data
        reasons, hit = [], np.zeros(len(ts), dtype=bool)
        if self.kv_uncertain_from is not None:
            m = ts >= self.kv_uncertain_from
            hit |= m
            reasons.append(f"KV-event gaps the replay sockets no longer held: requests from the first one on "
                           f"({int(m.sum()):,}) may be answered with blocks missing or kept")
        if self.salted.any() and self.kv_format != "default":
            hit |= self.salted
            reasons.append(f"{int(self.salted.sum()):,} requests carry a cache salt and the fleet's KV-event "
                           "format is unknown (--kv-format default|dynamo): under dynamo their published "
                           "hashes are namespaced differently")
        if self.wide_events:
            m = ts >= self.wide_from
            hit |= m
            reasons.append(f"{self.wide_events:,} BlockStored events carry token ids above 2**32 - 1 or bigram "
                           "pairs (hashed in another form): their blocks never match the requests' hashes")
        f["matches_exact"] = not reasons
        if reasons:
            f["matches_approximate"] = {"requests": int(hit.sum()), "reasons": reasons}
            self.facts.warnings.append(f"matches are approximate for {int(hit.sum()):,} requests: "
                                       + "; ".join(reasons))

    # ------------------------------------------------------------ run
    def run(self) -> ImportResult:
        s = self.s
        out = Path(s.out)
        rundir.guard([(out, outguard.IMPORTED)], s.inputs(), force=s.force)
        self._recorded()
        req = self._requests()
        req = self._join_engines(req)
        tmp = rundir.partial_beside(out)
        try:
            load_workers = self._loads(tmp, req)
            workers = self._workers(req, load_workers)
            matches, m_off, m_b = self._matches(req, workers)
            qb = np.diff(self.h_off)
            best = np.zeros(len(qb), dtype=np.int64)
            if m_b.size:
                nz = np.diff(m_off) > 0
                best[nz] = np.maximum.reduceat(m_b, m_off[:-1][nz])
            cols = {
                "ts": pa.array(req["ts"].to_numpy(), type=pa.int64()),
                "request_id": req["request_id"].to_arrow(),
                "model": req["model"].to_arrow(),
                "input_tokens": pa.array(req["input_tokens"].to_numpy(), type=pa.int64()),
                "query_blocks": pa.array(qb, type=pa.int64()),
                "matches": matches,
                "best_prefix_blocks": pa.array(best, type=pa.int64()),
                "selected_worker": req["selected_worker"].to_arrow(),
                "hash_ids": pa.ListArray.from_arrays(pa.array(self.h_off, type=pa.int64()),
                                                     pa.array(self.h_val, type=pa.int64())),
            }
            for c, t in (("output_tokens", pa.int64()), ("cached_tokens", pa.int64()), ("ttft_ms", pa.float64()),
                         ("latency_ms", pa.float64())):
                if c in req.columns:
                    cols[c] = req[c].cast(pl.Int64 if t == pa.int64() else pl.Float64).to_arrow()
            pq.write_table(pa.table(cols), tmp / names.REQUESTS, compression="zstd")
            pq.write_table(workers.to_arrow(), tmp / names.WORKERS, compression="zstd")
            self.facts.data["workers"] = workers.height
            if self.hash_kind != "sglang":
                self.facts.data["hash_ids_note"] = ("hash_ids are the request source's own block ids; they "
                                                    "cannot be matched against SGLang KV events")
            info: dict[str, Any] = {
                "source": f"router-replay import {__version__}: {self.facts.data['requests_source']}",
                    "extra": {"capture": _jsonable(self.facts.data), "warnings": self.facts.warnings}}
            if self.page:
                info["page_size"] = int(self.page)
            if self.router_flags:
                info["router"] = dict(self.router_flags)
            (tmp / names.TRACE_JSON).write_text(json.dumps(info, indent=2) + "\n")
            rundir.move_into_place(tmp, out)
        except OSError as err:
            why = os.strerror(err.errno) if err.errno else str(err).splitlines()[0]
            raise ImportError_(f"{out}: cannot write ({why}); nothing was written") from None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return ImportResult(out, self.facts.data, self.facts.warnings)


def _checked_flags(flags: dict, where: Path) -> dict:
    """Router flags as record.json keeps them (knob -> value), checked like the router's CLI."""
    try:
        out = {knob_spec(k).name: v for k, v in flags.items()}
        validate_router_flags(out)
    except ConfigError as err:
        raise ImportError_(f"{where}: key 'router': {err}") from None
    return out


def _clip_cached() -> pl.Expr:
    """``cached_tokens`` capped at ``input_tokens`` (null stays null: min_horizontal skips nulls)."""
    c = pl.col("cached_tokens")
    return pl.when(c.is_null()).then(None).otherwise(pl.min_horizontal(c, "input_tokens")).alias("cached_tokens")


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        return float(v) if math.isfinite(v) else None
    return v


def import_capture(spec: ImportSpec, progress=None) -> ImportResult:
    """Build the trace directory ``spec.out``; see the module docstring."""
    return Importer(spec, progress).run()
