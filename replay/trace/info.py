"""``trace.json``: how production was configured (router flags, block size, source).

Schema (every key optional; any other key is an error)::

    {"router": {"worker_queue_limit": 8, "saturation_queue_floor": 2},
     "page_size": 16, "source": "free text", "per_dp_rank": false, "extra": {...}}

``router`` maps knob names (``replay.config.KNOBS``; ``-`` or ``_``) to values
as ``RouterConfig`` holds them; a knob not listed was not given (the router's
default); the values pass the router's own CLI checks.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field

from replay.config import KNOBS, RouterConfig, validate_router_flags
from replay.errors import ConfigError
from replay.trace.base import MAX_INT32, TRACE_JSON, TraceError, one_line

KEYS = ("router", "page_size", "source", "per_dp_rank", "extra")


@dataclass(frozen=True)
class TraceInfo:
    """The parsed ``trace.json`` (all empty when the trace has none)."""

    router: dict = field(default_factory=dict)   # knob name -> value, the flags production gave
    page_size: int | None = None
    source: str | None = None
    per_dp_rank: bool = False
    extra: dict = field(default_factory=dict)
    path: str | None = None                       # the file, None when absent
    router_given: bool = False                    # whether the file has a "router" object (even empty)

    def router_config(self) -> RouterConfig:
        """The production router's settings as a :class:`~replay.RouterConfig`
        (knobs not listed keep the router's defaults)."""
        return RouterConfig(**self.router)


def _fail(key: str, msg: str):
    raise TraceError(f"{TRACE_JSON}: key '{key}': {msg}")


def _knob_value(name: str, v):
    spec = KNOBS[name]
    key = f"router.{name}"
    if v is None:
        if not spec.nullable:
            _fail(key, f"must not be null (the router has no unset value for {spec.flag})")
        return None
    null = " or null" if spec.nullable else ""
    if spec.kind == "bool":
        if not isinstance(v, bool):
            _fail(key, f"must be true or false{null}, got {json.dumps(v)}")
        return v
    if spec.kind == "choice":
        if not isinstance(v, str) or v not in spec.choices:
            _fail(key, f"must be one of {', '.join(spec.choices)}, got {one_line(json.dumps(v))}")
        return v
    if spec.kind == "int":
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63:
            _fail(key, f"must be an integer >= 0{null}, got {one_line(json.dumps(v))}")
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        _fail(key, f"must be a finite number{null}, got {one_line(json.dumps(v))}")
    return float(v)


def parse_trace_info(obj, path: str | None = None) -> TraceInfo:
    """Check a ``trace.json`` object (see the module doc)."""
    if not isinstance(obj, dict):
        raise TraceError(f"{TRACE_JSON}: must be a JSON object, got {type(obj).__name__}")
    for k in obj:
        if k not in KEYS:
            _fail(k, f"unknown key (known: {', '.join(KEYS)})")
    router_in = obj.get("router", {})
    if not isinstance(router_in, dict):
        _fail("router", f"must be an object of router flags, got {one_line(json.dumps(router_in))}")
    router: dict = {}
    for k, v in router_in.items():
        name = str(k).lstrip("-").replace("-", "_")
        if name == "disable_pressure_guard":
            _fail(f"router.{k}", "give the knob as \"pressure_guard\": false")
        if name not in KNOBS:
            _fail(f"router.{k}", f"unknown router knob (known: {', '.join(n for n in KNOBS if KNOBS[n].router)})")
        if not KNOBS[name].router:
            _fail(f"router.{k}", f"{KNOBS[name].flag} is a replay-only policy variant, not a flag the router "
                  "takes (give it to sweep or simulate)")
        if name in router:
            _fail(f"router.{k}", "given twice")
        router[name] = _knob_value(name, v)
    try:
        validate_router_flags(router)
    except ConfigError as err:
        _fail("router", f"the router would refuse these flags: {err}")
    page = obj.get("page_size")
    if "page_size" in obj and (isinstance(page, bool) or not isinstance(page, int) or not 1 <= page <= MAX_INT32):
        _fail("page_size", f"must be an integer >= 1, got {one_line(json.dumps(page))}")
    source = obj.get("source")
    if "source" in obj and not isinstance(source, str):
        _fail("source", f"must be a string, got {one_line(json.dumps(source))}")
    per_rank = obj.get("per_dp_rank", False)
    if not isinstance(per_rank, bool):
        _fail("per_dp_rank", f"must be true or false, got {one_line(json.dumps(per_rank))}")
    extra = obj.get("extra", {})
    if not isinstance(extra, dict):
        _fail("extra", f"must be an object, got {one_line(json.dumps(extra))}")
    return TraceInfo({k: router[k] for k in KNOBS if k in router}, page, source, per_rank, extra, path,
                     "router" in obj)


def read_trace_info(dirpath: str | os.PathLike) -> TraceInfo:
    """``DIR/trace.json`` checked, or an empty :class:`TraceInfo` when absent."""
    path = os.path.join(os.fspath(dirpath), TRACE_JSON)
    if not os.path.lexists(path):
        return TraceInfo()
    if not os.path.isfile(path):
        raise TraceError(f"{TRACE_JSON}: not a readable regular file: {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
    except (OSError, UnicodeDecodeError) as err:
        raise TraceError(f"{TRACE_JSON}: unreadable ({type(err).__name__}: {one_line(err)})") from None
    except json.JSONDecodeError as err:
        raise TraceError(f"{TRACE_JSON}: not valid JSON (line {err.lineno} column {err.colno}: "
                         f"{err.msg})") from None
    except RecursionError:
        raise TraceError(f"{TRACE_JSON}: nested too deeply to read (more than Python's "
                         f"{sys.getrecursionlimit():,} levels)") from None
    return parse_trace_info(obj, os.path.abspath(path))
