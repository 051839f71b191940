"""What the batching tests share: jobs handed to the loop directly, and a first token that
holds the loop until the test has acted on it."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from engine.decoding import Encoded, RowState
from engine.runtime import Runtime
from engine.scheduler import Job


def make_job(rt: Runtime, text: str, row: int, *, k: int = 0, max_new: int = 16,
        eager: bool = False) -> Job:
    """Return a Job for `text` on `row`, routed as the runtime routes it."""
    ids = list(rt.tokenizer(text).input_ids)
    _path, length, key = rt.router.route(len(ids), rt._flags.read())
    return Job(ids=ids, length=length, key=None if eager else key, k=k, max_new=max_new,
               deadline=None, quantized=False, row=row)


def submit_together(rt: Runtime, jobs: list[Job]) -> None:
    """Hand `jobs` to the loop so that it takes them up in one go (they join one step)."""
    sched = rt._scheduler
    assert sched is not None
    with sched._cond:  # the loop cannot look at its inbox until all are in
        for j in jobs:
            sched.submit(j)


class Handshake(threading.Event):
    """A first-token event whose set() (on the loop thread) waits for `go`: the loop holds
    after a row's first token until the test has acted on it."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def set(self) -> None:
        first = not self.is_set()
        super().set()
        if first:
            self.go.wait(timeout=60)


def break_row(rt: Runtime, monkeypatch: pytest.MonkeyPatch,
              spoil: Callable[[RowState], None], row: int = 1) -> Callable[..., RowState]:
    """Spoil the decode state of the request on `row` as it starts (so that it, and only
    it, fails later); return the real start_row, to put back."""
    start_row = rt.rows.start_row

    def broken(job: Job, tenc: Encoded | None = None) -> RowState:
        state = start_row(job, tenc)
        if job.row == row:
            spoil(state)
        return state

    monkeypatch.setattr(rt.rows, "start_row", broken)
    return start_row


def narrow_cross(enc: Encoded, c_step: bool) -> Encoded:
    """Return `enc` with its cross K/V one wide (the eager step's last axis, the C step's
    length axis): a shape every step refuses."""
    cross = enc.cross[..., :1, :] if c_step else enc.cross[..., :1]
    return type(enc)(cross, enc.mask_bias)
