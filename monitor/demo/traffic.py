"""Scripted real traffic: POST /v1/generate from a paced thread, every answer kept."""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import httpx

from engine.builtin.task import MIN_INPUT_BYTES, input_for, make_input, valid_end_indices


@dataclass(frozen=True)
class Lane:
    """One kind of request: a domain and an input size range in bytes, drawn by weight."""

    name: str
    domain: str
    min_bytes: int
    max_bytes: int
    weight: float = 1.0


@dataclass(frozen=True)
class Sample:
    """One answered request (status != 200: the other fields are empty)."""

    at: float  # time.time() when the answer arrived
    lane: str
    status: int
    bucket: str = ""
    path: str = ""
    decoding: str = ""
    latency_s: float = 0.0
    acceptance_rate: float | None = None


def bucket_lanes(buckets: Sequence[int], domain: str, prefix: str = "") -> list[Lane]:
    """Return one lane per bucket: inputs of that bucket's token range (1 byte = 1 token + EOS)."""
    lanes = []
    low = MIN_INPUT_BYTES
    for edge in buckets:
        lanes.append(Lane(f"{prefix}{domain}/{edge}", domain, low, edge - 1))
        low = edge
    return lanes


class TrafficGenerator:
    """Send requests of the current lanes at up to `rate_per_s`, one at a time.

    Example:
        gen = TrafficGenerator(base_url, rate_per_s=4)
        gen.set_lanes(bucket_lanes((16, 32, 64), "in_domain"))
        gen.start(); ...; gen.stop()
    """

    def __init__(self, base_url: str, *, rate_per_s: float, seed: int = 7,
                 clock: Callable[[], float] = time.time) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"rate_per_s: must be > 0, got {rate_per_s}")
        self.base_url = base_url
        self.rate_per_s = rate_per_s
        self.clock = clock
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._lanes: list[Lane] = []
        self._lengths: dict[str, tuple[int, ...]] = {}
        self._samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-traffic", daemon=True)

    def set_lanes(self, lanes: Sequence[Lane], *,
                  lengths: Mapping[str, tuple[int, ...]] | None = None
                  ) -> None:
        """Send these lanes from now on (empty: pause); `lengths` pins a lane's sizes."""
        with self._lock:
            self._lanes = list(lanes)
            self._lengths = dict(lengths or {})

    def start(self) -> None:
        """Start the sending thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop sending and wait for the request in flight."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(60)

    def samples(self, *, since: float = 0.0, lane: str | None = None,
                bucket: str | None = None) -> list[Sample]:
        """Return answered requests, oldest first, filtered."""
        with self._lock:
            out = list(self._samples)
        return [s for s in out if s.at >= since and (lane is None or s.lane == lane)
                and (bucket is None or s.bucket == bucket)]

    def _pick(self) -> tuple[Lane, str] | None:
        with self._lock:
            lanes, lengths = self._lanes, self._lengths
            if not lanes:
                return None
            lane = self._rng.choices(lanes, weights=[ln.weight for ln in lanes])[0]
            pinned = lengths.get(lane.name)
            size = (self._rng.choice(pinned) if pinned
                    else self._rng.randint(lane.min_bytes, lane.max_bytes))
            if pinned:
                # A fixed end word too: the same exact shape every time it is drawn.
                text = input_for(lane.domain, valid_end_indices(lane.domain)[0], size)
            else:
                text = make_input(lane.domain, self._rng, size)
        return lane, text

    def _run(self) -> None:
        period = 1.0 / self.rate_per_s
        with httpx.Client(base_url=self.base_url, timeout=120.0) as client:
            while not self._stop.is_set():
                began = time.monotonic()
                picked = self._pick()
                if picked is None:
                    self._stop.wait(0.1)
                    continue
                lane, text = picked
                self._record(lane, self._send(client, text))
                self._stop.wait(max(0.0, period - (time.monotonic() - began)))

    def _send(self, client: httpx.Client, text: str) -> httpx.Response | None:
        try:
            return client.post("/v1/generate", json={"text": text})
        except httpx.HTTPError:
            return None

    def _record(self, lane: Lane, response: httpx.Response | None) -> None:
        if response is None or response.status_code != 200:
            sample = Sample(self.clock(), lane.name,
                            response.status_code if response is not None else 0)
        else:
            body = response.json()
            sample = Sample(self.clock(), lane.name, 200, bucket=body["bucket"],
                            path=body["path"], decoding=body["decoding"],
                            latency_s=body["latency_s"],
                            acceptance_rate=body.get("acceptance_rate"))
        with self._lock:
            self._samples.append(sample)


def median_latency(samples: Sequence[Sample]) -> float | None:
    """Return the median latency of answered samples, or None."""
    ok = [s.latency_s for s in samples if s.status == 200]
    return statistics.median(ok) if ok else None
