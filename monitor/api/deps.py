"""Dependency aliases: routes get app state, the engine and the caller's identity here."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy.orm import Session, sessionmaker

from engine.errors import NotReady
from engine.protocol import Engine, FlagProvider
from monitor.auth import Authenticator
from monitor.metrics import Metrics, MetricsSink
from monitor.service import EngineHolder
from monitor.settings import Settings
from probes.traffic import TrafficRecorder


def _settings(request: Request) -> Settings:
    return request.app.state.settings


def _sessions(request: Request) -> sessionmaker[Session]:
    return request.app.state.sessions


def _holder(request: Request) -> EngineHolder:
    return request.app.state.engine_holder


def _engine(request: Request) -> Engine:
    engine = request.app.state.engine_holder.get()
    if engine is None:
        raise NotReady("the engine is still loading")
    return engine


def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def _sink(request: Request) -> MetricsSink:
    return request.app.state.sink


def _traffic(request: Request) -> TrafficRecorder:
    return request.app.state.traffic


def _flags(request: Request) -> FlagProvider:
    return request.app.state.flags


def _writer(request: Request,
            authorization: Annotated[str | None, Header(include_in_schema=False)] = None) -> str:
    auth: Authenticator = request.app.state.authenticator
    return auth.actor(authorization, write=True)


def _reader(request: Request,
            authorization: Annotated[str | None, Header(include_in_schema=False)] = None) -> str:
    auth: Authenticator = request.app.state.authenticator
    return auth.actor(authorization, write=False)


SettingsDep = Annotated[Settings, Depends(_settings)]
SessionsDep = Annotated[sessionmaker[Session], Depends(_sessions)]
EngineHolderDep = Annotated[EngineHolder, Depends(_holder)]
EngineDep = Annotated[Engine, Depends(_engine)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
SinkDep = Annotated[MetricsSink, Depends(_sink)]
TrafficDep = Annotated[TrafficRecorder, Depends(_traffic)]
FlagProviderDep = Annotated[FlagProvider, Depends(_flags)]
WriterDep = Annotated[str, Depends(_writer)]  # the actor; 401/403 without a valid token
ReaderDep = Annotated[str, Depends(_reader)]  # checked only when api.read_auth
