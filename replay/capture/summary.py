"""The capture facts ``import`` leaves in ``trace.json`` (``extra.capture``), for ``validate``."""

from __future__ import annotations

from replay.trace.info import read_trace_info


def capture_facts(trace_dir) -> dict | None:
    """``trace.json``'s ``extra.capture`` object, or None (no file, not an imported trace); the file
    is read by its one reader, :func:`replay.trace.info.read_trace_info`."""
    cap = read_trace_info(trace_dir).extra.get("capture")
    return cap if isinstance(cap, dict) else None


def capture_lines(facts: dict) -> list[str]:
    """Human-readable lines: sources, where matches come from, join coverage."""
    lines = [f"capture: requests from {facts.get('requests_source')}; matches: {facts.get('matches_source')}"
             + ("" if facts.get("matches_exact") else " (not the indexer's exact answer)")]
    lines.append("capture loads: " + "; ".join(facts.get("loads_source") or ["none"]))
    cov = [(k.replace("_", " "), facts[k]) for k in ("requests_without_engine_record",
                                                     "engine_records_without_router_record",
                                                     "requests_whose_worker_is_unknown",
                                                     "duplicate_request_records_dropped", "truncated_files",
                                                     "skipped_bad_lines") if facts.get(k)]
    if cov:
        lines.append("capture coverage: " + ", ".join(f"{k}: {v:,}" for k, v in cov))
    rec = facts.get("recorded") or {}
    if rec:
        lines.append(f"capture recording: complete {rec.get('complete')}, gaps {rec.get('gaps')}, restarts "
                     f"{rec.get('restarts')}, malformed frames {rec.get('malformed_frames')}")
    return lines
