"""Fleet simulator: request logs in, complete router-replay traces out.

``simulate`` runs one closed-loop simulation (the router deciding with the
sweep's own kernels on what it can see), ``simulate_grid`` one per config of a
grid.  The model and its assumptions: ``docs/simulator.md``.
"""

from replay.simulate.batch import simulate_grid
from replay.simulate.fleet import Fleet, FleetSpec, WorkerSpec, build_fleet, load_fleet
from replay.simulate.formats import FORMATS, detect_format, read_log
from replay.simulate.logs import RequestLog, generate_log, read_azure, read_mooncake, write_mooncake_jsonl
from replay.simulate.sim import SimResult, simulate

__all__ = ["FORMATS", "detect_format", "Fleet", "FleetSpec", "WorkerSpec", "build_fleet", "load_fleet", "RequestLog",
           "generate_log", "read_azure", "read_log", "read_mooncake", "write_mooncake_jsonl",
           "SimResult", "simulate", "simulate_grid"]
