"""The `probes` section of the settings: canary and burst probes, rollup buffer."""

from __future__ import annotations

from pydantic import BaseModel, Field

from probes.cycle import CANARIES_PER_BUCKET


class ProbeSettings(BaseModel):
    """Canary and burst probes (probes package); `prober_from_settings` reads it."""

    suites_file: str | None = None  # user YAML added to the shipped suites
    suite: str = "in_domain"
    canaries_per_bucket: int = Field(CANARIES_PER_BUCKET, ge=1)
    ab_share: float = Field(0.25, ge=0.0, le=1.0)
    # A cycle whose optimized canaries rose more than this over their trailing median
    # (median over buckets; one bucket: 3x this) runs the arms in the next cycle too, so
    # an incident's first page can state its cause (probes.ab_schedule); 0 or null: off.
    ab_on_slowdown: float | None = Field(0.15, ge=0.0)
    cycle_timeout_s: float = 120.0
    # The burst must exercise admission control: client threads (burst_concurrency) above
    # engine max_concurrency + max_queue (1 + 16 by default), offered faster than the engine
    # serves, so the queue fills and rejections and queue wait are measured, not hidden in
    # the client pool. 200/s for 2 s offers ~400 requests.
    burst_rate_per_s: float = Field(200.0, gt=0)
    burst_duration_s: float = Field(2.0, gt=0)
    burst_concurrency: int = Field(64, ge=1)
    # On a batching engine each burst also runs its `unbatched` arm (batching off) on the
    # same arrivals: batching's speedup and tail cost under the burst's shape.
    burst_unbatched: bool = True
    rollup_buffer_max: int = 10_000
    # A/B fallback arms run. "exact" (bucketing's arm) compiles one graph per canary length
    # the first time: minutes on a CPU, during which A/B cycles time out; opt in to it.
    ab_arms: tuple[str, ...] = ("eager", "direct")


class QualitySettings(BaseModel):
    """Output quality (probes.reference, probes.sampler): outputs vs the reference path."""

    enabled: bool = True  # compare every canary cycle's outputs with reference outputs
    # Share of real requests replayed on the reference path in the background.
    traffic_sample_share: float = Field(0.01, ge=0.0, le=1.0)
    sample_queue_max: int = Field(16, ge=1)  # sampled requests waiting; more are dropped
    store_text: bool = False  # keep reference and sampled outputs' text (off: ids and counts)
