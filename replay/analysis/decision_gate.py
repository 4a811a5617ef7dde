"""The decisions a baseline holds, and which of them a new run changed.

A replay is deterministic: the same trace, settings and router logic give the
same decision for every request.  ``check`` therefore holds a run to its
baseline's *decisions*, not only to its metrics: per config and request, the
chosen worker, the decision label, whether the saturation pin fired, whether
the queue gate diverted the request, and the 503 reason (:data:`FIELDS`).

The baseline stores them compactly inside its JSON (one file to check in):
the distinct outcomes once (``outcomes``), and per config the outcome index
of every request in trace order as little-endian int32, zlib-compressed and
base64-encoded.  Request ids are not stored: the run must have replayed the
same trace files (sha256), so its own decisions name the requests.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from replay import labels
from replay.errors import ReplayError
from replay.runs import decisions as decision_store
from replay.runs.rundir import Run

FIELDS = ("worker", "decision", "pinned", "diverted", "failure")
"""The parts of a decision the gate compares, in the order outcomes are stored."""

WORDS = {"worker": "worker", "decision": "label", "pinned": "pin", "diverted": "divert", "failure": "503"}
"""What the output calls each field."""

ENCODING = "outcome-index/int32-le/zlib/base64"

_NEEDED = ("request_id", "config_id", "worker", "decision", "reason", "failure", "gate_rejected", "fell_back",
           "pressure_source")


def outcome_frame(run: Run, config_ids: Sequence[int] | None = None) -> pl.DataFrame:
    """One row per (config, request) of ``run``'s decisions: ``config_id``, ``pos``
    (the request's position in trace order), ``request_id`` and :data:`FIELDS`.

    ``pinned``: the saturation pin chose the worker; ``diverted``: the queue gate
    turned the request away from a cache candidate and no fall-back tier took it
    (as the summary's ``diverted`` counts); ``failure``: the 503 reason, null
    when routed.  Raises :class:`ReplayError` when the run kept no decisions.
    """
    if run.decisions is None:
        raise ReplayError(f"{run.path}: the run kept no decisions")
    have = set(decision_store.columns_of(run.decisions[0]))
    missing = [c for c in _NEEDED if c not in have]
    if missing:
        raise ReplayError(f"{run.decisions[0]}: no column {missing[0]!r} (written by an earlier version); "
                          f"rerun the sweep")
    lf = decision_store.scan_decisions(run.decisions, list(_NEEDED))
    lf = lf.with_columns(pl.col("config_id").cast(pl.Int64))
    if config_ids is not None:
        lf = lf.filter(pl.col("config_id").is_in(list(config_ids)))
    pinned = (pl.col("reason").cast(pl.Utf8) == labels.REASONS[labels.SATURATION_PIN]).fill_null(False)
    diverted = (~pinned & (pl.col("gate_rejected") > 0) & (pl.col("fell_back").cast(pl.Int64) == 0)
                & pl.col("pressure_source").is_not_null()).fill_null(False)
    return (lf.select("config_id", "request_id",
                      pl.col("worker").cast(pl.Utf8), pl.col("decision").cast(pl.Utf8),
                      pinned.alias("pinned"), diverted.alias("diverted"), pl.col("failure").cast(pl.Utf8))
            .with_columns(pl.int_range(pl.len(), dtype=pl.Int64).over("config_id").alias("pos"))
            .collect())


def encode(frame: pl.DataFrame) -> dict:
    """The ``decisions`` record of a baseline from :func:`outcome_frame` (keyed by the run's config ids)."""
    keys = frame.select(FIELDS).unique(maintain_order=True).with_row_index("code")
    coded = (frame.select("config_id", "pos", *FIELDS)
             .join(keys, on=list(FIELDS), how="left", nulls_equal=True)
             .sort("config_id", "pos"))
    configs = {}
    requests = None
    for (cid,), part in coded.group_by("config_id", maintain_order=True):
        codes = part["code"].to_numpy().astype("<i4")
        requests = len(codes) if requests is None else requests
        if len(codes) != requests:
            raise ReplayError(f"config {cid}: {len(codes)} decisions, other configs {requests}")
        configs[str(cid)] = base64.b64encode(zlib.compress(codes.tobytes(), 9)).decode("ascii")
    return {"fields": list(FIELDS), "encoding": ENCODING, "requests": requests or 0,
            "outcomes": [list(r) for r in keys.select(FIELDS).iter_rows()], "configs": configs}


def check_record(rec: object, where: object) -> None:
    """Raise :class:`ReplayError` unless ``rec`` is a readable ``decisions`` record."""
    if not isinstance(rec, dict) or rec.get("encoding") != ENCODING or rec.get("fields") != list(FIELDS):
        raise ReplayError(f"{where}: decisions record not in the form this version reads ({ENCODING})")
    if not isinstance(rec.get("outcomes"), list) or not isinstance(rec.get("configs"), dict):
        raise ReplayError(f"{where}: decisions record lacks outcomes or configs")
    if not isinstance(rec.get("requests"), int) or rec["requests"] < 0:
        raise ReplayError(f"{where}: decisions record has no request count")


def decode(rec: Mapping, mapping: Mapping[int, int], where: object) -> pl.DataFrame:
    """The baseline's decisions as :func:`outcome_frame` (without ``request_id``), for the
    baseline configs in ``mapping`` (baseline config id -> the run's config id)."""
    check_record(rec, where)
    outcomes = pl.DataFrame([list(o) for o in rec["outcomes"]], schema={
        "worker": pl.Utf8, "decision": pl.Utf8, "pinned": pl.Boolean, "diverted": pl.Boolean,
        "failure": pl.Utf8}, orient="row").with_row_index("code")
    parts = []
    for base_id, run_id in mapping.items():
        blob = rec["configs"].get(str(base_id))
        if blob is None:
            raise ReplayError(f"{where}: no decisions stored for baseline config {base_id}")
        try:
            codes = np.frombuffer(zlib.decompress(base64.b64decode(blob)), dtype="<i4")
        except (ValueError, zlib.error) as err:
            raise ReplayError(f"{where}: decisions of config {base_id} unreadable ({err})") from None
        if len(codes) != rec["requests"] or (len(codes) and not 0 <= codes.min() <= codes.max() < outcomes.height):
            raise ReplayError(f"{where}: decisions of config {base_id} are corrupt")
        parts.append(pl.DataFrame({"config_id": np.full(len(codes), run_id, dtype=np.int64),
                                   "pos": np.arange(len(codes), dtype=np.int64),
                                   "code": codes.astype(np.uint32)}))
    frame = pl.concat(parts) if parts else pl.DataFrame(schema={"config_id": pl.Int64, "pos": pl.Int64,
                                                                "code": pl.UInt32})
    return frame.join(outcomes, on="code", how="left").drop("code").sort("config_id", "pos")


@dataclass
class Drift:
    """What :func:`compare` found: ``per_config`` (one row per checked config with
    ``config``, ``changed`` and per field ``<field>_changed``; ``pinned``,
    ``diverted``, ``failed`` as baseline and run counts), ``first`` (the first
    changed requests in trace order, as dicts), and totals."""

    configs: int
    requests: int
    per_config: pl.DataFrame
    first: list[dict] = field(default_factory=list)
    allowed: bool = False

    @property
    def changed(self) -> int:
        """Changed (config, request) decisions in all."""
        return int(self.per_config["changed"].sum()) if self.per_config.height else 0

    @property
    def configs_changed(self) -> int:
        return int((self.per_config["changed"] > 0).sum()) if self.per_config.height else 0

    def total(self, col: str) -> int:
        return int(self.per_config[col].sum()) if self.per_config.height else 0

    def headline(self) -> str:
        """One line: identical, or how many decisions changed and how."""
        checked = f"{self.configs} configs x {self.requests:,} requests"
        if not self.changed:
            return f"decisions identical ({checked})"
        parts = [f"{self.total(f + '_changed'):,} {WORDS[f]}" for f in ("worker", "decision")
                 if self.total(f + "_changed")]
        for f, word in (("pinned", "pins"), ("diverted", "diverts"), ("failed", "503s")):
            a, b = self.total(f"{f}_base"), self.total(f"{f}_run")
            if a != b:
                parts.append(f"{word} {a:,} -> {b:,} ({b - a:+,})")
        return (f"{self.changed:,} decisions changed in {self.configs_changed} of {self.configs} configs "
                f"({', '.join(parts) or 'pin/divert/503 moved'})")

    def request_lines(self, limit: int = 5) -> list[str]:
        """The first changed requests, one line each: config, request, what changed."""
        out = []
        for r in self.first[:limit]:
            what = "; ".join(f"{WORDS[f]} {_show(r[f + '_base'])} -> {_show(r[f])}" for f in FIELDS
                             if r[f + "_base"] != r[f])
            out.append(f"request {r['request_id']} (#{r['pos'] + 1}) under {r['config']}: {what}")
        return out

    def to_json(self) -> dict:
        return {"configs": self.configs, "requests": self.requests, "changed": self.changed,
                "configs_changed": self.configs_changed, "allowed": self.allowed,
                "totals": {f: {"baseline": self.total(f"{f}_base"), "run": self.total(f"{f}_run")}
                           for f in ("pinned", "diverted", "failed")},
                "first_changed": [{k: (v if not isinstance(v, np.generic) else v.item()) for k, v in r.items()}
                                  for r in self.first],
                "per_config": self.per_config.to_dicts()}


def _show(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def compare(base: pl.DataFrame, run: pl.DataFrame, config_names: Mapping[int, str], *, first: int = 10) -> Drift:
    """Compare :func:`decode` of a baseline with :func:`outcome_frame` of a run (both keyed
    by the run's config ids); ``config_names`` labels the run's configs."""
    j = run.join(base, on=["config_id", "pos"], how="inner", suffix="_base")
    if j.height != base.height:
        raise ReplayError(f"the run holds {run.height // max(1, len(config_names)):,} requests per config, "
                          f"the baseline {base.height // max(1, len(config_names)):,}")
    diffs = {f: pl.col(f).ne_missing(pl.col(f + "_base")) for f in FIELDS}
    j = j.with_columns(*(d.alias(f"{f}_changed") for f, d in diffs.items()))
    j = j.with_columns(pl.any_horizontal([pl.col(f"{f}_changed") for f in FIELDS]).alias("changed"))
    names = pl.DataFrame({"config_id": list(config_names), "config": list(config_names.values())},
                         schema={"config_id": pl.Int64, "config": pl.Utf8})
    per = (j.group_by("config_id", maintain_order=True)
           .agg(pl.col("changed").sum().cast(pl.Int64),
                *(pl.col(f"{f}_changed").sum().cast(pl.Int64) for f in FIELDS),
                pl.col("pinned_base").sum().cast(pl.Int64), pl.col("pinned").sum().cast(pl.Int64).alias("pinned_run"),
                pl.col("diverted_base").sum().cast(pl.Int64),
                pl.col("diverted").sum().cast(pl.Int64).alias("diverted_run"),
                pl.col("failure_base").is_not_null().sum().cast(pl.Int64).alias("failed_base"),
                pl.col("failure").is_not_null().sum().cast(pl.Int64).alias("failed_run"))
           .join(names, on="config_id", how="left").sort("config_id"))
    per = per.select("config_id", "config", *[c for c in per.columns if c not in ("config_id", "config")])
    firsts = (j.filter("changed").sort("pos", "config_id").head(first)
              .join(names, on="config_id", how="left")
              .select("config", "config_id", "request_id", "pos", *FIELDS, *(f + "_base" for f in FIELDS)))
    requests = int(base.height // max(1, per.height)) if per.height else 0
    return Drift(per.height, requests, per, firsts.with_columns(pl.col("request_id").cast(pl.Utf8)).to_dicts())
