"""`tailwatch incidents list|show`: incidents over the HTTP API (--url, --token)."""

from __future__ import annotations

import json

import click

from monitor.cli.operator import _api, _connection_options, _Group, _print, _remember


@click.group(cls=_Group)
@_connection_options
@click.pass_context
def incidents(ctx: click.Context, url: str, token: str | None) -> None:
    """Inspect incidents: alerts grouped, with their probable cause."""
    _remember(ctx, url, token)


@incidents.command("list")
@click.option("--state", type=click.Choice(["open", "resolved", "all"]), default="all",
              show_default=True)
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def incidents_list(ctx: click.Context, state: str, limit: int, as_json: bool) -> None:
    """List incidents, newest first."""
    body = _api(ctx).call("GET", "/v1/incidents", params={"state": state, "limit": limit})
    _print(body, ["id", "state", "severity", "members", "families", "cause", "started_at",
                  "resolved_at"], as_json)


@incidents.command("show")
@click.argument("incident_id", type=click.IntRange(1, 2**31 - 1))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def incidents_show(ctx: click.Context, incident_id: int, as_json: bool) -> None:
    """Show one incident: summary, cause and evidence, members, timeline, flags, notifications."""
    body = _api(ctx).call("GET", f"/v1/incidents/{incident_id}")
    if as_json:
        click.echo(json.dumps(body, indent=2, default=str))
        return
    click.echo(f"incident {body['id']} ({body['state']}, {body['severity']}) "
               f"since {body['started_at']}"
               + (f", resolved {body['resolved_at']}" if body["resolved_at"] else ""))
    click.echo(body["summary"])
    click.echo(f"probable cause: {body['cause_text']}")
    click.echo(f"evidence: {json.dumps(body['evidence'], sort_keys=True)}")
    click.echo("\nmembers:")
    _print(body["member_alerts"], ["id", "rule", "state", "severity", "labels",
                                   "relative_change", "fired_at", "resolved_at"], False)
    click.echo("\ntimeline:")
    _print(body["timeline"], ["at", "kind", "alert_id", "detail"], False)
    click.echo("\nflag changes:")
    _print(body["flag_changes"], ["at", "name", "scope", "action", "new_value", "alert_id"],
           False)
    click.echo("\nnotifications:")
    _print(body["notifications"], ["created_at", "target", "format", "status", "state"], False)
