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


# ---------------------------------------------------------------------------
# The simulator (``kernels/sim.py``): its state, grouped into named tuples of
# arrays, and the columns of its matrices.  The event loop's locals that change
# size (the load rows, the match entries) stay outside the tuples.

SimRequests = namedtuple("SimRequests", ("ts", "input_tokens", "output_tokens", "private", "full",
                                         "h_off", "h_ids", "btok", "parent", "forced"),
                         module=__name__)
SimRequests.__doc__ = """The requests of one simulation, sorted by ``ts`` (ns), int64: ``input_tokens``,
``output_tokens``; ``full`` leading blocks of each are full (only those are cached, published
and matched), ``private`` = its tokens outside them; CSR prefix blocks ``h_ids[h_off[i]:h_off[i+1]]``
(dense ids: ``btok`` tokens, ``parent`` block, -1 at the root); ``forced[i] >= 0`` places
request ``i`` on that worker without asking the router (-1: the router decides)."""

SimFleet = namedtuple("SimFleet", ("n_workers", "fleet", "in_fleet", "dp_size", "rank_off",
                                   "prefill_tps", "decode_ns", "decode_slope", "max_running",
                                   "capacity", "phase", "chunk", "policy", "engine", "dispatch",
                                   "publish_ns", "pub_delay", "pub_idle", "heap_cap"),
                      module=__name__)
SimFleet.__doc__ = """The fleet: workers ``0..n_workers-1`` (replay ids), ``fleet`` the routable ones
(``in_fleet[w]``), the router's ``dp_size`` per worker; ranks of worker ``w`` are
``rank_off[w]..rank_off[w+1]``, and per rank: ``prefill_tps`` (float), ``decode_ns`` (one decode
step), ``decode_slope`` (ns per running request beyond the first), ``max_running``,
``capacity`` (KV tokens), ``phase`` (interval publishing), ``chunk`` (chunked_prefill_size, 0
off), ``policy`` (POLICY_*), ``engine[r, EN_*]``.  Scalars: ``dispatch`` (LB_*),
``publish_ns``, ``pub_delay`` (> 0: on-change publishing), ``pub_idle``, ``heap_cap`` (LRU heap
entries per rank)."""

SimState = namedtuple("SimState", ("rs", "st", "rq", "run_ids", "rinf", "stats", "rr", "dpc_last",
                                   "lpm_ids", "lpm_key"), module=__name__)
SimState.__doc__ = """The engine's state: per-rank scalars ``rs[r, RS_*]``, per-request state
``st[i, ST_*]`` and outputs ``rq[i, RQ_*]``, each rank's running requests ``run_ids[r, :RS_RUN_N]``,
the router's live in-flight count per worker ``rinf``, run statistics ``stats[SS_*]``, and the
workers' DP controllers (round-robin counter ``rr``, last snapshot refresh ``dpc_last``), and
the ``lpm`` policy's scratch (``lpm_ids``, ``lpm_key``: ``LPM_MAX_QUEUE`` entries each)."""

SimCache = namedtuple("SimCache", ("ck", "cl", "cn", "cu", "hs", "hk", "hb", "ev", "idx", "idxr",
                                   "lag"), module=__name__)
SimCache.__doc__ = """The ranks' prefix caches: per rank an open-addressing table of block id ->
slot (linear probing, backward-shift deletion), sized by the rank's KV capacity in blocks, not
by the trace's blocks: ``ck[r, slot]`` the block held (int32, -1 empty), ``cl`` running
requests holding it, ``cn`` its cached children, ``cu`` its last use; ``hs``, aligned with the
requests' ``h_ids``, the slot each full block of an admitted request was found or stored in (a
hint: valid while ``ck`` still holds the block there, since only evictions move slots); each rank's LRU
min-heap of evictable leaves ``(hk, hb)[r, :RS_HN]`` (lazy deletion); and the KV index's lag queue
``ev`` (``ev[0]`` values held, 4 per event from ``ev[1]``), its events due ``lag`` ns after
the change, and the router's KV index they feed: per (block, worker) ``idx`` and, for the
``router`` dispatch, per (block, rank) ``idxr``."""

# the cache tables' hash of block ids (< 2**31, so the product fits int64): Fibonacci
# hashing of their groups of 8 consecutive ids, a group's slots consecutive (a prompt's
# new blocks have consecutive ids, and its prefix walks read them in order)
CT_HASH_MUL = 2654435761
CT_HASH_SHIFT = 15
CT_GROUP_BITS = 3

RouterView = namedtuple("RouterView", ("table", "inflight", "snap", "est", "oldest",
                                       "dirty", "audit", "scratch", "cand", "seen", "depth",
                                       "tmp_w", "tmp_d"), module=__name__)
