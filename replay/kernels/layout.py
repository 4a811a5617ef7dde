"""Every array the kernels see, named in one place (the role vectorbt's ``enums.py`` plays).

The kernels take numpy arrays and scalars only, grouped into the named tuples
below, and index their matrices with the column constants below; none of them
is typed by hand in a kernel.  They are derived from two tables:

* the **knob table**, ``replay.config.KNOBS``: a config reaches the kernels as
  :class:`KnobArrays`, one array over the grid's configs per knob, under the
  knob's own name (``knobs.worker_queue_limit[c]``).  :func:`encode_knob`
  turns a value into its kernel form from the knob's kind: ``int`` -> int64
  with None as -1, ``bool`` -> int64 0/1, ``float`` -> float64 with None as
  NaN, ``choice`` -> int64 index into ``KnobSpec.choices``.
* the **field table**, ``replay.fields.DECISION_FIELDS``: one decision of the
  grid pass is a row of ``res_i`` (every integer, bool and label field, in
  table order: ``res_i[u, O_<FIELD>]``) and of ``res_f`` (the float fields:
  ``res_f[u, F_<FIELD>]``), one row per distinct decision of a request.  ``O_WORKER``, ``O_MATCHED_BLOCKS``, ...,
  ``F_SELECTED_QUEUE_MS`` are generated from the table's names.

How to add a knob: add the field to ``RouterConfig`` and its row to
``config.KNOBS`` (that is the whole wiring: the CLI flag, value parsing, the
summary column, the kernel array and the grid's sharing key follow from the
row), then use it: ``knobs.<name>[c]`` in ``kernels/decide.py`` and
``cfg.<name>`` in ``replay/reference.py``.  Every knob other than the limit
and the floor is part of a config's *group* (``kernels/one_pass.py``: configs
of one group prepare their candidates once); a knob that should be shared
differently needs its own rule there.

How to add a decision field: add its row to ``replay/fields.py``, write it in
``one_pass._decide_request`` (``row[O_<NAME>] = ...``) and in
``reference._store``, and give it a column in ``results.DecisionWriter``.

How to add an accumulator: a name in ``ACC_NAMES`` and its booking in
``kernels/accumulate.py``; ``results.Accumulator.summary`` reads it by name.
"""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np

from replay import labels
from replay.config import KNOB_NAMES, KNOBS, KnobSpec
from replay.fields import DECISION_FIELDS

# ---------------------------------------------------------------------------
# Configs: one array per knob (the knob table)

KnobArrays = namedtuple("KnobArrays", KNOB_NAMES, module=__name__)
KnobArrays.__doc__ = "One array over the grid's configs per knob, in ``config.KNOBS`` order (kernel encoding)."

SHARED_KNOBS = ("worker_queue_limit", "saturation_queue_floor")
"""Knobs the grid pass shares outcomes across (limit and floor classes); every
other knob belongs to a config's group."""

GROUP_KNOBS = tuple(k for k in KNOB_NAMES if k not in SHARED_KNOBS)

_KIND_DTYPE = {"int": np.int64, "bool": np.int64, "choice": np.int64, "float": np.float64}


def encode_knob(spec: KnobSpec, value) -> int | float:
    """One knob value in its kernel form (see the module docstring)."""
    if spec.kind == "float":
        return math.nan if value is None else float(value)
    if spec.kind == "bool":
        return int(bool(value))
    if spec.kind == "choice":
        return spec.choices.index(value)
    return -1 if value is None else int(value)


def knob_arrays(rows: list[dict]) -> KnobArrays:
    """:class:`KnobArrays` of configs given as ``{knob: value}`` rows."""
    return KnobArrays(*(
        np.array([encode_knob(KNOBS[k], r[k]) for r in rows], dtype=_KIND_DTYPE[KNOBS[k].kind])
        for k in KNOB_NAMES))


GridPlan = namedtuple("GridPlan", ("group", "li", "fi", "lim_vals", "fl_vals", "parent", "n_groups",
                                   "per_worker"), module=__name__)
GridPlan.__doc__ = """How the grid pass shares work between configs (``kernels/one_pass.py``).

``group[c]``: index of config ``c``'s group (its ``GROUP_KNOBS`` values);
``li[c]``/``fi[c]``: index of its limit / floor in ``lim_vals``/``fl_vals``
(distinct values, -1 = None); ``parent[c]``: the previous config of its group
and limit (``kernels/accumulate.py``); ``n_groups``: number of groups;
``per_worker``: some config uses the per-worker floor-scaling variant (its
gate reads another snapshot column, so its limit and floor classes are
computed as well).
"""

