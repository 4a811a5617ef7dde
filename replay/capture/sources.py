"""Readers of what a fleet leaves on disk (CAPTURE.md section 4 and section 1).

Every reader returns polars frames with fixed columns and reports what it
could not use into a :class:`Facts`; a malformed line is an error naming the
file and line (or, with ``skip_bad_lines``, counted and skipped), and a
truncated gzip file keeps the records before the cut and says so.
"""

from __future__ import annotations

import datetime as dt
import gzip
import io
import json
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from isal import igzip
from isal.igzip_lib import IsalError

from replay.errors import ParamsError, ReplayError

NS = 1_000_000_000


class ImportError_(ReplayError):
    """Bad import input; one line naming the file (and line or column)."""


@dataclass
class Facts:
    """What the import saw, kept for trace.json and the warning line."""

    data: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)
    skip_bad_lines: bool = False

    def add(self, key: str, n: int = 1) -> None:
        self.data[key] = self.data.get(key, 0) + n

    def example(self, key: str, value, limit: int = 5) -> None:
        self.data.setdefault(key, [])
        if len(self.data[key]) < limit:
            self.data[key].append(value)


def files_under(paths, patterns: tuple[str, ...]) -> list[Path]:
    """Files given, and files matching ``patterns`` below given folders, in path order;
    names starting with ``.`` or ``_`` are skipped."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for pat in patterns for f in p.rglob(pat)
                           if not any(part.startswith((".", "_")) for part in f.relative_to(p).parts))
            out.extend(dict.fromkeys(found))
        elif p.is_file():
            out.append(p)
        else:
            raise ImportError_(f"{p}: no such file or folder")
    return out


def read_text(path: Path, facts: Facts) -> bytes:
    """The file's bytes (gunzipped by suffix); a truncated gzip keeps every complete line."""
    if path.suffix != ".gz":
        try:
            return path.read_bytes()
        except OSError as err:
            raise ImportError_(f"{path}: cannot read ({err.strerror})") from None
    buf = io.BytesIO()
    try:
        with igzip.open(path, "rb") as fh:      # igzip: the gzip format, a few times zlib's speed
            while True:
                chunk = fh.read(1 << 20)
                if not chunk:
                    break
                buf.write(chunk)
    except (EOFError, zlib.error, IsalError, gzip.BadGzipFile) as err:  # type: ignore[misc]  # isal ships no stub for it
        data = buf.getvalue()
        cut = data.rfind(b"\n") + 1
        kept = data[:cut].count(b"\n")
        facts.add("truncated_files")
        facts.example("truncated_file_examples", f"{path}: {type(err).__name__} after {kept} complete lines")
        facts.warnings.append(f"{path}: truncated ({type(err).__name__}); kept its {kept} complete lines")
        return data[:cut]
    except OSError as err:
        raise ImportError_(f"{path}: cannot read ({err.strerror or err})") from None
    return buf.getvalue()


def ndjson(path: Path, data: bytes, schema: dict, facts: Facts, what: str) -> pl.DataFrame:
    """Parse NDJSON with polars; on failure find the bad line in Python and refuse (or skip it)."""
    if not data.strip():
        return pl.DataFrame(schema=schema)
    try:
        return pl.read_ndjson(io.BytesIO(data), schema=schema, ignore_errors=False)
    except Exception:  # noqa: BLE001 - polars raises several kinds; locate the line ourselves
        pass
    rows = []
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
            rows.append(_coerce(obj, schema))
        except (ValueError, TypeError) as err:
            msg = f"{path}: line {i + 1}: malformed {what} record ({str(err).splitlines()[0][:80]})"
            if not facts.skip_bad_lines:
                raise ParamsError("{msg}; use {skip_bad_lines} to count and skip such lines", "skip_bad_lines",
                                  msg=msg) from None
            facts.add("skipped_bad_lines")
            facts.example("skipped_bad_line_examples", msg)
    if not rows:
        return pl.DataFrame(schema=schema)
    return pl.DataFrame(rows, schema=schema, strict=False)


