"""The public request-log formats the simulator reads, and which one a file is.

:func:`read_log` reads a log by name or detects it (:func:`detect_format`):

* ``mooncake``: Mooncake JSONL or Parquet (every FAST'25 file), real block ids;
* ``kv-cache-tester``: agentic coding sessions (one JSON file per session,
  full-blocks-only ids, local id scope), started as a seeded arrival process;
* ``azure``: Azure LLM inference CSV, 2023 and 2024 (arrivals and lengths;
  prefixes synthetic and seeded);
* ``burstgpt``: BurstGPT CSV (arrivals and lengths; prefixes synthetic and seeded);
* ``bench-serving``: SGLang ``bench_serving --output-details`` result line
  (lengths and measured outcomes; arrivals from its request rate, seeded;
  prefixes synthetic and seeded);
* ``dynamo``: Dynamo request traces (``DYN_REQUEST_TRACE``), real block ids.

Every reader ends in :class:`~replay.simulate.logs.RequestLog`, which applies the
block-count rule (:mod:`replay.trace.blocks`).  Formats are documented with an
example each in ``traces/README.md``.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl

from replay.capture.sources import Facts, read_dynamo
from replay.errors import ParamError, ParamsError
from replay.simulate.logs import (
    DEFAULT_BLOCK_SIZE,
    NS_PER_MS,
    LogError,
    RequestLog,
    read_azure,
    read_csv_log,
    read_mooncake,
    synthetic_prefixes,
)
from replay.trace.blocks import check_block_counts

FORMATS = ("mooncake", "kv-cache-tester", "azure", "burstgpt", "bench-serving", "dynamo")
NS = 1_000_000_000
SCAN_LINES = 1000        # JSONL lines a detection looks at


# ---------------------------------------------------------------------------
# detection

def _open_text(p: Path):
    return gzip.open(p, "rt") if p.suffix == ".gz" else open(p)


def _json_kind(rec: object) -> str | None:
    """The format one JSON record belongs to (None: none known)."""
    if not isinstance(rec, dict):
        return None
    if {"timestamp", "input_length", "hash_ids"} <= rec.keys():
        return "mooncake"
    if {"input_lens", "output_lens", "ttfts"} <= rec.keys():
        return "bench-serving"
    if "request_received_ms" in rec or rec.get("event") == "request_end" or rec.get("type") == "request_end":
        return "dynamo"
    if {"requests", "block_size"} <= rec.keys():
        return "kv-cache-tester"
    return None


def _jsonl_kinds(p: Path) -> Iterator[tuple[int, str | None]]:
    with _open_text(p) as f:
        n = 0
        for k, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            yield k, _json_kind(rec)
            n += 1
            if n >= SCAN_LINES:
                return


def _file_format(p: Path) -> str:
    """One file's format, or a one-line LogError."""
    name = p.name.lower()
    if name.endswith(".parquet"):
        return "mooncake"
    if name.endswith(".csv"):
        try:
            head = pl.read_csv(p, n_rows=0).columns
        except Exception as err:  # noqa: BLE001 - polars raises many kinds; one line for the user
            raise LogError(f"{p}: cannot read: {str(err).splitlines()[0]}") from None
        if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= set(head):
            return "azure"
        if {"Timestamp", "Request tokens", "Response tokens"} <= set(head):
            return "burstgpt"
        raise LogError(f"{p}: unknown CSV log (header {', '.join(head[:6])}); known: Azure LLM "
                       "(TIMESTAMP, ContextTokens, GeneratedTokens), BurstGPT (Timestamp, Request tokens, "
                       "Response tokens)")
    kinds: dict[str, int] = {}
    try:
        if name.endswith(".json"):   # one JSON document (a session file), else JSONL
            with _open_text(p) as f:
                head = f.read(1 << 16)
            if '"hash_id_scope"' in head and '"block_size"' in head:   # a session file, without parsing it
                return "kv-cache-tester"
            with _open_text(p) as f:
                try:
                    doc = json.load(f)
                except ValueError:
                    doc = None
            if doc is not None:
                kind = _json_kind(doc)
                if kind is None:
                    what = ", ".join(list(doc)[:6]) if isinstance(doc, dict) else type(doc).__name__
                    raise LogError(f"{p}: unknown JSON log (keys {what})")
                return kind
        unknown = None
        for line, kind in _jsonl_kinds(p):
            if kind is None:    # a bad record of a known format is the reader's to name
                unknown = unknown or line
            else:
                kinds.setdefault(kind, line)
    except (OSError, UnicodeDecodeError, EOFError) as err:
        raise LogError(f"{p}: cannot read: {str(err).splitlines()[0]}") from None
    if len(kinds) > 1:
        (a, la), (b, lb) = sorted(kinds.items(), key=lambda kv: kv[1])[:2]
        raise LogError(f"{p}: mixed log: line {la} is {a}, line {lb} is {b}")
    if not kinds:
        if unknown is None:
            raise LogError(f"{p}: empty log")
        raise LogError(f"{p}: line {unknown}: not a record of a known log format ({', '.join(FORMATS)})")
    return next(iter(kinds))


