"""The real `tailwatch serve` in a child process, open-loop traffic to it, and its scrapes.

Shared by `bench.service_soak` and `bench.self_interference`: the service runs as an
operator starts it (`python -m monitor.cli --config FILE serve`, its analysis worker a
child of that process), on loopback ports of its own, with a settings file this module
writes; nothing in the service is patched.

Example:
    with WebhookReceiver() as rx, ServiceProcess(folder, settings_for(folder, rx.url)) as svc:
        traffic = PoissonTraffic(svc.url, rate_per_s=10, token=svc.token)
        traffic.start(); ...; traffic.stop()
        svc.rss()            # (serve bytes, worker bytes or None)
        svc.metrics()        # parsed /metrics of the serving process (worker_metrics: its worker's)
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import httpx
import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families

from alerts.baselines import rule_scope
from alerts.rules import Rule
from engine.builtin.task import MIN_INPUT_BYTES, make_input
from engine.config import DEFAULT_BUCKETS
from monitor.loopback import free_port, wait_for

READY_TIMEOUT_S = 1800.0  # a cold compile of every bucket on a shared core is slow
STOP_TIMEOUT_S = 60.0


def settings_for(folder: Path, webhook_url: str, *, database_url: str | None = None,
                 probe_interval_s: float | None = None,
                 evaluate_interval_s: float | None = None,
                 extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Return a settings mapping: SQLite in `folder`, one generic webhook, shipped defaults else.

    Intervals left None keep the shipped ones; `extra` sections are merged on top.
    """
    scheduler: dict[str, Any] = {}
    if probe_interval_s is not None:
        scheduler["probe_interval_s"] = probe_interval_s
    if evaluate_interval_s is not None:
        scheduler["evaluate_interval_s"] = evaluate_interval_s
    out: dict[str, Any] = {
        "database_url": database_url or f"sqlite:///{folder / 'service.db'}",
        "auto_migrate": True,
        "instance_id": "bench",
        "scheduler": scheduler,
        "alerts": {"webhooks": [{"name": "bench", "url": webhook_url, "format": "generic"}]},
        "report": {"out_dir": str(folder / "reports")},
    }
    for section, values in (extra or {}).items():
        if isinstance(values, Mapping) and isinstance(out.get(section), dict):
            out[section] = {**out[section], **values}
        else:
            out[section] = values
    return out