def _coerce(obj: dict, schema: dict) -> dict:
    out: dict[str, Any] = {}
    for k, t in schema.items():
        v = obj.get(k)
        if v is None:
            out[k] = None
        elif t == pl.String:
            out[k] = v if isinstance(v, str) else json.dumps(v) if isinstance(v, (dict, list)) else str(v)
        elif t == pl.Int64:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{k} is {type(v).__name__}, expected an integer")
            out[k] = v
        elif t == pl.Float64:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{k} is {type(v).__name__}, expected a number")
            out[k] = float(v)
        elif isinstance(t, pl.List):
            if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise TypeError(f"{k} is not a list of integers")
            out[k] = v
        else:
            out[k] = v
    return out


def rfc3339_ns(s: pl.Series, where: str) -> np.ndarray:
    """RFC 3339 strings (UTC, any precision) to int64 ns; a bad one is an error naming its row."""
    try:
        d = s.str.to_datetime(time_unit="ns", time_zone="UTC", strict=True)
        if d.null_count() == s.null_count():
            return d.dt.epoch("ns").to_numpy()
    except Exception:  # noqa: BLE001 - fall back to the slow path, which names the row
        pass
    out = np.empty(len(s), dtype=np.int64)
    for i, v in enumerate(s.to_list()):
        try:
            t = dt.datetime.fromisoformat(v.replace("Z", "+00:00"))
            if t.tzinfo is None:
                t = t.replace(tzinfo=dt.UTC)
            out[i] = int(t.timestamp()) * NS + t.microsecond * 1000
        except (AttributeError, ValueError):
            raise ImportError_(f"{where} row {i}: ts {v!r} is not an RFC 3339 time") from None
    return out


# ---------------------------------------------------------------- request sources
TOKEN_SCHEMA = {"kind": pl.String, "request_id": pl.String, "model": pl.String, "input_ids": pl.List(pl.Int64),
                "ts": pl.String, "output_tokens": pl.Int64, "cache_salt": pl.String, "lora_id": pl.String,
                "choice_index": pl.Int64}


def iter_token_export(paths, facts: Facts):
    """Router token export (``*.ndjson.gz``), one frame per file: the ``ingest`` records as
    ``ts, request_id, model, input_ids, output_tokens, cache_salt, file``."""
    files = files_under(paths, ("*.ndjson.gz", "*.ndjson"))
    if not files:
        raise ImportError_(f"{', '.join(map(str, paths))}: no token export file (*.ndjson.gz)")
    facts.data["token_export_files"] = len(files)
    # the next file is read and parsed (polars, without the GIL) while the caller hashes this one

    def parse(f):
        return ndjson(f, read_text(f, facts), TOKEN_SCHEMA, facts, "token export")

    with ThreadPoolExecutor(max_workers=1) as pool:
        ahead = pool.submit(parse, files[0])
        for k, f in enumerate(files):
            df = ahead.result()
            if k + 1 < len(files):
                ahead = pool.submit(parse, files[k + 1])
            yield f, _ingest(f, df, facts)


def _ingest(f: Path, df: pl.DataFrame, facts: Facts) -> pl.DataFrame:
    """The checked ``ingest`` records of one token export file."""
    facts.add("token_export_records", df.height)
    kinds = df["kind"].fill_null("")
    other = df.filter(kinds != "ingest")
    if other.height:
        facts.add("token_export_non_ingest_records", other.height)
    df = df.filter(kinds == "ingest")
    for col in ("request_id", "input_ids", "ts"):
        bad = df[col].is_null()
        if bad.any():
            raise ImportError_(f"{f}: ingest record {int(bad.arg_max())}: no {col}")
    if df["lora_id"].drop_nulls().len():
        raise ImportError_(f"{f}: ingest records name a LoRA adapter (lora_id): LoRA changes the block "
                           "hash and is out of scope")
    ts = rfc3339_ns(df["ts"], f"{f}: column 'ts'")
    return df.select("request_id", "model", "input_ids", "output_tokens", "cache_salt").with_columns(
        pl.Series("ts", ts, dtype=pl.Int64))


DYNAMO_SCHEMA = {"event": pl.String, "type": pl.String, "request_id": pl.String, "input_tokens": pl.Int64,
                 "output_tokens": pl.Int64, "cached_tokens": pl.Int64, "request_received_ms": pl.Float64,
                 "ttft_ms": pl.Float64, "total_time_ms": pl.Float64,
                 "worker": pl.Struct({"prefill_worker_id": pl.String, "prefill_dp_rank": pl.Int64}),
                 "replay": pl.Struct({"trace_block_size": pl.Int64, "input_length": pl.Int64,
                                      "input_sequence_hashes": pl.List(pl.Int64)})}


