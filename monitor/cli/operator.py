"""Operator commands over the HTTP API: `tailwatch flags|alerts|baselines ...`.

They talk to a running tailwatch (--url / TAILWATCH_URL) with the bearer token from
--token / TAILWATCH_API_TOKEN, so every change is authenticated and audited by the
service. Any failure is one line on stderr and exit code 1.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import click
import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class Api:
    """A small client of the tailwatch API returning decoded JSON or raising ClickException."""

    def __init__(self, url: str, token: str | None, *, timeout_s: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s,
                                    transport=transport)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send one request; raise ClickException with the server's error message."""
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise click.ClickException(
                f"cannot reach tailwatch at {self.url}: {type(exc).__name__}: {exc}") from None
        if response.is_success:
            return response.json()
        raise click.ClickException(_error_line(response))

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()


def _error_line(response: httpx.Response) -> str:
    try:
        err = response.json()["error"]
        message = err["message"]
        field = err.get("field")
    except (ValueError, KeyError, TypeError):
        message, field = response.text.strip()[:200] or response.reason_phrase, None
    where = f" (field {field})" if field and f"{field}:" not in message else ""
    return f"HTTP {response.status_code}: {message}{where}"


def _api(ctx: click.Context) -> Api:
    obj = ctx.find_root().obj or {}
    params = ctx.find_object(dict) or {}
    api = Api(params.get("url") or DEFAULT_URL, params.get("token"),
              transport=obj.get("transport"))
    ctx.call_on_close(api.close)
    return api


def _connection_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--token", envvar="TAILWATCH_API_TOKEN", default=None,
                     help="Bearer token (TAILWATCH_API_TOKEN).")(f)
    return click.option("--url", envvar="TAILWATCH_URL", default=DEFAULT_URL,
                        show_default=True, help="tailwatch base URL (TAILWATCH_URL).")(f)


