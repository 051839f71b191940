"""The demo's view of the service: the public HTTP API only (what an operator has)."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


class ServiceClient:
    """Read and change the service over HTTP; write calls carry the operator's token.

    Example:
        api = ServiceClient("http://127.0.0.1:8123", token="...")
        api.alerts("firing")
        api.set_flag("bucketing", False, reason="experiment")
    """

    def __init__(self, base_url: str, *, token: str | None = None,
                 timeout_s: float = 30.0) -> None:
        self.token = token
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _auth(self, token: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _get(self, path: str, **params: Any) -> Any:
        r = self._http.get(path, params={k: v for k, v in params.items() if v is not None})
        r.raise_for_status()
        return r.json()

    def readyz(self) -> tuple[int, dict[str, Any]]:
        """Return (status code, body) of GET /readyz."""
        r = self._http.get("/readyz")
        return r.status_code, r.json()

    def alerts(self, state: str = "open") -> list[dict[str, Any]]:
        """Return alerts in `state` (open, firing, resolved, all), newest first."""
        return self._get("/v1/alerts", state=state, limit=1000)

    def probe_cycles(self, limit: int = 50) -> list[dict[str, Any]]:
        """Return the latest canary cycle runs, newest first."""
        return self._get("/v1/probes/runs", kind="cycle", limit=limit)

    def flags(self) -> dict[str, Any]:
        """Return GET /v1/flags: stored rows and the effective flags."""
        return self._get("/v1/flags")

    def audit(self, name: str | None = None) -> list[dict[str, Any]]:
        """Return flag audit rows, newest first."""
        return self._get("/v1/flags/audit", name=name, limit=1000)

    def baselines(self, metric: str) -> list[dict[str, Any]]:
        """Return the active baselines of `metric`."""
        return self._get("/v1/baselines", metric=metric)

    def set_flag(self, name: str, value: Any, *, reason: str, scope: str = "global",
                 token: str | None = "default") -> httpx.Response:
        """PUT a manual flag; token "default" uses the operator's, None sends none."""
        tok = self.token if token == "default" else token
        return self._http.put(f"/v1/flags/{name}", headers=self._auth(tok),
                              json={"scope": scope, "value": value, "reason": reason})

    def clear_flag(self, name: str, *, reason: str, scope: str = "global") -> httpx.Response:
        """DELETE a manual flag with the operator's token."""
        return self._http.delete(f"/v1/flags/{name}", headers=self._auth(self.token),
                                 params={"reason": reason, "scope": scope})

    def run_cycle(self, *, ab: bool, timeout_s: float) -> dict[str, Any]:
        """POST /v1/probes/run: one canary cycle now (with its A/B arms when `ab`)."""
        r = self._http.post("/v1/probes/run", headers=self._auth(self.token),
                            json={"kind": "cycle", "ab": ab}, timeout=timeout_s)
        r.raise_for_status()
        return r.json()

    def speedups(self) -> list[dict[str, Any]]:
        """Return each optimization's measured speedup per bucket (the last day's A/B cycles)."""
        return self._get("/v1/probes/speedups")

    def generate(self, text: str) -> dict[str, Any]:
        """POST /v1/generate and return the answer (raises on a non-200)."""
        r = self._http.post("/v1/generate", json={"text": text})
        r.raise_for_status()
        return r.json()

    def metric_samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        """Return (labels, value) of every sample of metric `name` from /metrics."""
        r = self._http.get("/metrics")
        r.raise_for_status()
        return [(dict(sample.labels), sample.value)
                for family in text_string_to_metric_families(r.text)
                for sample in family.samples if sample.name == name]

    def metric(self, name: str) -> float:
        """Return the sum of every sample of metric `name` (a counter's total) from /metrics."""
        return sum(value for _, value in self.metric_samples(name))