def read_dynamo(paths, facts: Facts, worker_ids: dict[str, str]) -> tuple[pl.DataFrame, int | None]:
    """Dynamo request trace (``DYN_REQUEST_TRACE=1``): ``request_end`` records; returns the
    requests and the trace's block size."""
    frames = []
    for f in files_under(paths, ("*.jsonl.gz", "*.jsonl")):
        df = ndjson(f, read_text(f, facts), DYNAMO_SCHEMA, facts, "Dynamo request trace")
        tag = pl.coalesce(pl.col("event"), pl.col("type"))
        df = df.filter((tag == "request_end") | (tag.is_null() & pl.col("request_received_ms").is_not_null()))
        frames.append(df)
    if not frames:
        raise ImportError_(f"{', '.join(map(str, paths))}: no Dynamo request trace file (*.jsonl.gz)")
    df = pl.concat(frames)
    sizes = df["replay"].struct.field("trace_block_size").drop_nulls().unique().to_list()
    if len(sizes) > 1:
        raise ImportError_(f"Dynamo request trace: records with different trace_block_size {sorted(sizes)}")
    wid = df["worker"].struct.field("prefill_worker_id")
    sel = [None if w is None else worker_ids.get(w, f"dynamo-worker-{w}") for w in wid.to_list()]
    if any(w is not None and w not in worker_ids for w in wid.to_list()):
        facts.data["dynamo_worker_ids_unmapped"] = sorted({w for w in wid.to_list() if w and w not in worker_ids})
    rp = pl.col("replay")
    out = df.select(
        pl.col("request_id"),
        (pl.col("request_received_ms") * 1e6).round().cast(pl.Int64).alias("ts"),
        pl.coalesce(pl.col("input_tokens"), rp.struct.field("input_length")).alias("input_tokens"),
        "output_tokens", "cached_tokens", "ttft_ms", pl.col("total_time_ms").alias("latency_ms"),
        rp.struct.field("input_sequence_hashes").alias("hash_ids"),
    ).with_columns(pl.Series("selected_worker", sel, dtype=pl.String))
    for col in ("request_id", "ts", "input_tokens"):
        bad = out[col].is_null()
        if bad.any():
            raise ImportError_(f"Dynamo request trace: request_end record {int(bad.arg_max())}: no {col}")
    return out, (int(sizes[0]) if sizes else None)


def read_mooncake_requests(paths, facts: Facts, start_ns: int) -> pl.DataFrame:
    """Mooncake-format log (``timestamp`` ms from the start, ``input_length``, ``output_length``,
    ``hash_ids``); times are placed from ``start_ns``."""
    schema = {"timestamp": pl.Float64, "input_length": pl.Int64, "output_length": pl.Int64,
              "hash_ids": pl.List(pl.Int64), "request_id": pl.String}
    frames = []
    for f in files_under(paths, ("*.jsonl", "*.jsonl.gz")):
        frames.append(ndjson(f, read_text(f, facts), schema, facts, "Mooncake log")
                      .with_columns(pl.lit(f.name).alias("_file")))
    if not frames:
        raise ImportError_(f"{', '.join(map(str, paths))}: no Mooncake log file (*.jsonl)")
    df = pl.concat(frames).with_row_index("_i")
    for col in ("timestamp", "input_length"):
        bad = df[col].is_null()
        if bad.any():
            raise ImportError_(f"Mooncake log: record {int(bad.arg_max())}: no {col}")
    return df.select(
        pl.coalesce(pl.col("request_id"), pl.format("mooncake-{}", pl.col("_i"))).alias("request_id"),
        ((pl.col("timestamp") * 1e6).round().cast(pl.Int64) + start_ns).alias("ts"),
        pl.col("input_length").alias("input_tokens"), pl.col("output_length").alias("output_tokens"),
        "hash_ids",
    )


ENGINE_SCHEMA = {"id": pl.String, "rid": pl.String, "prompt_tokens": pl.Int64, "completion_tokens": pl.Int64,
                 "cached_tokens": pl.Int64, "e2e_latency": pl.Float64, "dp_rank": pl.Int64,
                 "finish_reason": pl.String, "meta_info": pl.String}


