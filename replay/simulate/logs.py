"""Request logs for the fleet simulator: readers, a seeded generator and the synthetic prefix model.

A :class:`RequestLog` is what the simulator consumes: per request an arrival
time, input and output lengths and the prefix block ids (``hash_ids``, one id
per ``block_size``-token block of the input; equal id = equal whole prefix up
to and including that block, the Mooncake convention).  Block ids are
remapped to dense ``0..n_blocks-1`` on construction, and every block gets its
parent (the block before it) and its token count.

Sources:

* Mooncake JSONL (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids``) and the same columns in Parquet: :func:`read_mooncake`.
* Azure LLM inference CSV (``TIMESTAMP, ContextTokens, GeneratedTokens``):
  arrivals and lengths are real, the prefix structure comes from the seeded
  synthetic model of :func:`synthetic_prefixes` (documented in
  ``docs/simulator.md``): :func:`read_azure`.
* :func:`generate_log`: a seeded synthetic log (Poisson session arrivals,
  multi-turn sessions over shared system prompts); :func:`write_mooncake_jsonl`
  writes any log in the Mooncake format (the committed
  ``traces/sample-log/requests.jsonl`` is made this way).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from replay.errors import ReplayError
from replay.trace.blocks import conform_blocks

NS_PER_MS = 1_000_000
DEFAULT_BLOCK_SIZE = 512
MAX_TIMESTAMP_MS = 1e12   # later stamps would overflow the simulator's int64 nanosecond clock
MAX_TOKENS = 1e12


class LogError(ReplayError):
    """A request log that cannot be read; the message is one line."""


@dataclass
class RequestLog:
    """Requests sorted (stably) by arrival time, with dense prefix block ids.

    ``ts_ns`` is relative to the log's start (the simulator adds an epoch).
    ``hash_off``/``hash_ids`` are CSR: request ``i`` holds
    ``hash_ids[hash_off[i]:hash_off[i+1]]`` (dense ids).  ``block_parent[b]``
    is the block before ``b`` in every request holding it (-1 for a first
    block); ``block_tokens[b]`` its token count (``block_size`` but for a
    partial last block).
    """

    ts_ns: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    hash_off: np.ndarray
    hash_ids: np.ndarray
    request_id: np.ndarray
    block_size: int = DEFAULT_BLOCK_SIZE
    source: str = ""
    block_parent: np.ndarray = field(default=None)  # type: ignore[assignment]
    block_tokens: np.ndarray = field(default=None)  # type: ignore[assignment]
    block_key: np.ndarray = field(default=None)  # type: ignore[assignment]
    partial_blocks_added: int = 0   # full-blocks-only lists given a fresh partial-block id
    observed_ttft_ms: np.ndarray | None = None     # what the log's own source measured (NaN: none)
    observed_latency_ms: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = self.ts_ns.shape[0]
        for name in ("input_tokens", "output_tokens", "request_id"):
            if getattr(self, name).shape[0] != n:
                raise LogError(f"{self.source}: column {name} has a different length")
        if self.hash_off.shape[0] != n + 1:
            raise LogError(f"{self.source}: hash offsets do not match the request count")
        # the block-count rule, in the rows as given (before the sort by time)
        self.hash_off, self.hash_ids, counts = conform_blocks(
            self.hash_off, self.hash_ids, self.input_tokens, self.block_size,
            length_name="input_length", block_name="block_size")
        if counts.bad is not None:
            raise LogError(f"{self.source}: row {counts.bad}: hash_ids {counts.message}")
        self.partial_blocks_added += counts.n_full_only
        order = np.argsort(self.ts_ns, kind="stable")
        if n and np.any(order != np.arange(n)):
            self._permute(order)
        self._dense_blocks()

    @property
    def n_requests(self) -> int:
        return int(self.ts_ns.shape[0])

    @property
    def n_blocks(self) -> int:
        return int(self.block_parent.shape[0])

    @property
    def query_blocks(self) -> np.ndarray:
        return np.diff(self.hash_off)

    def _permute(self, order: np.ndarray) -> None:
        sizes = np.diff(self.hash_off)[order]
        starts = self.hash_off[:-1][order]
        off = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(sizes, out=off[1:])
        idx = np.repeat(starts - off[:-1], sizes) + np.arange(off[-1])
        self.hash_ids = self.hash_ids[idx]
        self.hash_off = off
        self.ts_ns = self.ts_ns[order]
        self.input_tokens = self.input_tokens[order]
        self.output_tokens = self.output_tokens[order]
        self.request_id = self.request_id[order]
        if self.observed_ttft_ms is not None:
            self.observed_ttft_ms = self.observed_ttft_ms[order]
        if self.observed_latency_ms is not None:
            self.observed_latency_ms = self.observed_latency_ms[order]

    def _dense_blocks(self) -> None:
        ids = np.asarray(self.hash_ids, dtype=np.int64)
        uniq, dense = np.unique(ids, return_inverse=True)
        dense = dense.astype(np.int64).reshape(-1)
        nb = uniq.shape[0]
        sizes = np.diff(self.hash_off)
        pos = np.arange(dense.shape[0], dtype=np.int64) - np.repeat(self.hash_off[:-1], sizes)
        prev = np.full(dense.shape[0], -1, dtype=np.int64)
        if dense.shape[0]:
            prev[1:] = dense[:-1]
            prev[pos == 0] = -1
        parent = np.full(nb, -2, dtype=np.int64)
        parent[dense] = prev
        if dense.shape[0] and np.any(parent[dense] != prev):
            bad = int(np.nonzero(parent[dense] != prev)[0][0])
            req = int(np.searchsorted(self.hash_off, bad, side="right") - 1)
            raise LogError(f"{self.source}: request {req}: block id {int(ids[bad])} follows different "
                           "blocks in different requests (hash_ids must name whole prefixes)")
        L = np.repeat(self.input_tokens, sizes)
        tok = np.clip(L - pos * self.block_size, 0, self.block_size)
        btok = np.zeros(nb, dtype=np.int64)
        np.maximum.at(btok, dense, tok)
        self.hash_ids = dense
        self.block_key = uniq.astype(np.int64)
        self.block_parent = parent
        self.block_tokens = btok

    def head(self, n: int) -> RequestLog:
        """The first ``n`` requests (arrival order)."""
        n = min(int(n), self.n_requests)
        obs = [None if a is None else a[:n].copy() for a in (self.observed_ttft_ms, self.observed_latency_ms)]
        return RequestLog(self.ts_ns[:n].copy(), self.input_tokens[:n].copy(),
                          self.output_tokens[:n].copy(), self.hash_off[:n + 1].copy(),
                          self.block_key[self.hash_ids[:self.hash_off[n]]], self.request_id[:n].copy(),
                          self.block_size, self.source, observed_ttft_ms=obs[0], observed_latency_ms=obs[1])


def _from_frame(df: pl.DataFrame, source: str, block_size: int) -> RequestLog:
    need = ("timestamp", "input_length", "output_length", "hash_ids")
    for c in need:
        if c not in df.columns:
            raise LogError(f"{source}: missing column {c!r} (need {', '.join(need)})")
    for c in need[:3]:
        if df[c].null_count():
            raise LogError(f"{source}: column {c!r} row {int(df[c].is_null().arg_max())}: null")
        if not df[c].dtype.is_numeric():
            raise LogError(f"{source}: column {c!r} must be numeric, got {df[c].dtype}")
        if (df[c] < 0).any():
            raise LogError(f"{source}: column {c!r} row {int((df[c] < 0).arg_max())}: must be >= 0")
    tms = df["timestamp"].cast(pl.Float64).to_numpy()
    big = np.nonzero(~(tms <= MAX_TIMESTAMP_MS))[0]
    if big.size:
        raise LogError(f"{source}: column 'timestamp' row {int(big[0])}: {tms[big[0]]} ms is beyond "
                       f"{MAX_TIMESTAMP_MS:.0e} ms (about 31 years): refused")
    for c in ("input_length", "output_length"):
        v = df[c].cast(pl.Float64).to_numpy()
        big = np.nonzero(v > MAX_TOKENS)[0]
        if big.size:
            raise LogError(f"{source}: column {c!r} row {int(big[0])}: {int(v[big[0]])} tokens is "
                           f"more than {MAX_TOKENS:.0e}: refused")
    ts = (tms * NS_PER_MS).round().astype(np.int64)
    hashes = df["hash_ids"].fill_null([])
    sizes = hashes.list.len().to_numpy().astype(np.int64)
    off = np.zeros(df.height + 1, dtype=np.int64)
    np.cumsum(sizes, out=off[1:])
    flat = hashes.explode().drop_nulls().cast(pl.Int64).to_numpy() if off[-1] else np.zeros(0, np.int64)
    rid = (df["request_id"].to_numpy() if "request_id" in df.columns
           else np.arange(df.height, dtype=np.int64))
    return RequestLog(ts, df["input_length"].cast(pl.Int64).to_numpy(),
                      df["output_length"].cast(pl.Int64).to_numpy(), off, flat, rid,
                      block_size, source)


def read_mooncake(path: str | os.PathLike, *, block_size: int = DEFAULT_BLOCK_SIZE,
                  limit: int | None = None) -> RequestLog:
    """Read a Mooncake request log: JSONL (one request a line) or Parquet, same columns."""
    p = Path(path)
    if not p.is_file():
        raise LogError(f"{p}: no such file")
    try:
        if p.suffix == ".parquet":
            df = pl.read_parquet(p)
        else:
            df = pl.read_ndjson(p, schema={"timestamp": pl.Float64, "input_length": pl.Int64,
                                           "output_length": pl.Int64,
                                           "hash_ids": pl.List(pl.Int64)})
    except Exception as err:  # noqa: BLE001 - polars raises many kinds; one line for the user
        where = _bad_jsonl_line(p) if p.suffix != ".parquet" else None
        raise LogError(f"{p}: {where or 'cannot read: ' + str(err).splitlines()[0]}") from None
    if limit is not None:
        df = df.head(int(limit))
    return _from_frame(df, str(p), block_size)


_JSONL_TYPES = {"timestamp": (int, float), "input_length": (int,), "output_length": (int,),
                "hash_ids": (list,)}


def _bad_jsonl_line(p: Path) -> str | None:
    """The first line of a JSONL log that is not a valid request, said in one line (error path)."""
    with open(p, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except ValueError as err:
                return f"line {n}: not valid JSON ({str(err).splitlines()[0]})"
            if not isinstance(rec, dict):
                return f"line {n}: expected a JSON object"
            for k, types in _JSONL_TYPES.items():
                v = rec.get(k)
                if v is None or isinstance(v, bool) or not isinstance(v, types):
                    want = 'a list of integers' if k == 'hash_ids' else 'a number'
                    return f"line {n}: field {k!r} must be {want}, got {v!r}"
                if isinstance(v, list) and not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                    return f"line {n}: field 'hash_ids' must be a list of integers"
    return None


# ---------------------------------------------------------------------------
# The synthetic prefix model (shared system prompts, multi-turn sessions)

def stream_blocks(prompt: np.ndarray, session: np.ndarray, input_tokens: np.ndarray,
                  prompt_tokens: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Block ids of requests whose input is a session's token stream cut at ``input_tokens``.

    A session's stream is its system prompt (``prompt_tokens[prompt]`` tokens,
    shared by every session of that prompt) followed by tokens of its own.  A
    full block inside the prompt is shared by every request of the prompt; a
    later full block by every request of the session; a partial last block is
    the request's own.  Returns CSR ``(offsets, ids)`` with
    ``len = ceil(input_tokens / block_size)`` per request.
    """
    n = input_tokens.shape[0]
    sizes = -(-input_tokens // block_size)
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=off[1:])
    req = np.repeat(np.arange(n, dtype=np.int64), sizes)
    j = np.arange(off[-1], dtype=np.int64) - off[:-1][req]
    end = np.minimum((j + 1) * block_size, input_tokens[req])
    full = end == (j + 1) * block_size
    in_prompt = full & (end <= prompt_tokens[prompt[req]])
    # ids: kind (0 prompt, 1 session, 2 own partial), owner, position -> one int64
    kind = np.where(in_prompt, 0, np.where(full, 1, 2)).astype(np.int64)
    owner = np.where(kind == 0, prompt[req], np.where(kind == 1, session[req], req))
    ids = (kind << 60) | (owner << 24) | j
    return off, ids


