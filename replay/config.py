"""Router configuration: one point (``RouterConfig``) and a grid of them.

``RouterConfig`` mirrors the router's ``AffinityConfig`` knobs that decide a
prefill route (ROUTER_SEMANTICS.md section 6), under the router's own flag
names with underscores.  Defaults are ``AffinityConfig::default()``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class RouterConfig:
    """One router configuration (defaults = the router's ``AffinityConfig::default()``)."""

    worker_queue_limit: int | None = None
    saturation_queue_floor: int | None = None
    min_load_choices: int = 2
    cache_switch_margin_tokens: int = 1024
    pressure_guard: bool = True
    pressure_abs_threshold_tokens: int = 1024
    pressure_abs_threshold_ms: float | None = None
    pressure_rel_threshold: float = 1.5
    cache_affinity_min_matched_tokens: int | None = 1024
    cache_affinity_min_match_ratio: float | None = None
    cache_candidate_min_workers: int = 8
    cache_candidate_ratio: float = 0.05
    cache_candidate_max_workers: int = 32

    @classmethod
    def proposal_default(cls, **overrides) -> "RouterConfig":
        """The knobs of ``CacheCandidateProposal::default()`` used by the router's
        direct resolver unit tests: margin 0, guard off, abs 0, ms None, rel 0.0."""
        base = dict(
            cache_switch_margin_tokens=0,
            pressure_guard=False,
            pressure_abs_threshold_tokens=0,
            pressure_abs_threshold_ms=None,
            pressure_rel_threshold=0.0,
        )
        base.update(overrides)
        return cls(**base)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


KNOB_NAMES: tuple[str, ...] = tuple(f.name for f in fields(RouterConfig))