RouterView.__doc__ = """What the router sees besides its KV index (``SimCache``): the sweep's rank
``table``, in-flight counts,
snapshot (``snap``, ``est``, ``oldest``, ``dirty``) over the written samples; and the decision's
scratch (``audit``, ``scratch``, ``cand``, ``seen``, and the match walk's ``depth``,
``tmp_w``, ``tmp_d``)."""

SimOutputs = namedtuple("SimOutputs", ("rq", "m_off", "m_worker", "m_blocks", "loads", "n_rows",
                                       "stats", "rs", "order", "phs", "t0"), module=__name__)
SimOutputs.__doc__ = """One simulation's result: ``rq[i, RQ_*]``, the CSR match entries
(``m_off``, ``m_worker``, ``m_blocks``), the load rows ``loads[LD_*, :]`` (on-change) or the
interval change records, ``n_rows`` load rows, ``stats[SS_*]``, the final ``rs``, and the
interval publishers' cyclic ``order``, phases ``phs`` and first stamp ``t0``."""

# per-rank scalars
RS_WORKER = 0
RS_LOCAL = 1          # rank number inside its worker
RS_CAP = 2            # max_total_num_tokens
RS_MAXRUN = 3
RS_DECODE_NS = 4      # one decode step
RS_USED = 5           # KV tokens in use: every cached block + running requests' private tokens
RS_EVICTABLE = 6      # tokens of cached blocks no running request holds
RS_QHEAD = 7
RS_QTAIL = 8
RS_QLEN = 9
RS_QWU = 10           # sum of waiting requests' uncached estimates
RS_QTOK = 11          # sum of waiting requests' input tokens
RS_RUN_N = 12
RS_KIND = 13          # 0 idle, 1 prefill step, 2 decode step
RS_END = 14           # end of the current step (INF when idle)
RS_STEP_TOK = 15
RS_STEP_DUR = 16
RS_PTOK = 17          # total_prefill_uncached_tokens (monotonic)
RS_PBUSY_NS = 18      # prefill busy time (ns; published in us)
RS_NEXT_SAMPLE = 19
RS_HN = 20            # LRU heap size
RS_MAX_USED = 21      # largest RS_USED seen
RS_MAX_QLEN = 22
RS_STEP_START = 23    # start of the current step
RS_STEP_K = 24        # decode steps the current step stands for (see _start_step)
RS_DECODE_SLOPE = 25  # ns a decode step grows by per running request beyond the first
RS_CHUNK = 26         # chunked_prefill_size (0: off)
RS_CHUNK_REQ = 27     # request whose prefill continues in the next step (-1: none)
RS_POLICY = 28        # waiting-queue order: POLICY_FCFS or POLICY_LPM
RS_PUB_DELAY = 29     # on-change publishing: delay from a change to its sample (0: interval mode)
RS_PUB_IDLE = 30      # on-change publishing: heartbeat after this long without a change
RS_DUE_KIND = 31      # what RS_NEXT_SAMPLE is: DUE_CHANGE or DUE_HEARTBEAT
RS_HB_PENDING = 32    # time of a heartbeat not yet written (-1: none; see _flush_heartbeats)
RS_HB_INF = 33        # router_inflight when that heartbeat was due
RS_LAST_ROW = 34      # index of the rank's latest written sample (-1: none)
RS_MAXPF = 35         # max_prefill_tokens: prompt tokens one prefill step may admit
RS_DEC_COUNT = 36     # decode steps run so far (the engine's load snapshot: every 15th)
RS_DS_TS = 37         # the engine's latest load snapshot for its DP controller: stamp,
RS_DS_REQ = 38        # running + waiting requests,
RS_DS_TOK = 39        # KV tokens in use + waiting requests' tokens
RS_BUD_TS = 40        # the DP controller's view of the rank: stamp of the snapshot applied,
RS_BUD_REQ = 41       # requests (+1 per dispatch since),
RS_BUD_TOK = 42       # tokens (+prompt per dispatch since)
RS_NO_DECAY = 43      # the current decode step retracted: the ratio does not decay
RS_RATIO = 44         # new_token_ratio, in units of 1e-9 (integer: the same in jit and plain Python)
RS_NR_INIT = 45       # its initial value, floor and decay per decode step (1e-9 units)
RS_NR_MIN = 46
RS_NR_DECAY = 47
RS_MIXED = 48         # enable_mixed_chunk
RS_STEP_MIX = 49      # the current prefill step carries the running decodes (mixed chunk)
RS_PUB_SGL = 50       # SGLang's LoadStat cadence (publish_policy "sglang"; see kernels/sim._publish_sgl)
RS_PUB_CNT = 51       # decode steps since the rank's last LoadStat (sglang cadence)
RS_NCOLS = 52

