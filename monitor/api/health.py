"""Liveness, readiness and the Prometheus scrape endpoint."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from monitor.api.deps import EngineHolderDep, MetricsDep, ReaderDep, ServicesDep, WorkerDep
from monitor.engine_holder import READY
from monitor.scheduler import job_table
from storage.db import ping

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Return 200 while the process serves HTTP."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Warming, failed or DB unreachable"}})
def readyz(holder: EngineHolderDep, services: ServicesDep, worker: WorkerDep) -> JSONResponse:
    """Return 200 when the engine is warm and the database answers, else 503 with a reason.

    `jobs` lists this process's scheduled jobs: runs, failures, last success and duration,
    running now, and for leader-only jobs whether this process leads. The database check
    runs outside a transaction: an evaluation holding SQLite's write lock is no outage.
    `worker` is the analysis worker `serve` supervises (WorkerSupervisor.view: pid, alive,
    restarts, last exit, its own /healthz job table), null without one (`--no-worker`).
    It never decides readiness: this process serves requests whatever the worker does,
    and taking it out of a load balancer would not bring the analysis back.
    """
    state, reason = holder.state()
    try:
        ping(services.db)
        database = "ok"
    except Exception as exc:
        log.warning("readyz: database unreachable: %s", type(exc).__name__)
        database = "unreachable"
    scheduler = services.scheduler
    body: dict[str, object] = {
        "status": state, "engine": reason, "database": database,
        "jobs": job_table(scheduler.stats()) if scheduler is not None else [],
        "worker": worker.view() if worker is not None else None}
    if database != "ok":
        body.update(status="unavailable", reason="database unreachable")
        return JSONResponse(body, status_code=503)
    if state != READY:
        body["reason"] = reason
        return JSONResponse(body, status_code=503)
    return JSONResponse(body)


@router.get("/metrics", include_in_schema=False)
def metrics(registry: MetricsDep, _actor: ReaderDep) -> Response:
    """Expose the app's own registry in the Prometheus text format."""
    return Response(generate_latest(registry.registry), media_type=CONTENT_TYPE_LATEST)
