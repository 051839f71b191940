"""docs/oncall.md is read at 2 AM: every command in it must work as written.

Its `tailwatch ...` lines parse against the real CLI (commands, arguments and options),
and its curl calls name real routes with bodies the API's own models and the flag
store's validation accept.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click
import pytest
from fastapi.routing import APIRoute

from alerts.flags import validate
from monitor.api.flags import FlagChange
from monitor.api.flags import router as flags_router
from monitor.api.incidents import router as incidents_router
from monitor.api.probes import ProbeRunRequest
from monitor.api.probes import router as probes_router
from monitor.cli import cli

DOC = Path(__file__).resolve().parents[1] / "docs" / "oncall.md"
ROUTES = {(method, route.path) for router in (flags_router, incidents_router, probes_router)
          for route in router.routes if isinstance(route, APIRoute)
          for method in route.methods or ()}


def shell_commands(markdown: str) -> list[str]:
    """Return the commands of the ```sh blocks, continuation lines joined, comments cut."""
    out: list[str] = []
    for block in re.findall(r"^```sh\n(.*?)^```", markdown, re.M | re.S):
        for command in block.replace("\\\n", " ").splitlines():
            words = shlex.split(command, comments=True)
            if words:
                out.append(shlex.join(words))
    return out


def parse_cli(words: list[str]) -> click.Context:
    """Parse `tailwatch WORDS` down to its command without running it; raise if it fails.

    The runbook gives groups no options of their own: each group word names a subcommand,
    and the last command parses the rest (arguments and options) as click would.
    """
    command: click.Command = cli
    ctx = click.Context(cli, info_name="tailwatch")
    args = list(words)
    while isinstance(command, click.Group):
        assert args, f"incomplete command: {' '.join(words)}"
        name, *args = args
        sub = command.get_command(ctx, name)
        assert sub is not None, f"no command {name!r} in {' '.join(words)}"
        if isinstance(sub, click.Group):
            ctx = click.Context(sub, info_name=name, parent=ctx)
        else:
            return sub.make_context(name, args, parent=ctx)
        command = sub
    raise AssertionError(f"not a command: {' '.join(words)}")


def test_every_tailwatch_command_in_the_runbook_parses() -> None:
    lines = [c for c in shell_commands(DOC.read_text()) if c.startswith("tailwatch ")]
    assert len(lines) >= 5
    for line in lines:
        parse_cli(shlex.split(line)[1:])


def test_every_curl_call_in_the_runbook_is_a_real_route_with_a_valid_body() -> None:
    calls = [shlex.split(c) for c in shell_commands(DOC.read_text()) if c.startswith("curl ")]
    assert len(calls) >= 2
    for words in calls:
        method = words[words.index("-X") + 1]
        url = next(w for w in words if w.startswith("$TAILWATCH_URL/"))
        path = url.removeprefix("$TAILWATCH_URL")
        body = json.loads(words[words.index("-d") + 1])
        assert any("Bearer $TAILWATCH_API_TOKEN" in w for w in words), words
        if path.startswith("/v1/flags/"):
            assert (method, "/v1/flags/{name}") in ROUTES
            change = FlagChange.model_validate(body)
            validate(path.rsplit("/", 1)[1], change.scope, change.value)
        else:
            assert (method, path) in ROUTES, (method, path)
            assert path == "/v1/probes/run"
            ProbeRunRequest.model_validate(body)


def test_a_wrong_command_in_the_runbook_would_be_caught() -> None:
    with pytest.raises(click.UsageError):
        parse_cli(["flags", "clear", "speculative", "--scope", "64"])  # no --reason
    with pytest.raises(AssertionError):
        parse_cli(["incidents", "describe", "42"])
