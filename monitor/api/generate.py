"""POST /v1/generate: serve real traffic, recorded into rollups and Prometheus."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engine import validation
from engine.errors import (
    Cancelled,
    EngineError,
    InputTooLong,
    InvalidRequest,
    NotReady,
    Overloaded,
    RequestTimeout,
)
from engine.protocol import BUCKET_OVERFLOW, CancelSignal, Engine
from monitor.api.deps import (
    EngineDep,
    ReaderDep,
    SamplerDep,
    SettingsDep,
    SinkDep,
    TrafficDep,
)
from monitor.api.disconnect import call_until_disconnect
from monitor.metrics import MetricsSink
from monitor.settings import Settings
from probes.sampler import TrafficSampler
from probes.traffic import TrafficRecorder

router = APIRouter(tags=["serving"])
MAX_TIMEOUT_S = 3600.0


class GenerateRequest(BaseModel):
    """A generation request."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1, description="Input text.")
    # strict: `true` is no token count (lax validation would read it as 1).
    max_new_tokens: int | None = Field(None, ge=1, strict=True, description="Output length cap.")
    # A client that gives up after its own deadline says so: its request then leaves the
    # queue or the batch at that deadline (504) instead of holding a row to its last token.
    timeout_s: float | None = Field(
        None, gt=0, le=MAX_TIMEOUT_S, strict=True, allow_inf_nan=False,
        description="Seconds the request may take, queue wait included; past them: 504.")


class GenerateResponse(BaseModel):
    """The generated text and how it was produced."""

    text: str
    input_tokens: int
    output_tokens: int
    bucket: str
    path: str
    decoding: str
    latency_s: float
    ttft_s: float
    per_token_s: float | None
    acceptance_rate: float | None
    # Batching (engine.max_batch > 1): waits, the loop's step when it joined (-1: not
    # batched), and the rows in the steps it took part in (its own included).
    queue_wait_s: float
    batch_wait_s: float
    batch_join_step: int
    batch_size_mean: float
    batch_size_max: int


_REASONS: tuple[tuple[type[EngineError], str], ...] = (
    (Overloaded, "overloaded"), (NotReady, "not_ready"), (InputTooLong, "too_long"),
    (InvalidRequest, "invalid"), (RequestTimeout, "timeout"), (Cancelled, "cancelled"),
    (EngineError, "error"))


@router.post("/v1/generate", responses={
    413: {"description": "Input over the hard cap"},
    422: {"description": "Invalid field"},
    429: {"description": "Queue full; see Retry-After"},
    499: {"description": "The client disconnected first (it never reads this)"},
    503: {"description": "Engine not ready; see Retry-After"},
    504: {"description": "Not finished within the request's timeout_s"},
})
async def generate(body: GenerateRequest, request: Request, engine: EngineDep,
                   settings: SettingsDep, sink: SinkDep, traffic: TrafficDep, _actor: ReaderDep,
                   sampler: SamplerDep) -> GenerateResponse:
    """Generate greedily from `text`; a client that disconnects first cancels it."""
    # The model call blocks a worker thread of the pool a plain def would run in, while
    # this task listens for the client leaving.
    return await call_until_disconnect(request, lambda cancel: _serve(
        body, engine, settings, sink, traffic, sampler, cancel))


def _serve(body: GenerateRequest, engine: Engine, settings: Settings, sink: MetricsSink,
           traffic: TrafficRecorder, sampler: TrafficSampler | None,
           cancel: CancelSignal) -> GenerateResponse:
    """Run one request on the engine (in a worker thread) and record what came of it."""
    # Refused before the engine is called: every Engine implementation gets a budget in the cap.
    validation.max_new_tokens(settings.engine, body.max_new_tokens)
    try:
        result = engine.generate(body.text, max_new_tokens=body.max_new_tokens,
                                 timeout_s=body.timeout_s, cancel=cancel)
    except Exception as exc:
        # Anything else escaping the engine is a failure too: count it, the edge maps it.
        reason = next((r for t, r in _REASONS if isinstance(exc, t)), "error")
        sink.reject(reason)
        # A cancelled request is the client's leaving, not the engine's doing: it is no
        # latency sample, no refusal and no failure of its bucket's traffic.
        if reason in ("overloaded", "timeout", "error"):
            bucket = _bucket(engine, body.text)
            if reason == "overloaded":
                traffic.record_rejection(bucket)
            else:
                traffic.record_error(bucket)
        raise
    sink.observe(result)
    traffic.record(result)
    if sampler is not None:  # never waits: a drawn request is queued or counted as dropped
        sampler.offer(engine, body.text, body.max_new_tokens, result)
    return GenerateResponse(
        text=result.text, input_tokens=result.input_tokens, output_tokens=result.output_tokens,
        bucket=result.bucket, path=result.path, decoding=result.decoding,
        latency_s=result.total_s, ttft_s=result.ttft_s, per_token_s=result.per_token_s,
        acceptance_rate=result.spec.acceptance_rate, queue_wait_s=result.queue_wait_s,
        batch_wait_s=result.batch_wait_s, batch_join_step=result.batch_join_step,
        batch_size_mean=result.batch_size_mean, batch_size_max=result.batch_size_max)


def _bucket(engine: Engine, text: str) -> str:
    try:
        return engine.bucket_for(engine.count_tokens(text))
    except Exception:  # the bucket is only a label on a rejection count
        return BUCKET_OVERFLOW
