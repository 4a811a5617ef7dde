"""The file names of what the commands write: one place for each (a run directory, a
closed-loop grid)."""

from __future__ import annotations

# a trace directory's files are named by the trace package below (it reads them); given here too,
# so a module that writes or finds any of a command's files takes every name from this one
from replay.trace.base import LOADS as LOADS
from replay.trace.base import REQUESTS as REQUESTS
from replay.trace.base import TRACE_JSON as TRACE_JSON
from replay.trace.base import WORKERS as WORKERS

REQUESTS_DIR = "requests"               # a partitioned trace's requests.parquet parts
LOADS_DIR = "loads"                     # ... its loads.parquet parts (a recording's too)

SUMMARY = "summary.parquet"
SUMMARY_CSV = "summary.csv"
DECISIONS = "decisions.parquet"
DECISIONS_DIR = "decisions"             # a sharded (Ray) sweep's decisions files
FLEET_PARTS = "fleet-parts"             # Ray tasks' fleet readings, joined into FLEET
RUN_JSON = "run.json"
FLEET = "fleet.parquet"
REPORT = "report.html"
CLOSED_LOOP = "closed_loop_summary.parquet"
CLOSED_LOOP_CSV = "closed_loop_summary.csv"
CLOSED_LOOP_SEEDS = "closed_loop_seeds.parquet"  # a grid under several seeds: one row per (config, seed)
OUTCOMES = "outcomes.parquet"           # a simulation's ground truth, one row per request
SIM_JSON = "sim.json"
FIDELITY_JSON = "fidelity.json"         # calibrate --validate: the fit's score
PREDICTION = "prediction"               # calibrate --validate: the prediction grid's directory
FORCED_RUN = "forced"                   # calibrate --validate: the recording replayed on production's placement
ROUTER_RUN = "router"                   # ... and with the router in the loop
TOOL = "router-replay"                  # run.json's and a baseline's "tool" marker
SIM_TOOL = "router-replay simulate"     # sim.json's "tool" marker
FIDELITY_TOOL = "router-replay calibrate"  # fidelity.json's "tool" marker

# a capacity plan (simulate with --workers/--dp-size/--load-scale lists)
PLAN_TABLE = "plan_summary.parquet"
PLAN_CSV = "plan_summary.csv"
PLAN_JSON = "plan.json"
PLAN_TOOL = "router-replay simulate (plan)"  # plan.json's "tool" marker
# the bound a plan is asked under -> its column; the fleet columns of plan_summary
BOUND_METRICS = {"ttft": "ttft_ms_p99", "queue_wait": "queue_wait_ms_p99"}
FLEET_COLS = ("load_scale", "workers", "dp_size", "ranks")

# a recording (`record`) and the capture formats a simulation writes (`simulate --capture-out`)
RECORD_JSON = "record.json"             # a recording's streams, gaps and restarts
KV_EVENTS_DIR = "kv_events"             # a recording's KV-event parts
GAPS_DIR = "gaps"                       # a recording's gap rows
RECORDED = "recorded"                   # capture formats: the recording
TOKEN_EXPORT = "token_export"           # capture formats: the router's token export
ENGINES = "engines"                     # capture formats: the engines' request exports