# ---------------------------------------------------------------------------
# Decisions: the field table

INT_FIELDS = tuple(name for name, dtype, _n, _d in DECISION_FIELDS if np.dtype(dtype).kind != "f")
FLOAT_FIELDS = tuple(name for name, dtype, _n, _d in DECISION_FIELDS if np.dtype(dtype).kind == "f")
O_NCOLS = len(INT_FIELDS)
F_NCOLS = len(FLOAT_FIELDS)
for _i, _name in enumerate(INT_FIELDS):
    globals()[f"O_{_name.upper()}"] = _i
for _i, _name in enumerate(FLOAT_FIELDS):
    globals()[f"F_{_name.upper()}"] = _i
del _i, _name

# ---------------------------------------------------------------------------
# Trace inputs

LoadColumns = namedtuple("LoadColumns", (
    "ts", "worker", "rank", "running", "waiting", "num_tokens", "max_total", "has_tail",
    "waiting_uncached", "total_tokens", "max_running", "prefill_tokens", "prefill_busy_us",
    "router_inflight"), module=__name__)
LoadColumns.__doc__ = """The load samples in time order (``Trace.load_<field>``): int64, ``has_tail`` bool."""

Requests = namedtuple("Requests", ("ts", "index", "input_tokens", "query_blocks",
                                   "best_prefix_blocks", "model", "selected_worker"),
                      module=__name__)
Requests.__doc__ = """Requests in time order (``Trace.req_<field>``), int64; ``selected_worker``
is empty when the trace records none."""

Matches = namedtuple("Matches", ("offsets", "worker", "blocks"), module=__name__)
Matches.__doc__ = """CSR match entries: request ``i`` owns ``offsets[i]..offsets[i+1]`` (int64)."""

Fleets = namedtuple("Fleets", ("offsets", "workers", "member", "plain"), module=__name__)
Fleets.__doc__ = """Per model ``m``: its fleet ``workers[offsets[m]:offsets[m+1]]`` (ascending ids)
and ``member[m, w]`` (bool); ``plain[w]``: worker ``w`` is a plain engine, not a
prefill one (the reorg's buckets, ``kernels/reorg.py``; all true without a workers table)."""

BlockStates = namedtuple("BlockStates", ("lo", "ptrs", "tables", "inflights"), module=__name__)
BlockStates.__doc__ = """Per thread block ``b`` of a chunk: requests ``lo[b]..lo[b+1]`` and the
load state it starts from (``kernels/one_pass.split_states_nb``)."""

Outputs = namedtuple("Outputs", ("ints", "floats", "fleet_min", "fleet_fresh"), module=__name__)
Outputs.__doc__ = """A chunk's kept decisions, ``ints[O_*, request, config]`` (int64) and
``floats[F_*, request, config]``, and its per-request fleet readings."""

# ---------------------------------------------------------------------------
# Accumulators

ACC_NAMES = (
    "requests", "routed", "failed",
    *(f"decision_{d}" for d in labels.DECISIONS),
    *(f"policy_{p}" for p in labels.POLICY_REASONS),
    *(f"failure_{f}" for f in labels.FAILURES),
    *(f"reorg_{o}" for o in labels.REORG_OUTCOMES),
    "query_blocks", "matched_blocks", "selected_blocks",
    "owner_hits", "owner_chances", "diverted", "pinned", "fell_back", "fleet_all_queued",
    "waiting_known", "waiting_sum", "waiting_uncached_known", "waiting_uncached_sum",
    "queue_ms_known", "queue_us_sum", "cold_prefill_tokens", "agree", "agree_known",
    "guard_compared", "guard_overrides", "admission_evaluated", "admission_rejected",
    "gate_rejected",
    *(f"lost_{step}" for step in labels.LOSS_STEPS),
)
ACC = {name: i for i, name in enumerate(ACC_NAMES)}
N_ACC = len(ACC_NAMES)
WAIT_HIST = 1 << 12
N_DIV = len(labels.DIVERTED_BUCKETS) + 1

Accumulators = namedtuple("Accumulators", ("acc", "hist_wait", "hist_div", "stats"), module=__name__)
Accumulators.__doc__ = """Per thread block ``b``: ``acc[b, c, ACC_*]`` (config-major), ``hist_wait[b, v, c]``,
``hist_div[b, bucket, c]`` (``kernels/accumulate.py``) and ``stats[b]``
(cache-rung evaluations, domain-rung evaluations)."""