def _log_files(p: Path) -> list[Path]:
    return sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith((".", "_"))
                  and f.name.lower().endswith((".json", ".jsonl", ".jsonl.gz", ".csv", ".parquet")))


def detect_format(path: str | os.PathLike) -> str:
    """The format of a log file, or of every log file in a folder (they must agree)."""
    p = Path(path)
    if p.is_file():
        return _file_format(p)
    if not p.is_dir():
        raise LogError(f"{p}: no such file or folder")
    files = _log_files(p)
    if not files:
        raise LogError(f"{p}: no log file (*.json, *.jsonl, *.csv, *.parquet) in the folder")
    first = _file_format(files[0])
    for f in files[1:]:
        other = _file_format(f)
        if other != first:
            raise LogError(f"{p}: mixed folder: {files[0].name} is {first}, {f.name} is {other}")
    return first


# ---------------------------------------------------------------------------
# kv-cache-tester sessions

SHARED_SCOPE_BITS = 40   # a session's local ids sit above this bit, tagged with the session


def _session_requests(doc: dict, where: Path) -> list[tuple[float, dict]]:
    """Every request of a session with its time from the session's start: sub-agent requests
    at their parent's time plus their own."""
    out: list[tuple[float, dict]] = []

    def walk(reqs, base: float, path: str) -> None:
        if not isinstance(reqs, list):
            raise LogError(f"{where}: {path}: 'requests' must be a list")
        for k, r in enumerate(reqs):
            at = f"{path}[{k}]"
            if not isinstance(r, dict):
                raise LogError(f"{where}: {at}: expected an object")
            t = r.get("t")
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise LogError(f"{where}: {at}: field 't' must be a number >= 0, got {t!r}")
            if r.get("type") == "subagent" or ("requests" in r and "in" not in r):
                walk(r.get("requests"), base + float(t), f"{at}.requests")
                continue
            for key in ("in", "out"):
                v = r.get(key)
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise LogError(f"{where}: {at}: field {key!r} must be an integer >= 0, got {v!r}")
            h = r.get("hash_ids")
            a = np.asarray(h) if isinstance(h, list) else None
            if a is None or (a.size and (a.ndim != 1 or a.dtype.kind not in "iu")):
                raise LogError(f"{where}: {at}: field 'hash_ids' must be a list of integers")
            r = dict(r, hash_ids=a.astype(np.int64))
            out.append((base + float(t), r))

    walk(doc.get("requests"), 0.0, "requests")
    return out


def _opt_seconds(r: dict, key: str) -> float:
    v = r.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return math.nan
    return float(v) * 1e3