def _override(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    # The subcommand shares its group's ctx.obj: a value given here wins.
    if value is not None and param.name is not None:
        ctx.ensure_object(dict)[param.name] = value


class _Command(click.Command):
    """A subcommand that also takes --url and --token (`tailwatch flags list --url ...`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params += [
            click.Option(["--url"], default=None, expose_value=False, callback=_override,
                         help="tailwatch base URL (overrides the group's --url)."),
            click.Option(["--token"], default=None, expose_value=False, callback=_override,
                         help="Bearer token (overrides the group's --token)."),
        ]


class _Group(click.Group):
    """An operator command group whose subcommands accept the connection options too."""

    command_class = _Command


def _remember(ctx: click.Context, url: str, token: str | None) -> None:
    ctx.ensure_object(dict)
    ctx.obj["url"] = url
    ctx.obj["token"] = token


def _print(rows: Iterable[dict[str, Any]], columns: list[str], as_json: bool) -> None:
    rows = list(rows)
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        click.echo("(none)")
        return
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    click.echo("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in sorted(value.items())) or "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _parse_value(raw: str) -> Any:
    """Return a flag value from the command line: JSON when it parses, else the string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


# -- flags -----------------------------------------------------------------------------

@click.group(cls=_Group)
@_connection_options
@click.pass_context
def flags(ctx: click.Context, url: str, token: str | None) -> None:
    """List, set and clear runtime flags (audited)."""
    _remember(ctx, url, token)


@flags.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def flags_list(ctx: click.Context, as_json: bool) -> None:
    """Show stored flags (manual and auto, * = in force) and the effective values."""
    body = _api(ctx).call("GET", "/v1/flags")
    if as_json:
        click.echo(json.dumps(body, indent=2, default=str))
        return
    rows = [{**f, "in_force": "*" if f.get("in_force") else ""} for f in body["flags"]]
    _print(rows, ["in_force", "name", "scope", "value", "source", "actor", "reason",
                  "expires_at"], False)
    eff = body["effective"]
    spec = ", ".join(f"{b}={json.dumps(v)}" for b, v in sorted(eff["speculative"].items()))
    click.echo(f"effective: compiled={json.dumps(eff['compiled'])} "
               f"bucketing={json.dumps(eff['bucketing'])} "
               f"speculative={json.dumps(eff['speculative_default'])}"
               f"{' (' + spec + ')' if spec else ''} "
               f"speculative_probation={eff['speculative_probation']}")


@flags.command("set")
@click.argument("name")
@click.argument("value")
@click.option("--scope", default="global", show_default=True,
              help='"global" or a bucket label such as 64.')
@click.option("--reason", required=True, help="Why (recorded in the audit log).")
@click.option("--expires-at", default=None, help="RFC 3339 time the override lapses.")
@click.pass_context
def flags_set(ctx: click.Context, name: str, value: str, scope: str, reason: str,
              expires_at: str | None) -> None:
    """Set flag NAME to VALUE (JSON: true, false, 0.1) in a scope; manual wins over auto."""
    payload: dict[str, Any] = {"scope": scope, "value": _parse_value(value), "reason": reason}
    if expires_at:
        payload["expires_at"] = expires_at
    body = _api(ctx).call("PUT", f"/v1/flags/{name}", json=payload)
    click.echo(f"set {name}[{scope}] = {json.dumps(body.get('value'))}")


@flags.command("clear")
@click.argument("name")
@click.option("--scope", default="global", show_default=True)
@click.option("--reason", required=True, help="Why (recorded in the audit log).")
@click.pass_context
def flags_clear(ctx: click.Context, name: str, scope: str, reason: str) -> None:
    """Remove the manual override of flag NAME in a scope."""
    _api(ctx).call("DELETE", f"/v1/flags/{name}", params={"scope": scope, "reason": reason})
    click.echo(f"cleared {name}[{scope}]")


@flags.command("audit")
@click.option("--name", default=None, help="Only this flag.")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def flags_audit(ctx: click.Context, name: str | None, limit: int, as_json: bool) -> None:
    """Show the flag audit log, newest first."""
    params: dict[str, Any] = {"limit": limit}
    if name:
        params["name"] = name
    body = _api(ctx).call("GET", "/v1/flags/audit", params=params)
    _print(body, ["at", "name", "scope", "action", "actor", "source", "old_value",
                  "new_value", "reason"], as_json)


# -- alerts ----------------------------------------------------------------------------

@click.group(cls=_Group)
@_connection_options
@click.pass_context
def alerts(ctx: click.Context, url: str, token: str | None) -> None:
    """Inspect alerts."""
    _remember(ctx, url, token)


@alerts.command("list")
@click.option("--state", type=click.Choice(["open", "pending", "firing", "resolved", "all"]),
              default="open", show_default=True)
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def alerts_list(ctx: click.Context, state: str, limit: int, as_json: bool) -> None:
    """List alerts, newest first."""
    body = _api(ctx).call("GET", "/v1/alerts", params={"state": state, "limit": limit})
    _print(body, ["id", "rule", "state", "severity", "labels", "value", "baseline",
                  "relative_change", "started_at"], as_json)


@alerts.command("sensitivity")
@click.option("--rule", default=None, help="Only this rule.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def alerts_sensitivity(ctx: click.Context, rule: str | None, as_json: bool) -> None:
    """Show what each rule can see per series: the shift it confirms within N cycles,
    its expected false pages and the threshold in force."""
    body = _api(ctx).call("GET", "/v1/rules/sensitivity",
                          params={"rule": rule} if rule else None)
    if as_json:
        _print(body, [], as_json=True)
        return

    def pct(s: dict[str, Any], key: str) -> str | None:
        v = s.get(key)
        return None if v is None else f"{'+' if s['direction'] > 0 else '-'}{v:.0%}"

    _print(({"rule": s["rule"], "scope": s["scope"],
             "cohort": f"{s['model_version'] or '?'}/{s['config_hash'] or '?'}",
             "status": s["status"], "detects": None if s["detectable_change"] is None
             else f"{pct(s, 'detectable_change')} in {s['within_cycles']} cycles",
             "false_pages_30d": s["false_pages_30d"],
             "threshold": str(pct(s, "threshold")) + (
                 f" (configured {pct(s, 'configured_threshold')})" if s["widened"] else ""),
             "budget": "off" if s["budget_per_30d"] is None else s["budget_per_30d"],
             "cycles": s["cycles"]} for s in body),
           ["rule", "scope", "cohort", "status", "detects", "false_pages_30d", "threshold",
            "budget", "cycles"], as_json=False)
    for s in body:
        if s["widened"] or s["status"] != "ok":
            click.echo(f"{s['rule']} [{_cell(s['scope'])}]: {s['summary']}")


# -- baselines -------------------------------------------------------------------------

@click.group(cls=_Group)
@_connection_options
@click.pass_context
def baselines(ctx: click.Context, url: str, token: str | None) -> None:
    """List, pin and unpin alert baselines."""
    _remember(ctx, url, token)


@baselines.command("list")
@click.option("--metric", default=None)
@click.option("--all", "include_inactive", is_flag=True, help="Include inactive baselines.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def baselines_list(ctx: click.Context, metric: str | None, include_inactive: bool,
                   as_json: bool) -> None:
    """List baselines."""
    params: dict[str, Any] = {"include_inactive": include_inactive}
    if metric:
        params["metric"] = metric
    body = _api(ctx).call("GET", "/v1/baselines", params=params)
    _print(body, ["id", "metric", "scope", "kind", "value", "samples", "pinned_by",
                  "created_at"], as_json)


@baselines.command("pin")
@click.argument("metric")
@click.option("--scope", default="", help='Labels, e.g. "bucket=64,source=canary".')
@click.option("--value", type=float, default=None,
              help="Pin this value (default: the current rolling baseline).")
@click.option("--note", default=None)
@click.pass_context
def baselines_pin(ctx: click.Context, metric: str, scope: str, value: float | None,
                  note: str | None) -> None:
    """Pin METRIC's baseline in a scope."""
    payload = {"action": "pin", "metric": metric, "scope": scope, "value": value, "note": note}
    body = _api(ctx).call("POST", "/v1/baselines", json=payload)
    b = body.get("baseline") or {}
    click.echo(f"pinned {metric} [{_cell(b.get('scope'))}] = {_cell(b.get('value'))}")


@baselines.command("unpin")
@click.argument("metric")
@click.option("--scope", default="", help='Labels, e.g. "bucket=64,source=canary".')
@click.pass_context
def baselines_unpin(ctx: click.Context, metric: str, scope: str) -> None:
    """Unpin METRIC's baseline in a scope (the rolling one applies again)."""
    body = _api(ctx).call("POST", "/v1/baselines",
                          json={"action": "unpin", "metric": metric, "scope": scope})
    click.echo(f"unpinned {body.get('unpinned', 0)} baseline(s) of {metric}")