def read_engine_export(url: str, paths, facts: Facts) -> pl.DataFrame:
    """An engine's request export (``--export-metrics-to-file``): one record per finished
    request, ``meta_info`` fields at the top level (or, accepted too, under ``meta_info``)."""
    frames = []
    files = files_under(paths, ("*.log", "*.jsonl", "*.log.gz", "*.jsonl.gz"))
    if not files:
        raise ImportError_(f"{url}: no engine request export file under {', '.join(map(str, paths))}")
    for f in files:
        df = ndjson(f, read_text(f, facts), ENGINE_SCHEMA, facts, "engine request export")
        if df["meta_info"].drop_nulls().len():
            nested = df["meta_info"].str.json_decode(pl.Struct({k: v for k, v in ENGINE_SCHEMA.items()
                                                               if k not in ("meta_info", "rid")}))
            df = df.with_columns([pl.coalesce(pl.col(k), nested.struct.field(k)).alias(k)
                                  for k in ENGINE_SCHEMA if k not in ("meta_info", "rid")])
        df = df.with_columns(pl.coalesce("id", "rid").alias("id"))
        bad = df["id"].is_null()
        if bad.any():
            raise ImportError_(f"{f}: record {int(bad.arg_max())}: no request id ('id')")
        frames.append(df.select("id", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
                                "dp_rank").with_columns(pl.lit(url).alias("engine_worker")))
    facts.add("engine_export_files", len(files))
    return pl.concat(frames)


# ---------------------------------------------------------------- load sources
LOAD_COLUMNS = ("ts", "worker", "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_tokens",
                "max_total_num_tokens", "num_waiting_uncached_tokens", "num_total_tokens",
                "max_running_requests", "total_prefill_uncached_tokens", "total_prefill_busy_us")
LOAD_TYPES = {"ts": pl.Int64, "worker": pl.String, **{c: pl.Int64 for c in LOAD_COLUMNS[2:]}}


def _time_ns(v, where: str) -> int:
    if isinstance(v, bool):
        raise ImportError_(f"{where}: timestamp is a boolean")
    if isinstance(v, (int, float)):
        # REPLAY CHOICE: a number is seconds since the epoch (ms when it is > 1e11, ns when > 1e17)
        x = float(v)
        return int(round(x)) if x > 1e17 else int(round(x * 1e6)) if x > 1e11 else int(round(x * 1e9))
    if isinstance(v, str):
        try:
            t = dt.datetime.fromisoformat(v.replace("Z", "+00:00"))
        except ValueError:
            raise ImportError_(f"{where}: timestamp {v!r} is not a number or an RFC 3339 time") from None
        if t.tzinfo is None:
            t = t.replace(tzinfo=dt.UTC)
        return int(t.timestamp()) * NS + t.microsecond * 1000
    raise ImportError_(f"{where}: no timestamp")


def read_v1_loads(url: str, path: Path, facts: Facts) -> pl.DataFrame:
    """Polled ``GET /v1/loads?include=core`` answers, one JSON object a line
    (``{"loads": [...]}``, optionally with a top-level ``timestamp`` used when an
    entry has none)."""
    rows: dict[str, list] = {c: [] for c in LOAD_COLUMNS}
    data = read_text(path, facts)
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        where = f"{path}: line {i + 1}"
        try:
            obj = json.loads(line)
        except ValueError as err:
            if not facts.skip_bad_lines:
                raise ParamsError("{where}: malformed JSON ({err}); use {skip_bad_lines} to count and skip such "
                                  "lines", "skip_bad_lines", where=where, err=str(err)[:60]) from None
            facts.add("skipped_bad_lines")
            continue
        entries = obj.get("loads") if isinstance(obj, dict) else None
        if not isinstance(entries, list):
            raise ImportError_(f"{where}: not a /v1/loads answer (no 'loads' list)")
        for e in entries:
            ts = _time_ns(e.get("timestamp", obj.get("timestamp")), where)
            vals = {"ts": ts, "worker": url, "dp_rank": e.get("dp_rank", 0),
                    "num_running_reqs": e.get("num_running_reqs"), "num_waiting_reqs": e.get("num_waiting_reqs"),
                    "num_tokens": e.get("num_used_tokens", e.get("num_tokens")),
                    "max_total_num_tokens": e.get("max_total_num_tokens", 0)}
            for c in LOAD_COLUMNS[7:]:
                vals[c] = e.get(c)
            for c in ("num_running_reqs", "num_waiting_reqs", "num_tokens"):
                if not isinstance(vals[c], int) or isinstance(vals[c], bool) or vals[c] < 0:
                    raise ImportError_(f"{where}: entry field {c!r} is {vals[c]!r}, expected an integer >= 0")
            for c in LOAD_COLUMNS:
                rows[c].append(vals[c])
    facts.add("polled_load_rows", len(rows["ts"]))
    return pl.DataFrame(rows, schema=LOAD_TYPES)