def synthetic_prefixes(input_tokens: np.ndarray, ts_ns: np.ndarray, *, seed: int,
                       n_prompts: int = 64, zipf: float = 1.1, prompt_median: int = 1800,
                       p_continue: float = 0.5, session_idle_s: float = 600.0,
                       block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Seeded prefix structure for a log with arrivals and lengths only (Azure).

    Each request picks a system prompt (Zipf popularity over ``n_prompts``,
    prompt lengths lognormal around ``prompt_median`` tokens).  With
    probability ``p_continue`` it continues the most recent session of that
    prompt that was active within ``session_idle_s`` and whose last input was
    shorter (a new turn extends the conversation); otherwise it opens a new
    session.  Blocks then follow :func:`stream_blocks`.
    """
    rng = np.random.default_rng(seed)
    n = int(input_tokens.shape[0])
    pop = 1.0 / np.arange(1, n_prompts + 1) ** zipf
    prompt = rng.choice(n_prompts, size=n, p=pop / pop.sum()).astype(np.int64)
    prompt_tokens = np.round(rng.lognormal(np.log(prompt_median), 0.6, n_prompts)).astype(np.int64)
    cont = rng.random(n) < p_continue
    session = np.zeros(n, dtype=np.int64)
    last: dict[int, tuple[int, int, int]] = {}   # prompt -> (session, last input, last ts)
    next_session = 0
    idle = int(session_idle_s * 1e9)
    for i in range(n):
        k = int(prompt[i])
        s = last.get(k)
        if cont[i] and s is not None and s[1] < input_tokens[i] and ts_ns[i] - s[2] <= idle:
            sid = s[0]
        else:
            sid = next_session
            next_session += 1
        session[i] = sid
        last[k] = (sid, int(input_tokens[i]), int(ts_ns[i]))
    return stream_blocks(prompt, session, input_tokens.astype(np.int64), prompt_tokens, block_size)


def read_csv_log(p: Path, need: tuple[str, ...]) -> pl.DataFrame:
    """A CSV request log with the columns ``need``; one line on a missing file or column."""
    if not p.is_file():
        raise LogError(f"{p}: no such file")
    try:
        df = pl.read_csv(p, infer_schema_length=10000)
    except Exception as err:  # noqa: BLE001 - polars raises many kinds; one line for the user
        raise LogError(f"{p}: cannot read: {str(err).splitlines()[0]}") from None
    for c in need:
        if c not in df.columns:
            raise LogError(f"{p}: missing column {c!r} (need {', '.join(need)})")
    return df


def read_azure(path: str | os.PathLike, *, seed: int = 0, block_size: int = DEFAULT_BLOCK_SIZE,
               limit: int | None = None, **model) -> RequestLog:
    """Read an Azure LLM inference CSV; prefix ids from :func:`synthetic_prefixes` (seeded)."""
    p = Path(path)
    df = read_csv_log(p, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    if limit is not None:
        df = df.head(int(limit))
    try:
        # 2023: "2023-11-16 18:17:03.9799600"; 2024 adds a zone ("+00:00") on some exports
        stamp = df["TIMESTAMP"].cast(pl.String).str.replace(r"(Z|[+-]\d\d:?\d\d)$", "")
        t = stamp.str.to_datetime("%Y-%m-%d %H:%M:%S%.f", time_unit="ns").dt.epoch("ns")
    except Exception as err:  # noqa: BLE001 - polars raises many kinds; one line for the user
        raise LogError(f"{p}: column 'TIMESTAMP': {str(err).splitlines()[0]}") from None
    ts = t.to_numpy().astype(np.int64)
    ts = ts - ts.min() if ts.size else ts
    L = df["ContextTokens"].cast(pl.Int64).to_numpy()
    out = df["GeneratedTokens"].cast(pl.Int64).to_numpy()
    order = np.argsort(ts, kind="stable")
    ts, L, out = ts[order], L[order], out[order]
    off, ids = synthetic_prefixes(L, ts, seed=seed, block_size=block_size, **model)
    return RequestLog(ts, L, out, off, ids, order.astype(np.int64), block_size, str(p))


# ---------------------------------------------------------------------------
# Seeded generator

def generate_log(n_requests: int, *, seed: int = 0, rate_per_s: float = 20.0,
                 n_prompts: int = 24, turns_mean: float = 3.0, think_s: float = 8.0,
                 block_size: int = DEFAULT_BLOCK_SIZE) -> RequestLog:
    """A seeded synthetic log: multi-turn sessions over shared system prompts.

    Sessions start as a Poisson process; each has a Zipf-popular system
    prompt (lognormal length, median 1500 tokens), 1 + geometric turns (mean
    ``turns_mean``) separated by exponential think times (mean ``think_s``
    plus the previous answer); turn ``k``'s input is the prompt, every earlier
    user message and answer, and a new user message (lognormal, median 300
    tokens); answers are lognormal (median 150 tokens).  The request rate is
    about ``rate_per_s``.
    """
    rng = np.random.default_rng(seed)
    pop = 1.0 / np.arange(1, n_prompts + 1) ** 1.1
    prompt_tokens = np.round(rng.lognormal(np.log(1500), 0.7, n_prompts)).astype(np.int64)
    rows: list[tuple[int, int, int, int, int]] = []  # ts, prompt, session, L, out
    t = 0.0
    s = 0
    p_stop = 1.0 / max(turns_mean, 1.0)
    while len(rows) < n_requests:
        t += rng.exponential(turns_mean / rate_per_s)
        k = int(rng.choice(n_prompts, p=pop / pop.sum()))
        L = int(prompt_tokens[k])
        t_req = t
        while len(rows) < n_requests:
            L += int(np.round(rng.lognormal(np.log(300), 0.9))) + 1
            out = int(np.round(rng.lognormal(np.log(150), 0.8))) + 1
            rows.append((int(t_req * 1e9), k, s, L, out))
            L += out
            t_req += rng.exponential(think_s) + out / 40.0
            if rng.random() < p_stop or L > 60_000:
                break
        s += 1
    arr = np.array(rows, dtype=np.int64)
    order = np.argsort(arr[:, 0], kind="stable")
    arr = arr[order]
    ts = (arr[:, 0] // NS_PER_MS) * NS_PER_MS  # whole milliseconds, as Mooncake stores them
    off, ids = stream_blocks(arr[:, 1], arr[:, 2], arr[:, 3], prompt_tokens, block_size)
    # readable ids: number blocks by first appearance (Mooncake style)
    _, first, inv = np.unique(ids, return_index=True, return_inverse=True)
    rank = np.empty(first.shape[0], dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(first.shape[0])
    ids = rank[inv.reshape(-1)]
    return RequestLog(ts, arr[:, 3].copy(), arr[:, 4].copy(), off, ids,
                      np.arange(arr.shape[0], dtype=np.int64), block_size, f"generate_log(seed={seed})")


def write_mooncake_jsonl(log: RequestLog, path: str | os.PathLike) -> None:
    """Write ``log`` as Mooncake JSONL (ms timestamps, dense block ids as ``hash_ids``)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w") as f:
        for i in range(log.n_requests):
            ids = log.hash_ids[log.hash_off[i]:log.hash_off[i + 1]].tolist()
            f.write(json.dumps({"timestamp": int(log.ts_ns[i] // NS_PER_MS),
                                "input_length": int(log.input_tokens[i]),
                                "output_length": int(log.output_tokens[i]),
                                "hash_ids": ids}, separators=(", ", ": ")) + "\n")
