"""Fleet descriptions for the simulator: a small TOML or JSON file plus CLI overrides.

Format (TOML; the same keys in a JSON object)::

    model = "default"
    workers = 8                      # prefill (or plain) workers
    dp_size = 2                      # data-parallel ranks per worker
    prefill_tokens_per_s = 12000     # per rank: uncached prompt tokens per second
    decode_tokens_per_s = 40         # per rank: decode steps per second (one token per running request)
    max_running_requests = 32        # per rank
    max_total_num_tokens = 200000    # per rank: KV capacity in tokens
    decode_peers = 0                 # decode workers listed in workers.parquet (see docs/simulator.md)

    # engine model options (docs/simulator.md); the defaults are sglang 0.5.23's
    load_balance_method = "round_robin"  # data-parallel dispatch inside a worker (see below)
    max_prefill_tokens = 16384       # prompt tokens one prefill step may admit
    chunked_prefill_size = 4096      # unset: resolved from gpu_memory_gb as SGLang does (0: off)
    gpu_memory_gb = 80               # optional; only resolves chunked_prefill_size
    schedule_policy = "fcfs"         # waiting-queue order: "fcfs" or "lpm" (SGLang's policies)
    schedule_conservativeness = 1.0  # scales new_token_ratio's initial value
    init_new_token_ratio = 0.7       # the KV reserved per running decode's output left
    min_new_token_ratio_factor = 0.14
    new_token_ratio_decay_steps = 600
    retraction_policy = "length"     # which running request decode retracts when KV runs out
    enable_mixed_chunk = false       # running decodes ride in prefill steps
    decode_step_ms_per_request = 0.0 # a decode step grows by this per running request beyond the first
    publish_policy = "interval"      # "interval": every publish_interval_ms; "on_change": 1 ms after
                                     # each change; "sglang": SGLang's own LoadStat cadence
    publish_interval_ms = 100        # interval policy (the --publish-interval-ms flag overrides it)
    idle_publish_ms = 1000           # on_change and sglang: a heartbeat after this long without a change

    [[worker]]                       # optional per-worker overrides, by index
    index = 3
    prefill_tokens_per_s = 6000

Every top-level key may be overridden from the command line (an override applies to every
worker, replacing the ``[[worker]]`` tables' value of that key); unknown keys are an error.
File values and overrides pass one validator.  Worker URLs are ``http://sim-prefill-NNN:30000`` (decode peers
``http://sim-decode-NNN:30000``), so the replay's worker ids (sorted URLs)
follow the index.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from replay.errors import ParamError, ReplayError
from replay.trace.base import MAX_DP_SIZE


class FleetError(ReplayError):
    """A fleet description that cannot be used; one line."""


@dataclass(frozen=True)
class WorkerSpec:
    """One simulated worker; rates and capacities are per data-parallel rank."""

    url: str
    dp_size: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    max_running_requests: int
    max_total_num_tokens: int
    role: str = "plain"
    model: str = "default"
    decode_step_ms_per_request: float = 0.0
    chunked_prefill_size: int = 4096
    schedule_policy: str = "fcfs"
    max_prefill_tokens: int = 16384
    schedule_conservativeness: float = 1.0
    enable_mixed_chunk: bool = False


SCHEDULE_POLICIES = ("fcfs", "lpm")
PUBLISH_POLICIES = ("interval", "on_change", "sglang")
# in-worker data-parallel dispatch: SGLang's --load-balance-method values (``auto``
# resolves to round_robin without prefill/decode disaggregation), the DP-aware
# router's choice, and this simulator's original rule
LOAD_BALANCE_METHODS = ("round_robin", "total_requests", "total_tokens", "follow_bootstrap_room",
                        "router", "prefix_affinity")
RETRACTION_POLICIES = ("length",)
# sglang 0.5.23's chunked_prefill_size by device memory (GiB, upper bounds); unknown: 4096
_CHUNK_BY_GPU_GB = ((20, 2048), (35, 4096), (60, 4096), (90, 8192), (160, 8192))
UNKNOWN_GPU_CHUNK = 4096


def default_chunked_prefill_size(gpu_memory_gb: float | None) -> int:
    """SGLang's default ``chunked_prefill_size`` for a device of this much memory
    (GiB); 4096 when the memory is unknown, as SGLang resolves it then."""
    if gpu_memory_gb is None:
        return UNKNOWN_GPU_CHUNK
    for below, size in _CHUNK_BY_GPU_GB:
        if gpu_memory_gb < below:
            return size
    return 16384


@dataclass(frozen=True)
class FleetSpec:
    """The fleet-wide defaults of a fleet file (what the CLI can override)."""

    workers: int = 8
    dp_size: int = 1
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 40.0
    max_running_requests: int = 32
    max_total_num_tokens: int = 200_000
    decode_peers: int = 0
    model: str = "default"
    decode_step_ms_per_request: float = 0.0
    chunked_prefill_size: int | None = None
    schedule_policy: str = "fcfs"
    publish_policy: str = "interval"
    publish_interval_ms: int | None = None
    idle_publish_ms: int = 1000
    load_balance_method: str = "round_robin"
    max_prefill_tokens: int = 16384
    gpu_memory_gb: float | None = None
    schedule_conservativeness: float = 1.0
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    retraction_policy: str = "length"
    enable_mixed_chunk: bool = False

    @property
    def chunk(self) -> int:
        """``chunked_prefill_size`` as the engine resolves it (0: off)."""
        v = self.chunked_prefill_size
        return default_chunked_prefill_size(self.gpu_memory_gb) if v is None else max(int(v), 0)


_KEYS = {f.name for f in fields(FleetSpec)}
_ENGINE_KEYS = ("decode_step_ms_per_request", "chunked_prefill_size", "schedule_policy",
                "max_prefill_tokens", "schedule_conservativeness", "enable_mixed_chunk")
_WORKER_KEYS = {"index", "dp_size", "prefill_tokens_per_s", "decode_tokens_per_s",
                "max_running_requests", "max_total_num_tokens", *_ENGINE_KEYS}
DEFAULT_PUBLISH_INTERVAL_MS = 100
_MAX_INT = 2**53  # knobs, intervals and capacities beyond this are refused (int64 ns arithmetic)
# simulator memory per data-parallel rank, at least: peak RSS grew by 260 MB from 32 workers x 1 rank
# to 32 x 1,024 ranks on a 300-request log (more per rank on smaller fleets: fixed costs)
RANK_BYTES = 8 * 1024


@dataclass(frozen=True)
class Fleet:
    """Workers in replay id order (sorted URL); ``fleet`` members are not decode peers."""

    workers: tuple[WorkerSpec, ...]
    spec: FleetSpec

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    @property
    def prefill(self) -> list[int]:
        return [i for i, w in enumerate(self.workers) if w.role != "decode"]

    @property
    def publish_interval_ms(self) -> int:
        v = self.spec.publish_interval_ms
        return DEFAULT_PUBLISH_INTERVAL_MS if v is None else int(v)

    def describe(self) -> dict:
        return {"spec": self.spec.__dict__.copy(),
                "workers": [w.__dict__.copy() for w in self.workers]}


def prefill_url(i: int) -> str:
    return f"http://sim-prefill-{i:03d}:30000"


def decode_url(i: int) -> str:
    return f"http://sim-decode-{i:03d}:30000"


def _check(spec: FleetSpec, where: str, given: frozenset[str] = frozenset()) -> None:
    """The one validator of fleet values, whether a fleet file or an override gave them: a key in
    ``given`` came from an override, and its error names the parameter (:class:`ParamError`)."""
    def bad(k, what):
        if k in given:
            raise ParamError(k, f"must be {what}, got {getattr(spec, k)!r}")
        raise FleetError(f"{where}: {k} must be {what}, got {getattr(spec, k)!r}")

    if not _is_int(spec.workers) or spec.workers < 1 or spec.workers > 999:
        bad("workers", "an integer in 1..999")
    if not _is_int(spec.dp_size) or spec.dp_size < 1:
        bad("dp_size", f"an integer in 1..{MAX_DP_SIZE:,}")
    if spec.dp_size > MAX_DP_SIZE:
        bad("dp_size", dp_size_limit(spec.dp_size, spec.workers))
    for k in ("max_running_requests", "max_total_num_tokens", "idle_publish_ms"):
        v = getattr(spec, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v > _MAX_INT:
            bad(k, "an integer in 1..2**53")
    v = spec.publish_interval_ms
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1 or v > 10**9):
        bad("publish_interval_ms", "an integer in 1..10**9")
    v = spec.chunked_prefill_size
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < -1 or v > _MAX_INT):
        bad("chunked_prefill_size", "an integer >= 0 (0 or -1: off)")
    for k in ("max_prefill_tokens", "new_token_ratio_decay_steps"):
        v = getattr(spec, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v > _MAX_INT:
            bad(k, "an integer in 1..2**53")
    v = spec.gpu_memory_gb
    if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 1e6):
        bad("gpu_memory_gb", "a positive number of GiB")
    for k in ("schedule_conservativeness", "init_new_token_ratio", "min_new_token_ratio_factor"):
        v = getattr(spec, k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 100:
            bad(k, "a number in 0..100")
    if not isinstance(spec.enable_mixed_chunk, bool):
        bad("enable_mixed_chunk", "true or false")
    if spec.load_balance_method not in LOAD_BALANCE_METHODS:
        bad("load_balance_method", ", ".join(repr(p) for p in LOAD_BALANCE_METHODS))
    if spec.retraction_policy not in RETRACTION_POLICIES:
        bad("retraction_policy", " or ".join(repr(p) for p in RETRACTION_POLICIES)
            + " (priority retraction needs priority scheduling, which is not modelled)")
    for k in ("prefill_tokens_per_s", "decode_tokens_per_s"):
        v = getattr(spec, k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 1e-3 <= v <= 1e12:
            bad(k, "a number in 0.001..1e12")
    v = spec.decode_step_ms_per_request
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1e9:
        bad("decode_step_ms_per_request", "a finite number >= 0")
    if spec.schedule_policy not in SCHEDULE_POLICIES:
        bad("schedule_policy", " or ".join(repr(p) for p in SCHEDULE_POLICIES))
    if spec.publish_policy not in PUBLISH_POLICIES:
        bad("publish_policy", " or ".join(repr(p) for p in PUBLISH_POLICIES))
    if not _is_int(spec.decode_peers) or spec.decode_peers < 0 or spec.decode_peers > 999:
        bad("decode_peers", "an integer in 0..999")
    if not isinstance(spec.model, str) or not spec.model:
        bad("model", "a non-empty string")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def rank_state_bytes(ranks: int) -> int:
    """What the simulator holds per data-parallel rank of a fleet, roughly (bytes): measured
    growth of peak memory with the rank count (benches/README.md, "Memory per rank")."""
    return ranks * RANK_BYTES


def dp_size_limit(dp_size: int, workers: int | None) -> str:
    """Why a dp_size above :data:`MAX_DP_SIZE` is refused: the limit, and the memory it would need
    (for ``workers`` workers; per worker when not known yet)."""
    need = rank_state_bytes(dp_size * (workers or 1))
    size = f"{need / 2**30:,.1f} GiB" if need >= 2**30 else f"{need / 2**20:,.0f} MiB"
    who = f"{workers:,} worker(s) x {dp_size:,} ranks" if workers else f"each worker's {dp_size:,} ranks"
    return (f"at most {MAX_DP_SIZE:,} (the largest dp_size a trace may have; {who} would need at least "
            f"{size} of simulator state, {RANK_BYTES // 1024} KiB per rank)")


def build_fleet(spec: FleetSpec, overrides_by_index: Mapping[int, Mapping[str, Any]] | None = None,
                where: str = "fleet", given: frozenset[str] = frozenset()) -> Fleet:
    """Expand a :class:`FleetSpec` (plus per-worker overrides) into workers; ``given``: the keys
    an override set (their errors name the parameter, not ``where``)."""
    _check(spec, where, given)
    role = "prefill" if spec.decode_peers else "plain"
    out = []
    for i in range(spec.workers):
        kw: dict[str, Any] = dict(dp_size=spec.dp_size, prefill_tokens_per_s=float(spec.prefill_tokens_per_s),
                  decode_tokens_per_s=float(spec.decode_tokens_per_s),
                  max_running_requests=spec.max_running_requests,
                  max_total_num_tokens=spec.max_total_num_tokens,
                  **{k: getattr(spec, k) for k in _ENGINE_KEYS})
        kw["chunked_prefill_size"] = spec.chunk
        for k, v in (overrides_by_index or {}).get(i, {}).items():
            kw[k] = v
        if kw["chunked_prefill_size"] is not None and kw["chunked_prefill_size"] < 0:
            kw["chunked_prefill_size"] = 0
        w = WorkerSpec(prefill_url(i), role=role, model=spec.model, **kw)
        _check(replace(spec, **{k: getattr(w, k) for k in kw}), f"{where}: worker {i}")
        out.append(w)
    for i in range(spec.decode_peers):
        out.append(WorkerSpec(decode_url(i), 1, float(spec.prefill_tokens_per_s),
                              float(spec.decode_tokens_per_s), spec.max_running_requests,
                              spec.max_total_num_tokens, role="decode", model=spec.model))
    out.sort(key=lambda w: w.url)
    return Fleet(tuple(out), spec)


def load_fleet(path: str | os.PathLike | None = None, *, resize: bool = False,
               **overrides: Any) -> Fleet:
    """Read a fleet file (TOML, or JSON by suffix) and apply non-None ``overrides``.

    ``resize`` (capacity planning, ``replay.simulate.plan``): a ``workers`` override
    gives worker ``i`` the file's ``[[worker]]`` entry ``i mod n`` (n: the
    file's workers), and a ``dp_size`` override applies to every worker; the
    per-rank rates and capacities are kept."""
    data: dict[str, Any] = {}
    where = "fleet"
    if path is not None:
        p = Path(path)
        where = str(p)
        if not p.is_file():
            raise FleetError(f"{p}: no such file")
        try:
            data = json.loads(p.read_text()) if p.suffix == ".json" else tomllib.loads(p.read_text())
        except (ValueError, tomllib.TOMLDecodeError) as err:
            raise FleetError(f"{p}: cannot parse: {str(err).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise FleetError(f"{p}: expected a table of fleet keys")
    per_worker: dict[int, dict[str, Any]] = {}
    for entry in data.pop("worker", []) or []:
        if not isinstance(entry, dict) or "index" not in entry:
            raise FleetError(f"{where}: every [[worker]] entry needs an index")
        unknown = set(entry) - _WORKER_KEYS
        if unknown:
            raise FleetError(f"{where}: unknown [[worker]] key {sorted(unknown)[0]!r}; "
                             f"known: {', '.join(sorted(_WORKER_KEYS))}")
        idx = entry["index"]
        if not isinstance(idx, int) or isinstance(idx, bool):
            raise FleetError(f"{where}: [[worker]] index must be an integer, got {idx!r}")
        if idx in per_worker:
            raise FleetError(f"{where}: two [[worker]] tables with index = {idx}")
        per_worker[idx] = {k: v for k, v in entry.items() if k != "index"}
    unknown = set(data) - _KEYS
    if unknown:
        raise FleetError(f"{where}: unknown key {sorted(unknown)[0]!r}; known: {', '.join(sorted(_KEYS))}")
    n_file = data.get("workers", FleetSpec.workers)
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(given) - _KEYS
    if unknown:
        raise ParamError(sorted(unknown)[0], f"is not a fleet key; known: {', '.join(sorted(_KEYS))}")
    _check(replace(FleetSpec(), **given), where, frozenset(given))      # an override's own error first
    _check(FleetSpec(**data), where)
    spec = FleetSpec(**{**data, **given})
    if resize and per_worker and _is_int(n_file) and n_file >= 1:
        # REPLAY CHOICE: a resized fleet repeats the calibrated workers in index order
        # (heterogeneous rates stay in the mix)
        per_worker = {i: per_worker[i % n_file] for i in range(spec.workers) if (i % n_file) in per_worker}
    # an override applies to every worker: it replaces the [[worker]] tables' own values
    per_worker = {i: {k: v for k, v in kw.items() if k not in given} for i, kw in per_worker.items()}
    bad = [i for i in per_worker if not 0 <= i < spec.workers]
    if bad:
        raise FleetError(f"{where}: [[worker]] index {bad[0]} outside 0..{spec.workers - 1}")
    return build_fleet(spec, per_worker, where, frozenset(given))