class ServiceProcess:
    """Run `tailwatch serve` with `settings` until the with-block ends; its log in `folder`.

    The API token is generated here (auth stays on, as shipped); the ports are free
    loopback ones. Entering waits for `/readyz` 200 (engine warm, database reachable).
    """

    def __init__(self, folder: Path, settings: Mapping[str, Any], *,
                 ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.folder = folder
        self.token = secrets.token_hex(16)
        self.port, self.worker_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout_s = ready_timeout_s
        full = {**settings, "api_token": self.token,
                "api": {**dict(settings.get("api") or {}), "host": "127.0.0.1",
                        "port": self.port},
                "worker": {**dict(settings.get("worker") or {}), "host": "127.0.0.1",
                           "port": self.worker_port}}
        self.config_file = folder / "tailwatch.yaml"
        self.log_file = folder / "serve.log"
        self._settings = full
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._client = httpx.Client(base_url=self.url, timeout=30.0)

    @property
    def pid(self) -> int:
        """Return the serving process's pid."""
        assert self._proc is not None, "not started"
        return self._proc.pid

    def start(self) -> None:
        """Write the settings file, start `serve` and wait until it is ready."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(yaml.safe_dump(self._settings, sort_keys=False))
        # The service reads TAILWATCH_* variables too: only the settings file counts here.
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TAILWATCH_")}
        self._log = self.log_file.open("ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "monitor.cli", "--config", str(self.config_file), "serve"],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_for(self._ready, self.ready_timeout_s, interval_s=1.0,
                     what=f"/readyz 200 from tailwatch serve (log: {self.log_file})")
        except BaseException:
            self.stop()
            raise
        if self._proc.poll() is not None:
            code = self._proc.returncode
            self.stop()
            raise RuntimeError(f"tailwatch serve exited with code {code} (log: {self.log_file})")

    def _ready(self) -> bool:
        assert self._proc is not None
        if self._proc.poll() is not None:
            return True  # exited: start() reports it
        try:
            return self._client.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> int | None:
        """Stop `serve` (SIGTERM; it stops its worker), then kill; return its exit code."""
        proc, self._proc = self._proc, None
        code = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        self._client.close()
        return code

    def __enter__(self) -> ServiceProcess:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def worker(self) -> psutil.Process | None:
        """Return the analysis worker child (None while it is restarting)."""
        try:
            for child in psutil.Process(self.pid).children():
                if "worker" in child.cmdline():
                    return child
        except psutil.Error:
            return None
        return None

    def rss(self) -> tuple[int, int | None]:
        """Return the resident set sizes of the serving process and of its worker."""
        serve = psutil.Process(self.pid).memory_info().rss
        worker = self.worker()
        try:
            return serve, (worker.memory_info().rss if worker is not None else None)
        except psutil.Error:
            return serve, None

    def cpu_seconds(self) -> tuple[float | None, float | None]:
        """Return the CPU seconds (user + system) the serving process and its worker used."""
        def used(p: psutil.Process | None) -> float | None:
            try:
                return None if p is None else sum(p.cpu_times()[:2])
            except psutil.Error:
                return None
        return used(psutil.Process(self.pid)), used(self.worker())

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Return the serving process's /metrics as (sample name, labels) -> value."""
        text = self._client.get("/metrics").text
        return parse_metrics(text)

    def worker_metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Return the worker's /metrics as `metrics` does (empty while it cannot answer)."""
        try:
            r = httpx.get(f"http://127.0.0.1:{self.worker_port}/metrics", timeout=10.0,
                          headers={"Authorization": f"Bearer {self.token}"})
        except httpx.HTTPError:
            return {}
        return parse_metrics(r.text) if r.status_code == 200 else {}

    def get(self, path: str, *, timeout_s: float = 120.0, **params: Any) -> Any:
        """GET an authenticated operator request; return its JSON (raise on non-2xx)."""
        r = self._client.get(path, params=params, timeout=timeout_s,
                             headers={"Authorization": f"Bearer {self.token}"})
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: Mapping[str, Any], *, timeout_s: float = 300.0) -> Any:
        """POST an authenticated operator request; return its JSON (raise on non-2xx)."""
        r = self._client.post(path, json=dict(body), timeout=timeout_s,
                              headers={"Authorization": f"Bearer {self.token}"})
        r.raise_for_status()
        return r.json()


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def unix_time(text: str) -> float:
    """Return the unix time of an ISO timestamp (naive: UTC)."""
    t = datetime.fromisoformat(text)
    return (t if t.tzinfo is not None else t.replace(tzinfo=UTC)).timestamp()


def armed_rules(baselines: Iterable[Mapping[str, Any]], rules: Sequence[Rule]
                ) -> dict[str, float]:
    """Return rule -> unix time its first usable baseline was stored, for the armed rules.

    `baselines` are GET /v1/baselines rows; usable: of the rule's metric and scope
    (source, match labels, window; not a season's), on `min_baseline_cycles` cycles.
    """
    out: dict[str, float] = {}
    rows = [b for b in baselines if "season" not in (b.get("scope") or {})]
    for rule in rules:
        want = rule_scope(rule, {})
        for b in rows:
            scope = b.get("scope") or {}
            if (b.get("metric") != rule.metric or int(b.get("samples") or 0)
                    < rule.min_baseline_cycles or ("window" in scope) != ("window" in want)
                    or any(scope.get(k) != v for k, v in want.items())):
                continue
            at = unix_time(str(b["created_at"]))
            out[rule.name] = min(out.get(rule.name, at), at)
    return out


def rules_armed(svc: ServiceProcess, rules: Sequence[Rule]) -> dict[str, float]:
    """Return rule -> unix time it armed, as the service tells it (`armed_rules` of GET
    /v1/baselines); {} while none has, or when the service did not answer.

    The active rows first (few); once a rule has armed, the inactive ones too: a refresh
    deactivates the row that armed it, and the armed time is the earliest.
    """
    try:
        if not armed_rules(svc.get("/v1/baselines", include_inactive=False), rules):
            return {}
        return armed_rules(svc.get("/v1/baselines", include_inactive=True), rules)
    except httpx.HTTPError as e:  # asked again at the next poll
        print(f"GET /v1/baselines failed: {e}", flush=True)
        return {}


