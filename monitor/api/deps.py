"""Dependency aliases: routes get the Services hub's parts and the caller's identity here.

This module is the one reader of `app.state`; handlers never touch it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from engine.errors import NotReady
from engine.protocol import Engine, FlagProvider
from monitor.auth import Authenticator
from monitor.engine_holder import EngineHolder
from monitor.hub import Services, services_of
from monitor.metrics import Metrics, MetricsSink
from monitor.probe_runner import ProbeRunner
from monitor.settings import Settings
from monitor.supervisor import WorkerSupervisor
from probes.sampler import TrafficSampler
from probes.traffic import TrafficRecorder


def _services(request: Request) -> Services:
    return services_of(request.app)


ServicesDep = Annotated[Services, Depends(_services)]


def _settings(s: ServicesDep) -> Settings:
    return s.settings


def _sessions(s: ServicesDep) -> sessionmaker[Session]:
    return s.sessions


def _holder(s: ServicesDep) -> EngineHolder:
    return s.engine_holder


def _engine(s: ServicesDep) -> Engine:
    engine = s.engine_holder.get()
    if engine is None:
        raise NotReady("the engine is still loading")
    return engine


def _metrics(s: ServicesDep) -> Metrics:
    return s.metrics


def _sink(s: ServicesDep) -> MetricsSink:
    return s.sink


def _traffic(s: ServicesDep) -> TrafficRecorder:
    return s.traffic


def _sampler(s: ServicesDep) -> TrafficSampler | None:
    return s.sampler


def _flags(s: ServicesDep) -> FlagProvider:
    return s.flags


def _probes(s: ServicesDep) -> ProbeRunner:
    return s.probes


def _worker(request: Request) -> WorkerSupervisor | None:
    # Set by `tailwatch serve` when it supervises a worker child; none otherwise.
    worker: WorkerSupervisor | None = getattr(request.app.state, "worker", None)
    return worker


def _authenticator(s: ServicesDep) -> Authenticator:
    return s.authenticator


AuthenticatorDep = Annotated[Authenticator, Depends(_authenticator)]


# Declares the bearer scheme in OpenAPI (so /docs has Authorize); the Authenticator
# reads the raw header itself, so its 401/403 wording and audit actor stay one path.
_bearer = HTTPBearer(auto_error=False, scheme_name="bearer",
                     description="An API token: TAILWATCH_API_TOKEN or a named api.tokens entry")
BearerDoc = Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]


def _writer(auth: AuthenticatorDep, _doc: BearerDoc,
            authorization: Annotated[str | None, Header(include_in_schema=False)] = None) -> str:
    return auth.actor(authorization, write=True)


def _reader(auth: AuthenticatorDep, _doc: BearerDoc,
            authorization: Annotated[str | None, Header(include_in_schema=False)] = None) -> str:
    return auth.actor(authorization, write=False)


SettingsDep = Annotated[Settings, Depends(_settings)]
SessionsDep = Annotated[sessionmaker[Session], Depends(_sessions)]
EngineHolderDep = Annotated[EngineHolder, Depends(_holder)]
EngineDep = Annotated[Engine, Depends(_engine)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
SinkDep = Annotated[MetricsSink, Depends(_sink)]
TrafficDep = Annotated[TrafficRecorder, Depends(_traffic)]
SamplerDep = Annotated[TrafficSampler | None, Depends(_sampler)]
FlagProviderDep = Annotated[FlagProvider, Depends(_flags)]
ProbeRunnerDep = Annotated[ProbeRunner, Depends(_probes)]
WorkerDep = Annotated[WorkerSupervisor | None, Depends(_worker)]
WriterDep = Annotated[str, Depends(_writer)]  # the actor; 401/403 without a valid token
ReaderDep = Annotated[str, Depends(_reader)]  # checked only when api.read_auth