# in-worker data-parallel dispatch (the fleet's load_balance_method)
LB_ROUND_ROBIN = 0
LB_TOTAL_REQUESTS = 1
LB_TOTAL_TOKENS = 2
LB_BOOTSTRAP_ROOM = 3   # a seeded draw per request
LB_ROUTER = 4           # the router picks the rank from its own per-rank view
LB_PREFIX_AFFINITY = 5  # the rank holding the longest cached prefix, then the least loaded
DPC_REFRESH_NS = 20_000_000   # the controller re-reads the ranks' snapshots at most this often
SNAPSHOT_DECODE_STEPS = 15    # a rank writes its snapshot after every 15th decode step
CLIP_MAX_NEW = 4096           # the new-token reservation is clipped at this many tokens
BOOTSTRAP_DRAW = 1 << 40      # the draw index of follow_bootstrap_room's per-request room
RETRACT_DECODE_STEPS = 20     # the ratio after a retraction counts this many steps per request
RATIO_ONE = 1_000_000_000     # new_token_ratio 1.0 in RS_RATIO units
# columns of the per-rank engine options ``rank_eng``
EN_MAXPF = 0
EN_NR_INIT = 1
EN_NR_MIN = 2
EN_NR_DECAY = 3
EN_MIXED = 4
EN_PUB_SGL = 5        # 1: SGLang's LoadStat cadence (on-change publishing must be on)
EN_NCOLS = 6
STALL_PUBLISH_NS = 50_000_000  # sglang cadence: a stalled rank (queued work, no batch) re-publishes

POLICY_FCFS = 0
POLICY_LPM = 1
LPM_MAX_QUEUE = 128   # SGLang falls back to FCFS order above this many waiting requests
DUE_CHANGE = 0
DUE_HEARTBEAT = 1

# per-request state
ST_STATUS = 0         # 0 not arrived, 1 waiting, 2 prefilling, 3 decoding, 4 done
ST_QNEXT = 1
ST_REMAIN = 2
ST_PRIVATE = 3        # tokens outside cacheable blocks (partial tail + output), reserved on admission
ST_UNC_ENQ = 4        # uncached estimate when queued (num_waiting_uncached_tokens)
ST_PF_LEFT = 5        # prompt tokens still to compute (chunked prefill)
ST_FULL = 6           # leading blocks the cache may hold: the full ones (CAPTURE.md s.2: full pages only)
ST_OUT = 7            # output tokens produced so far (a retracted request recomputes them)
ST_GENKV = 8          # KV tokens held for output (one per decode step; freed on retraction)
ST_SEQ = 9            # tokens when queued (prompt + output so far: num_total_tokens' share)
ST_NCOLS = 10

# per-request outputs
RQ_WORKER = 0
RQ_RANK = 1
RQ_REASON = 2
RQ_DECISION = 3
RQ_FAILURE = 4
RQ_CACHED_TOKENS = 5
RQ_CACHED_BLOCKS = 6
RQ_ADMIT = 7
RQ_FIRST = 8
RQ_DONE = 9
RQ_BEST = 10
RQ_COMPLETIONS = 11   # times the request completed (conservation: exactly 1)
RQ_REORG_OUTCOME = 12  # labels.REORG_OUTCOMES code under --chat-routing reorg, else -1
RQ_NCOLS = 13

# load sample columns (the loads.parquet columns, in order)
LD_TS = 0
LD_WORKER = 1
LD_RANK = 2
LD_RUNNING = 3
LD_WAITING = 4
LD_TOKENS = 5
LD_MAXTOT = 6
LD_WU = 7
LD_TOTAL = 8
LD_MAXRUN = 9
LD_PTOK = 10
LD_PBUSY = 11
LD_INFLIGHT = 12
LD_NCOLS = 13

# run statistics
SS_EVENTS = 0
SS_STEPS = 1
SS_EVICTIONS = 2
SS_REBUILDS = 3
SS_KV_OVER = 4        # max(used - capacity) over ranks and time (<= 0 when the cap holds)
SS_NEG_QUEUE = 5      # times a queue length went negative (must stay 0)
SS_INDEX_EVENTS = 6
SS_RETRACTIONS = 7    # running requests retracted because decode ran out of KV
SS_CHUNKED = 8        # prefill steps that cut a prompt (chunked prefill)
SS_RECOMPUTED = 9     # tokens retracted requests computed again (prompt + output so far)
SS_NCOLS = 10
