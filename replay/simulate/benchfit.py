"""Calibrate from SGLang ``bench_serving``'s per-request file (docs/calibration.md,
"From a bench_serving file").

The file (``bench_serving --output-details``) holds, per request, the prompt and output
lengths, the time to first token and the inter-token latencies, and nothing about the
fleet: no worker, rank, placement, load sample or cache hit.  So only two speeds can be
read from it, and only under stated assumptions:

* ``prefill_tokens_per_s`` from the requests that ran alone: a request that found the rank
  idle has ``ttft = input / prefill speed``; one that queued or shared a step took longer,
  so ``input / ttft`` is at most the speed, and the requests that ran alone all sit at its
  top.  The estimate is the median of the requests within 0.5% of the top (prompts of at
  least ``MIN_PROMPT`` tokens).  It assumes no prefix-cache hits (a hit makes a request look
  faster).  When fewer than ``MIN_ALONE`` requests (and ``ALONE_SHARE`` of them) sit there,
  few or none ran alone and the value is called a lower bound.
* ``decode_tokens_per_s`` from the time per output token after the first,
  ``(latency - ttft) / (output - 1)``: its median is one decode step at the batch the run
  had, which the file does not give, so ``decode_step_ms_per_request`` stays 0.

Everything else is said to be unknown, with the default written to the fleet file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from replay.config import knob_spec
from replay.errors import NeedsForce, ParamsError, ReplayError
from replay.runs import rundir
from replay.simulate.fleet import FleetSpec, load_fleet
from replay.simulate.formats import detect_format, read_bench_serving
from replay.simulate.logs import RequestLog

MIN_PROMPT = 64        # shorter prompts: fixed per-request costs dominate their TTFT
MIN_REQUESTS = 20      # fewer usable requests: the speed is not fitted
ALONE_TOL = 0.005      # requests within 0.5% of the top of input / ttft ran alone
MIN_ALONE = 3          # fewer of them (or under ALONE_SHARE): the speed is a lower bound
ALONE_SHARE = 0.02

# what a bench_serving file cannot tell, and why (the fleet file gets the default)
UNKNOWN = (
    ("workers, dp_size", "the file names the server address only, not the workers or ranks behind it"),
    ("max_running_requests", "no running counts (the run's --max-concurrency bounds what it sent, not what ran)"),
    ("max_total_num_tokens", "no KV usage"),
    ("decode_step_ms_per_request", "no batch sizes: the decode speed is the run's typical batch's"),
    ("load_balance_method", "no rank per request"),
    ("chunked_prefill_size, max_prefill_tokens", "no per-step prefill sizes"),
    ("publish_policy", "no load samples"),
    ("prefix cache", "no cached tokens: every prompt is taken as computed in full"),
)


@dataclass(frozen=True)
class Speed:
    name: str
    value: float
    fitted: bool
    samples: int
    how: str


@dataclass
class BenchFit:
    """What a bench_serving file gave: two speeds (fitted or default) and what it cannot tell."""

    source: str
    requests: int
    speeds: list[Speed] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"calibrated from a bench_serving file ({self.requests:,} requests): two speeds at most"]
        for s in self.speeds:
            tag = "" if s.fitted else "  NOT FITTED (default used)"
            out.append(f"  {s.name} = {s.value:.6g}{tag}  ({s.how}; {s.samples:,} requests)")
        out.append("cannot tell from a bench_serving file (defaults written): "
                   + "; ".join(f"{k} [{why}]" for k, why in UNKNOWN))
        return out

    def to_toml(self) -> str:
        out = [f"# fitted by router-replay calibrate from the bench_serving file {self.source}",
               "# (docs/calibration.md, \"From a bench_serving file\"): only the two speeds below come",
               "# from the file; every other key is SGLang's or the simulator's default. Set workers and",
               "# dp_size to the fleet the run used. Every key is documented in docs/simulator.md.",
               "workers = 1", "dp_size = 1"]
        for s in self.speeds:
            out.append(f"{s.name} = {s.value!r}  # {'fitted' if s.fitted else 'NOT FITTED, default'}: {s.how}")
        for k, why in UNKNOWN:
            out.append(f"# {k}: not in the file ({why})")
        return "\n".join(out) + "\n"


def fit_bench_log(log: RequestLog, source: str = "") -> BenchFit:
    """The two speeds of a request log read from a bench_serving file (its observed outcomes)."""
    if log.observed_ttft_ms is None or log.observed_latency_ms is None:
        raise ReplayError(f"{source}: no measured ttft/latency: not a bench_serving file")
    spec = FleetSpec()
    L = log.input_tokens.astype(np.float64)
    out = log.output_tokens.astype(np.float64)
    ttft = np.asarray(log.observed_ttft_ms, dtype=np.float64)
    lat = np.asarray(log.observed_latency_ms, dtype=np.float64)
    fit = BenchFit(source, int(log.n_requests))

    ok = np.isfinite(ttft) & (ttft > 0) & (L >= MIN_PROMPT)
    rate = L[ok] / (ttft[ok] / 1e3)
    if rate.shape[0] >= MIN_REQUESTS:
        top = rate >= (1 - ALONE_TOL) * float(rate.max())
        p = float(np.median(rate[top]))
        k = int(top.sum())
        how = (f"input / ttft of the {k:,} request(s) within 0.5% of its top ({k / rate.shape[0]:.1%} "
               f"of the prompts of {MIN_PROMPT}+ tokens), which ran alone")
        if k < MIN_ALONE or k < ALONE_SHARE * rate.shape[0]:
            how = (f"input / ttft at its top, reached by only {k:,} request(s) ({k / rate.shape[0]:.1%}): "
                   "few or none ran alone, so this may be a LOWER BOUND")
        fit.speeds.append(Speed("prefill_tokens_per_s", p, True, int(rate.shape[0]),
                                how + "; assumes no prefix-cache hits"))
    else:
        fit.speeds.append(Speed("prefill_tokens_per_s", spec.prefill_tokens_per_s, False,
                                int(rate.shape[0]), f"fewer than {MIN_REQUESTS} prompts of "
                                f"{MIN_PROMPT}+ tokens with a ttft"))

    ok = np.isfinite(ttft) & np.isfinite(lat) & (out >= 2) & (lat > ttft)
    tpot = (lat[ok] - ttft[ok]) / (out[ok] - 1)
    if tpot.shape[0] >= MIN_REQUESTS:
        step = float(np.median(tpot))
        q1, q3 = np.percentile(tpot, [25, 75])
        fit.speeds.append(Speed("decode_tokens_per_s", 1e3 / step, True, int(tpot.shape[0]),
                                f"1 / median time per output token after the first ({step:.2f} ms; "
                                f"quartiles {q1:.2f}..{q3:.2f} ms), a decode step at the run's "
                                "typical batch"))
    else:
        fit.speeds.append(Speed("decode_tokens_per_s", spec.decode_tokens_per_s, False,
                                int(tpot.shape[0]), f"fewer than {MIN_REQUESTS} requests with 2+ "
                                "output tokens and a latency"))
    for s in fit.speeds:
        if not (math.isfinite(s.value) and s.value > 0):
            raise ReplayError(f"{source}: {s.name} came out as {s.value}: the file's timings are not usable")
    return fit


def calibrate_bench_file(path: str | os.PathLike, out: str | os.PathLike, *, force: bool = False,
                         validate_dir: str | os.PathLike | None = None, refine: bool = False,
                         seeds: str | None = None, knobs: Mapping[str, Any] | None = None) -> BenchFit:
    """Fit from a bench_serving file and write the fleet file ``out`` (aside, then swapped in).

    What ``calibrate`` does with a file: the options of a trace directory's calibration
    (``validate_dir``, ``refine``, ``seeds``, router ``knobs`` by name) are refused, naming the
    first one given, as the file has no placement or loads to check a model against."""
    fmt = detect_format(path)
    if fmt != "bench-serving":
        raise ReplayError(f"{path}: a {fmt} log; calibrate reads a trace directory or a bench_serving "
                          "per-request file (simulate the log, then calibrate the trace it writes)")
    for name, flag, value in (("validate_dir", "--validate", validate_dir), ("refine", "--refine", refine),
                              ("seeds", "--seeds", seeds)):
        if value:
            raise ParamsError("{" + name + "}: a bench_serving file has no placement or loads to check a model "
                              "against; simulate the file with the fitted fleet instead", (name, flag))
    if knobs:
        knob = knob_spec(next(iter(knobs)))
        raise ParamsError("{" + knob.name + "}: router knobs make a prediction grid, which needs a trace directory",
                          (knob.name, knob.flag))
    fleet_path = Path(out)
    if fleet_path.exists() and not force:
        raise NeedsForce(f"{fleet_path}: exists (use ", " to replace it)")
    log = read_bench_serving(path)
    fit = fit_bench_log(log, str(path))
    with rundir.file_aside(fleet_path) as tmp:
        with rundir.writing(fleet_path):
            tmp.write_text(fit.to_toml())
        load_fleet(tmp)   # what simulate will read: the file round-trips
    return fit


__all__ = ["BenchFit", "calibrate_bench_file", "fit_bench_log"]