PROM_FIELDS = {"num_running_reqs": "num_running_reqs", "num_queue_reqs": "num_waiting_reqs",
               "num_used_tokens": "num_tokens", "token_usage": "token_usage"}


def read_prometheus(url: str, path: Path, facts: Facts) -> pl.DataFrame:
    """Prometheus text scrapes of an engine's gauges, concatenated; each scrape starts
    with a line ``# scrape_ts_ms <unix ms>`` (or its samples carry timestamps).
    ``max_total_num_tokens`` is ``num_used_tokens / token_usage`` where usage > 0, else 0
    (unknown); the native tail is absent."""
    from prometheus_client.parser import text_string_to_metric_families  # optional: an extra dependency

    text = read_text(path, facts).decode(errors="replace")
    chunks: list[tuple[int | None, str]] = []
    cur_ts: int | None = None
    cur: list[str] = []
    for line in text.splitlines():
        if line.startswith("# scrape_ts_ms"):
            if cur:
                chunks.append((cur_ts, "\n".join(cur)))
            try:
                cur_ts = int(line.split()[2]) * 1_000_000
            except (IndexError, ValueError):
                raise ImportError_(f"{path}: bad scrape marker {line!r} (want '# scrape_ts_ms <unix ms>')") from None
            cur = []
        else:
            cur.append(line)
    if cur:
        chunks.append((cur_ts, "\n".join(cur)))
    samples: dict[tuple[int, int], dict] = {}
    for ts, body in chunks:
        try:
            families = list(text_string_to_metric_families(body + "\n"))
        except ValueError as err:
            raise ImportError_(f"{path}: not Prometheus text ({str(err)[:80]})") from None
        for fam in families:
            for s in fam.samples:
                name = s.name
                for prefix in ("sglang:", "sglang_"):
                    if name.startswith(prefix):
                        name = name[len(prefix):]
                        break
                else:
                    continue
                if name not in PROM_FIELDS:
                    continue
                t = int(round(float(s.timestamp) * 1e9)) if s.timestamp is not None else ts
                if t is None:
                    raise ImportError_(f"{path}: sample {s.name} has no time (add '# scrape_ts_ms <unix ms>' "
                                       "lines before each scrape)")
                rank = int(s.labels.get("dp_rank", s.labels.get("engine_type_dp_rank", 0)) or 0)
                samples.setdefault((t, rank), {})[PROM_FIELDS[name]] = s.value
    rows: dict[str, list] = {c: [] for c in LOAD_COLUMNS}
    incomplete = 0
    for (t, rank), v in sorted(samples.items()):
        if not all(k in v for k in ("num_running_reqs", "num_waiting_reqs", "num_tokens")):
            incomplete += 1
            continue
        usage = v.get("token_usage") or 0.0
        vals = {"ts": t, "worker": url, "dp_rank": rank, "num_running_reqs": int(v["num_running_reqs"]),
                "num_waiting_reqs": int(v["num_waiting_reqs"]), "num_tokens": int(v["num_tokens"]),
                "max_total_num_tokens": int(round(v["num_tokens"] / usage)) if usage > 0 else 0}
        for c in LOAD_COLUMNS:
            rows[c].append(vals.get(c))
    if incomplete:
        facts.add("prometheus_scrapes_missing_a_gauge", incomplete)
    facts.add("prometheus_load_rows", len(rows["ts"]))
    return pl.DataFrame(rows, schema=LOAD_TYPES)
