"""GET /v1/reports and /v1/reports/{id}: stored weekly reports as markdown, HTML or JSON."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Path, Query
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from monitor.api.deps import ReaderDep, SessionsDep
from monitor.api.errors import NotFound
from monitor.api.fields import MAX_ID
from storage.db import reading
from storage.queries import reports as queries

router = APIRouter(tags=["reports"])

Format = Literal["markdown", "html", "json"]


class ReportOut(BaseModel):
    """A stored report without its bodies."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    week: str
    created_at: datetime


@router.get("/v1/reports")
def list_reports(sessions: SessionsDep, _actor: ReaderDep,
                 limit: Annotated[int, Query(ge=1, le=520)] = 52) -> list[ReportOut]:
    """Return stored reports, newest week first."""
    with reading(sessions) as session:
        return [ReportOut.model_validate(r) for r in queries.list_reports(session, limit=limit)]


@router.get("/v1/reports/{report_id}", responses={
    200: {"content": {"text/markdown": {}, "text/html": {}, "application/json": {}}}})
def get_report(
    report_id: Annotated[int, Path(ge=1, le=MAX_ID)],
    sessions: SessionsDep,
    _actor: ReaderDep,
    format: Annotated[Format | None, Query(description="overrides Accept")] = None,
    accept: Annotated[str | None, Header()] = None,
) -> Response:
    """Return one report; the format comes from ?format= or the Accept header (markdown)."""
    with reading(sessions) as session:
        report = queries.report_by_id(session, report_id)
        if report is None:
            raise NotFound("report_id", f"no report with id {report_id}")
        fmt = format or _from_accept(accept)
        if fmt == "html":
            return HTMLResponse(report.html)
        if fmt == "json":
            body: dict[str, Any] = {"id": report.id, "week": report.week,
                                    "created_at": report.created_at.isoformat(),
                                    "summary": report.summary, "markdown": report.markdown}
            return JSONResponse(body)
        return PlainTextResponse(report.markdown, media_type="text/markdown; charset=utf-8")


def _from_accept(accept: str | None) -> Format:
    if not accept:
        return "markdown"
    for part in accept.split(","):
        kind = part.split(";")[0].strip().lower()
        if kind == "text/html":
            return "html"
        if kind == "application/json":
            return "json"
        if kind in ("text/markdown", "text/plain", "text/*"):
            return "markdown"
    return "markdown"