def stop_on_sigterm(signum: int, _frame: FrameType | None) -> None:
    """Turn SIGTERM into SystemExit, which unwinds a bench's with-blocks: its `serve`
    (and hog) stop instead of outliving it. Once: a second SIGTERM must not cut the
    unwinding short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def parse_metrics(text: str) -> Samples:
    """Return Prometheus text as (sample name, labels) -> value."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out


def metric_sum(samples: Samples, name: str, **labels: str) -> float:
    """Return the sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@dataclass(frozen=True)
class Answer:
    """One real request: when it was due, its status (0: no answer) and client-side latency."""

    due: float  # time.time() it was scheduled for (open loop: latency counts from here)
    status: int
    latency_s: float
    bucket: str = ""  # the bucket the service reported (empty unless 200)


def bucket_sizes(buckets: Sequence[int] = DEFAULT_BUCKETS) -> list[tuple[int, int]]:
    """Return one (min, max) input size in bytes per bucket (1 byte = 1 token, plus EOS)."""
    out, low = [], MIN_INPUT_BYTES
    for edge in buckets:
        out.append((low, edge - 1))
        low = edge
    return out


class PoissonTraffic:
    """Send real requests as a Poisson process at `rate_per_s`, open loop.

    A pacing thread draws exponential gaps and hands each request to a pool, so a slow
    answer never delays the next arrival; latency counts from the scheduled time, so
    time a request spent waiting for a free client thread counts too. Inputs are
    in-domain, buckets drawn uniformly.
    """

    def __init__(self, base_url: str, *, rate_per_s: float, token: str | None = None,
                 seed: int = 11, concurrency: int = 64,
                 buckets: Sequence[int] = DEFAULT_BUCKETS) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"rate_per_s: must be > 0, got {rate_per_s}")
        self.rate_per_s = rate_per_s
        self._rng = random.Random(seed)
        self._sizes = bucket_sizes(buckets)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(
            base_url=base_url, timeout=120.0, headers=headers,
            limits=httpx.Limits(max_connections=concurrency,
                                max_keepalive_connections=concurrency))
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="bench-traffic")
        self._lock = threading.Lock()
        self._answers: list[Answer] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pace, name="bench-pacer", daemon=True)

    def start(self) -> None:
        """Start sending."""
        self._thread.start()

    def stop(self) -> None:
        """Stop sending and wait for the requests in flight."""
        self._stop.set()
        self._thread.join(10)
        self._pool.shutdown(wait=True)
        self._client.close()

    def drain(self) -> list[Answer]:
        """Return the answers since the last call, and forget them."""
        with self._lock:
            out, self._answers = self._answers, []
        return out

    def _pace(self) -> None:
        due = time.time()
        while not self._stop.is_set():
            due += self._rng.expovariate(self.rate_per_s)
            lo, hi = self._rng.choice(self._sizes)
            text = make_input("in_domain", self._rng, self._rng.randint(lo, hi))
            if self._stop.wait(max(0.0, due - time.time())):
                return
            self._pool.submit(self._send, due, text)

    def _send(self, due: float, text: str) -> None:
        try:
            r = self._client.post("/v1/generate", json={"text": text})
        except httpx.HTTPError:
            answer = Answer(due, 0, time.time() - due)
        else:
            bucket = r.json().get("bucket", "") if r.status_code == 200 else ""
            answer = Answer(due, r.status_code, time.time() - due, str(bucket))
        with self._lock:
            self._answers.append(answer)


def percentile(values: Sequence[float], q: float) -> float:
    """Return the nearest-rank `q` quantile (0-1) of `values` (nan when empty)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def read_posts(path: Path) -> list[tuple[float, Any]]:
    """Return (unix time, JSON body) of every POST a receiver logged to `path` (none if
    it logged nothing yet)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            out.append((float(entry["at"]), entry.get("body")))
    return out
