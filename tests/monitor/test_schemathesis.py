"""A bounded, seeded schemathesis run against the real app on SQLite and PostgreSQL.

Every operation in the OpenAPI document is fed generated valid and invalid input (with a
fixed derandomized seed, so a failure reproduces); each answer must be a non-5xx response
whose status, content type, headers and body match what the document declares.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from hypothesis.strategies import SearchStrategy
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from monitor.loopback import wait_for
from monitor.settings import Settings
from tests.monitor.conftest import TOKEN, start
from tests.monitor.fakes import FakeFactory
from tests.monitor.live import LiveServer

pytestmark = pytest.mark.slow

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]
MAX_EXAMPLES = 15  # per operation and mode: the run stays near a minute a database
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def live_url(settings: Settings) -> Iterator[str]:
    """Return the URL of the real app (uvicorn, lifespan, fake engine) once it is ready."""
    import httpx

    app = start(settings, FakeFactory())
    with LiveServer(app) as live:
        wait_for(lambda: httpx.get(live.url + "/readyz").status_code == 200)
        yield live.url


def test_api_conforms(live_url: str) -> None:
    """Answer generated valid and invalid input with no 5xx and only documented responses."""
    api = schemathesis.openapi.from_url(live_url + "/openapi.json")
    failures: list[str] = []
    for result in api.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _exercise(operation.as_strategy(generation_mode=mode), live_url)
            except Unsatisfiable:
                continue  # no parameters to break (GET /healthz has no invalid form)
            except (Exception, BaseExceptionGroup) as exc:  # report every operation's failure
                failures.append(f"{operation.label} ({mode}): {exc}")
    assert not failures, "\n\n".join(failures)


def _exercise(strategy: SearchStrategy[schemathesis.Case], base_url: str) -> None:
    @given(case=strategy)
    @settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=base_url, headers=AUTH, checks=CHECKS, timeout=30)

    run()