def read_kv_cache_tester(path: str | os.PathLike, *, sessions: int | None = None,
                         session_rate: float = 0.05, seed: int = 0, block_size: int | None = None,
                         limit: int | None = None) -> RequestLog:
    """kv-cache-tester session files (a folder of ``trace_*.json`` or one file) as one log.

    ``sessions`` session instances (default: one per file) start as a Poisson process of
    ``session_rate`` per second (seeded); instance ``k`` replays file ``order[k % files]``
    of a seeded shuffle.  A request's time is its session's start plus its ``t``; a
    sub-agent's requests are placed at their parent's time plus their own ``t``.  Block ids
    of the tools + system prefix (the first ``(tool_tokens + system_tokens) // block_size``
    ids) are shared by every session; every other id lives in its instance's own namespace.
    The recorded ``ttft`` and ``api_time`` are kept as ``observed_ttft_ms`` /
    ``observed_latency_ms``.
    """
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.glob("*.json")) if p.is_dir() else []
    if not files:
        raise LogError(f"{p}: no kv-cache-tester session file (*.json)")
    if sessions is not None and sessions < 1:
        raise ParamError("sessions", f"must be >= 1, got {sessions}")
    if not (session_rate > 0 and math.isfinite(session_rate)):
        raise ParamError("session_rate", f"must be a number > 0, got {session_rate}")
    docs = []
    B = block_size
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError, UnicodeDecodeError) as err:
            raise LogError(f"{f}: cannot read: {str(err).splitlines()[0]}") from None
        if _json_kind(doc) != "kv-cache-tester":
            raise LogError(f"{f}: not a kv-cache-tester session (needs 'block_size' and 'requests')")
        b = doc["block_size"]
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise LogError(f"{f}: field 'block_size' must be an integer >= 1, got {b!r}")
        if B is None:
            B = b
        elif b != B:
            raise ParamsError("{f}: block_size {b} differs from {want} (of {first} or {block_size})", "block_size",
                              f=f, b=b, want=B, first=files[0].name)
        scope = doc.get("hash_id_scope", "local")
        if scope not in ("local", "global"):
            raise LogError(f"{f}: field 'hash_id_scope' must be \"local\" or \"global\", got {scope!r}")
        shared = (int(doc.get("tool_tokens") or 0) + int(doc.get("system_tokens") or 0)) // b
        reqs = _session_requests(doc, f)
        c = check_block_counts(np.array([r["hash_ids"].size for _, r in reqs], dtype=np.int64),
                               np.array([r["in"] for _, r in reqs], dtype=np.int64), b, length_name="in",
                               block_name="block_size")
        if c.bad is not None:
            raise LogError(f"{f}: request {c.bad}: hash_ids {c.message}")
        docs.append((f, scope, shared, reqs))
    n_inst = len(docs) if sessions is None else int(sessions)
    rng = np.random.default_rng([int(seed), 0x5E55])
    starts = np.cumsum(rng.exponential(1.0 / session_rate, n_inst))
    starts -= starts[0]
    order = np.concatenate([rng.permutation(len(docs)) for _ in range(-(-n_inst // len(docs)))])[:n_inst]
    ts, L, out, ttft, lat, sizes, ids = [], [], [], [], [], [], []
    for k in range(n_inst):
        f, scope, shared, reqs = docs[int(order[k])]
        for t, r in reqs:
            h = r["hash_ids"]
            if scope == "local":
                own = h > shared
                h = np.where(own, ((k + 1) << SHARED_SCOPE_BITS) | h, h)
            ts.append(round((starts[k] + t) * NS))
            L.append(r["in"])
            out.append(r["out"])
            ttft.append(_opt_seconds(r, "ttft"))
            lat.append(_opt_seconds(r, "api_time"))
            sizes.append(h.size)
            ids.append(h)
    off = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=off[1:])
    log = RequestLog(np.array(ts, dtype=np.int64), np.array(L, dtype=np.int64), np.array(out, dtype=np.int64),
                     off, np.concatenate(ids) if ids else np.zeros(0, np.int64),
                     np.arange(len(ts), dtype=np.int64), int(B), str(p),
                     observed_ttft_ms=np.array(ttft, dtype=np.float64),
                     observed_latency_ms=np.array(lat, dtype=np.float64))
    return log.head(limit) if limit is not None else log


# ---------------------------------------------------------------------------
# arrivals and lengths only: BurstGPT, bench_serving

def read_burstgpt(path: str | os.PathLike, *, seed: int = 0, block_size: int = DEFAULT_BLOCK_SIZE,
                  limit: int | None = None) -> RequestLog:
    """A BurstGPT CSV (``Timestamp`` seconds, ``Request tokens``, ``Response tokens``);
    prefix ids from the seeded synthetic model, as for Azure."""
    p = Path(path)
    need = ("Timestamp", "Request tokens", "Response tokens")
    df = read_csv_log(p, need)
    for c in need:
        if not df[c].dtype.is_numeric():
            raise LogError(f"{p}: column {c!r}: must be numeric, got {df[c].dtype}")
        bad = df[c].is_null() | (df[c] < 0)
        if bad.any():
            raise LogError(f"{p}: column {c!r} row {int(bad.arg_max())}: must be a number >= 0")
    if limit is not None:
        df = df.head(int(limit))
    t = df["Timestamp"].cast(pl.Float64).to_numpy()
    ts = np.round(t * NS).astype(np.int64)
    return _synthetic_log(p, ts, df["Request tokens"].cast(pl.Int64).to_numpy(),
                          df["Response tokens"].cast(pl.Int64).to_numpy(), seed, block_size)


def _synthetic_log(p: Path, ts: np.ndarray, L: np.ndarray, out: np.ndarray, seed: int, block_size: int,
                   ttft: np.ndarray | None = None, lat: np.ndarray | None = None) -> RequestLog:
    ts = ts - ts.min() if ts.size else ts
    order = np.argsort(ts, kind="stable")
    ts, L, out = ts[order], L[order], out[order]
    off, ids = synthetic_prefixes(L, ts, seed=seed, block_size=block_size)
    return RequestLog(ts, L, out, off, ids, order.astype(np.int64), block_size, str(p),
                      observed_ttft_ms=None if ttft is None else ttft[order],
                      observed_latency_ms=None if lat is None else lat[order])


def read_bench_serving(path: str | os.PathLike, *, seed: int = 0, block_size: int = DEFAULT_BLOCK_SIZE,
                       limit: int | None = None) -> RequestLog:
    """SGLang ``bench_serving --output-details`` output: the file's last run line that holds
    per-request details.  Failed requests (non-empty ``errors``) are dropped.  Arrivals: a
    Poisson process at the run's ``request_rate`` (seeded; all at 0 for ``inf``); the file has
    no send times.  ``ttfts`` and ``ttft + sum(itls)`` are kept as the observed outcomes."""
    p = Path(path)
    run = None
    with _open_text(p) as f:
        for k, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as err:
                raise LogError(f"{p}: line {k}: not valid JSON ({str(err).splitlines()[0]})") from None
            if _json_kind(rec) == "bench-serving":
                run = (k, rec)
    if run is None:
        raise LogError(f"{p}: no bench_serving run with per-request details (run it with --output-details)")
    k, rec = run
    n = len(rec["input_lens"])
    for key in ("output_lens", "ttfts"):
        if not isinstance(rec.get(key), list) or len(rec[key]) != n:
            raise LogError(f"{p}: line {k}: field {key!r} must be a list of {n} values (one per request)")
    rate = rec.get("request_rate")
    if rate == "trace":
        raise LogError(f"{p}: line {k}: request_rate \"trace\": the send times came from the dataset's "
                       "timestamps; replay the dataset file itself")
    if isinstance(rate, bool) or not isinstance(rate, (int, float, str)):
        raise LogError(f"{p}: line {k}: field 'request_rate' must be a number or inf, got {rate!r}")
    rate = float(rate)
    errors = rec.get("errors") or [""] * n
    itls = rec.get("itls") or [[]] * n
    keep = [i for i in range(n) if not errors[i]]
    L = np.array([rec["input_lens"][i] for i in keep], dtype=np.int64)
    out = np.array([rec["output_lens"][i] for i in keep], dtype=np.int64)
    ttft = np.array([float(rec["ttfts"][i]) * 1e3 for i in keep], dtype=np.float64)
    lat = ttft + np.array([float(sum(itls[i] or [])) * 1e3 for i in keep], dtype=np.float64)
    rng = np.random.default_rng([int(seed), 0xBE5C])
    if math.isinf(rate) or rate <= 0:
        ts = np.zeros(len(keep), dtype=np.int64)
    else:
        gaps = rng.exponential(1.0 / rate, len(keep))
        ts = np.round(np.concatenate([[0.0], np.cumsum(gaps[:-1])]) * NS).astype(np.int64)
    if limit is not None:
        ts, L, out, ttft, lat = ts[:limit], L[:limit], out[:limit], ttft[:limit], lat[:limit]
    return _synthetic_log(p, ts, L, out, seed, block_size, ttft, lat)


# ---------------------------------------------------------------------------
# Dynamo request traces (real block ids)

def read_dynamo_log(path: str | os.PathLike, *, block_size: int | None = None,
                    limit: int | None = None) -> RequestLog:
    """Dynamo request traces (``request_end`` records with ``replay.input_sequence_hashes``)."""
    p = Path(path)
    df, block = read_dynamo([p], Facts(), {})
    B = block_size or block
    if B is None:
        raise ParamsError("{p}: the Dynamo trace gives no trace_block_size: pass {block_size}", "block_size", p=p)
    if block is not None and block_size is not None and block != block_size:
        raise ParamsError("{p}: {block_size} {given} differs from the trace's trace_block_size {block}", "block_size",
                          p=p, given=block_size, block=block)
    miss = df["hash_ids"].is_null() | df["output_tokens"].is_null()
    if miss.any():
        raise LogError(f"{p}: request_end record {int(miss.arg_max())}: no input_sequence_hashes or "
                       "output_tokens (a request log needs both)")
    if limit is not None:
        df = df.sort("ts", maintain_order=True).head(int(limit))
    h = df["hash_ids"]
    sizes = h.list.len().to_numpy().astype(np.int64)
    off = np.zeros(df.height + 1, dtype=np.int64)
    np.cumsum(sizes, out=off[1:])
    flat = h.explode().drop_nulls().to_numpy().astype(np.int64) if off[-1] else np.zeros(0, np.int64)
    ts = df["ts"].to_numpy().astype(np.int64)
    ts = ts - ts.min() if ts.size else ts
    return RequestLog(ts, df["input_tokens"].to_numpy().astype(np.int64),
                      df["output_tokens"].to_numpy().astype(np.int64), off, flat,
                      np.arange(df.height, dtype=np.int64), int(B), str(p),
                      observed_ttft_ms=df["ttft_ms"].cast(pl.Float64).fill_null(np.nan).to_numpy(),
                      observed_latency_ms=df["latency_ms"].cast(pl.Float64).fill_null(np.nan).to_numpy())


# ---------------------------------------------------------------------------
# by name

def read_log(path: str | os.PathLike, *, fmt: str = "auto", seed: int = 0, block_size: int | None = None,
             limit: int | None = None, sessions: int | None = None,
             session_rate: float | None = None) -> RequestLog:
    """Read a request log by format name (:data:`FORMATS`) or ``auto`` (:func:`detect_format`).

    ``block_size``: tokens per block of the log's ids (default: the file's own where it says,
    else 512).  ``seed`` seeds synthetic prefixes and arrival processes; ``sessions`` and
    ``session_rate`` are the kv-cache-tester arrival process."""
    p = Path(path)
    if fmt == "auto":
        fmt = detect_format(p)
    if fmt not in FORMATS:
        raise LogError(f"unknown log format {fmt!r}; expected auto, {', '.join(FORMATS)}")
    if (sessions is not None or session_rate is not None) and fmt != "kv-cache-tester":
        raise ParamsError("{sessions} and {session_rate} apply to kv-cache-tester sessions, not a {fmt} log",
                          "sessions", "session_rate", fmt=fmt)
    B = block_size or DEFAULT_BLOCK_SIZE
    if fmt == "mooncake":
        return read_mooncake(p, block_size=B, limit=limit)
    if fmt == "azure":
        return read_azure(p, seed=seed, block_size=B, limit=limit)
    if fmt == "burstgpt":
        return read_burstgpt(p, seed=seed, block_size=B, limit=limit)
    if fmt == "bench-serving":
        return read_bench_serving(p, seed=seed, block_size=B, limit=limit)
    if fmt == "dynamo":
        return read_dynamo_log(p, block_size=block_size, limit=limit)
    kw = {} if session_rate is None else {"session_rate": session_rate}
    return read_kv_cache_tester(p, sessions=sessions, seed=seed, block_size=block_size, limit=limit, **kw)


__all__ = ["FORMATS", "NS_PER_MS", "detect_format", "read_bench_serving", "read_burstgpt",
           "read_dynamo_log", "read_kv_cache_tester", "read_log"]
