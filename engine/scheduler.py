"""Continuous batching: one loop thread that owns every model call of a batched engine.

A request holds a row (its admission slot: a self-attention cache allocated once and
reused) and is handed to the loop as a Job. Between steps the loop takes new jobs, runs
their encoders (those of one bucket taken together in one call: engine.group_encode), and
they join the running batch; each step decodes one token for every row (engine.native's
`rows`, engine.t5.decode_rows eager, or the fixed-row compiled step engine.t5.decode_fixed
on engine.row_buffers: each weight read once for all rows); a row leaves at EOS, at its
token limit, or when it is cancelled or past its deadline, and the others never wait for
it. On the C step a step verifies instead when the measured costs expect more tokens per
second from it (a lone row with a draft always does, as the unbatched engine decodes):
the rows' drafts propose together, one draft call a draft step over the rows still
proposing, and one target call checks every row's proposals. Elsewhere, while the batch
holds one row that has a draft, the step is a speculative round instead, and so is a step
of several rows when the rounds' measured tokens per second beat the batched step's at
that batch size. Every output is the target's own greedy tokens whichever ran
(engine.decoding.RowState).

Where sharing a step gains little (on a CPU a step over B rows can cost about what the rows
cost one at a time), rows stepping together all finish late, while rows taking turns finish
one after another, the first as if alone. So while the batch holds a few rows (TURN_ROWS)
and no caller waits for a row, the oldest real row steps alone (and speculates, as a lone
row does) while the others wait their turn, where the steps measured so far expect the
rows' finish times to sum lower that way (_turn). A row that waits its turn is not paused:
it keeps its place and steps again as soon as the rule says so, and its waiting seconds
(Job.turn_s) count in its GenerateResult.batch_wait_s. An arrival that would wait its turn
waits in the queue instead, its encoder not yet run (_take), as it would for an unbatched
engine's decode stream: encoded at once, it would delay the running row by its encoder for
nothing.

    job = Job(ids, length, key, k, max_new, deadline, quantized, row)
    scheduler.submit(job)
    decoded = scheduler.wait(job)  # raises what failed this request only

The loop owns every compiled call (CUDA graph trees are per thread), and a failing
request fails only its own caller: the loop survives it (an error that is no one row's
fails the rows of that step, and the loop goes on). Waiting real requests join before
waiting synthetic ones (probes), whatever their order of arrival. What it records of its
steps and of each request goes through its `recorder` (engine.scheduler_recorder).

Nor does a running synthetic request hold a real one up (`extra_row`: engine.admission
preempts). Admission grants a real caller that would wait while a synthetic one holds a
row the extra row (one more self-attention cache, allocated with the others) at once; the
real job joins at the next step boundary, and a step decodes every real row and as many
synthetic rows, oldest first, as fit beside them within `max_batch` (none beside a real
row that runs alone, and a synthetic row that runs alone, the burst's unbatched arm, none
beside any real row). The others pause: they leave the step set and keep their row and
decode state, and resume unchanged at the first step with room for them (or leave there,
cancelled or past their deadline). So a step never holds more than `max_batch` rows: no
batch-size class beyond the fixed-row step's, no compile or recording at run time. A
paused job records its pauses (Job.pauses: its GenerateResult's preempted_s, and token
times that leave them out), and a pause that admission's extra row did not grant (a real
row beside a synthetic one that runs alone) counts in `preemptions`. A synthetic job joins
only where the step has room for it (it never joins to pause), and a real job while the
real rows leave it one (it waits in the inbox for a real row only).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine import t5
from engine.decoding import Decoded, Encoded, RowState
from engine.draft_length import expected_tokens
from engine.errors import Cancelled, DoesNotFit, NotReady, RequestTimeout
from engine.group_encode import GROUP_MAX
from engine.protocol import BatchSnapshot
from engine.runner import Fns, ModelRunner
from engine.scheduler_recorder import PHASE_DECODE, PHASE_VERIFY, StepRecorder

log = logging.getLogger(__name__)

# The batching window adapts to the queue over about this many seconds (exponential
# smoothing): a burst shortens it at once, an idle stretch lengthens it back slowly.
WINDOW_SMOOTHING_S = 15.0
Clock = Callable[[], float]
# The per-step choice between batched verification and batched direct steps: the cost fit
# forgets old calls (weight per call), acceptance forgets old rounds, a row's own rounds
# count against this many pseudo-trials of every row's, and one step in EXPLORE_EVERY takes
# the other choice so that its cost stays measured.
COST_DECAY = 0.98
ACCEPT_DECAY = 0.995
PRIOR_TRIALS = 8.0
EXPLORE_EVERY = 16
# Rows take turns (the module doc) only while the batch holds at most this many. The rule
# that decides a turn weighs the rows already here, not the arrivals to come: where sharing
# a step gains little, it would take turns at any batch size and give up the throughput
# batching adds under load. The rows in the batch say the load: a queue served one at a
# time holds rho / (1 - rho) requests on average at use rho (M/M/1), so more than 4 rows
# is what a load past 80% of one row at a time's capacity holds: the batch steps together.
TURN_ROWS = 4


class RowOwner(Protocol):
    """What the loop needs of the rows it decodes on (engine.rows.Rows)."""

    def row_room(self, k: int) -> int:
        """Return the most new tokens a batch row's cache holds for a request drafting k."""
        ...

    def start_row(self, job: Job, tenc: Encoded | None = None) -> RowState:
        """Encode `job`'s input on the loop thread (unless `tenc`: its encoder output from
        encode_rows); return its row's decode state."""
        ...

    def group_key(self, job: Job) -> Hashable | None:
        """Return what decides `job`'s encoder (None: it encodes alone)."""
        ...

    def encode_rows(self, jobs: list[Job]) -> list[Encoded]:
        """Encode the inputs of `jobs` (one group_key) in one call; return each one's."""
        ...

    def kv_release(self, nbytes: int) -> None:
        """Forget `nbytes` of request K/V (a batched request left)."""
        ...


@dataclass(eq=False)
class Job:
    """One request handed to the loop; the loop fills in what happened."""

    ids: list[int]
    length: int  # padded input length
    key: int | str | None  # compiled-function key, None for eager
    k: int  # draft tokens per speculative round; 0: never speculates
    max_new: int
    deadline: float | None
    quantized: bool
    row: int  # its admission slot: the index of its caches
    native: bool = True  # False: the compiled step even where the C step is bound
    alone: bool = False  # the batching flag off: runs with no batch-mates (max_batch 1)
    synthetic: bool = False  # a probe's request: joins after every waiting real one
    turn_chosen: bool = False  # held in the inbox for its turn (_take): its choice made
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    first_token: threading.Event = field(default_factory=threading.Event)  # it has one token
    decoded: Decoded | None = None
    error: BaseException | None = None
    t_submitted: float = 0.0
    t_picked: float = 0.0  # the loop took it (its encoder starts)
    t_device: float = 0.0
    t_encoded: float = 0.0
    # Recorded (the loop's recorder): the loop's step count when it joined the batch, the
    # steps (direct or speculative rounds) it took part in, and their rows summed.
    joined_step: int = -1
    steps: int = 0
    batch_sum: int = 0
    batch_max: int = 0  # the most rows in its steps: what the runtime learns costs from
    held: int = 0  # encoder-output bytes it holds
    # Seconds its row sat out steps while another row took its turn (the module doc).
    turn_s: float = 0.0
    # Paused for real rows (a synthetic job, where the loop preempts): since when (None:
    # not paused now), and each pause (resumed at, seconds) on the loop's clock.
    paused_at: float | None = None
    pauses: list[tuple[float, float]] = field(default_factory=list)

    @property
    def preempted_s(self) -> float:
        """Return the seconds it spent paused for real rows."""
        return sum(seconds for _at, seconds in self.pauses)

    def cancel(self) -> None:
        """Make the request leave the batch at the next step (its caller gets Cancelled)."""
        self.cancelled.set()


class CallFit:
    """A C call's seconds as fixed + per_position * positions: exponentially weighted least
    squares over the calls observed."""

    def __init__(self, decay: float = COST_DECAY) -> None:
        self._decay = decay
        self._n = self._x = self._xx = self._y = self._xy = 0.0

    def observe(self, positions: int, seconds: float) -> None:
        """Fold in one call of `positions` positions that took `seconds`."""
        d, x = self._decay, float(positions)
        self._n = d * self._n + 1.0
        self._x = d * self._x + x
        self._xx = d * self._xx + x * x
        self._y = d * self._y + seconds
        self._xy = d * self._xy + x * seconds

    def fit(self) -> tuple[float, float] | None:
        """Return (fixed seconds, seconds per position), None until the calls observed
        varied in size enough to tell them apart."""
        n, x = self._n, self._x
        spread = n * self._xx - x * x
        if n < 2 or spread <= 1e-9 * max(n * self._xx, 1.0):
            return None
        per = (n * self._xy - x * self._y) / spread
        if per <= 0:
            return None
        return max((self._y - per * x) / n, 0.0), per


class StepCosts:
    """What the loop measured of C-step calls: the target's calls and the draft's batched
    ones, each as fixed + per position (CallFit), the draft's seconds per proposal and per
    draft encoder (a row's first proposal runs it), and the share of proposals the target
    accepts."""

    def __init__(self, decay: float = COST_DECAY) -> None:
        self._target, self._draft = CallFit(decay), CallFit(decay)
        self.draft_s: float | None = None
        self.draft_encoder_s: float | None = None
        self._accepted, self._trials = 0.0, 0.0

    def observe(self, positions: int, seconds: float) -> None:
        """Fold in one target call of `positions` positions that took `seconds`."""
        self._target.observe(positions, seconds)

    def fit(self) -> tuple[float, float] | None:
        """Return the target call's (fixed seconds, seconds per position), None until
        measured calls varied in size enough to tell them apart."""
        return self._target.fit()

    def observe_draft_call(self, positions: int, seconds: float) -> None:
        """Fold in one batched draft call (one draft step of several rows)."""
        self._draft.observe(positions, seconds)

    def observe_draft(self, proposals: int, seconds: float) -> None:
        """Fold in one step's draft work: `proposals` tokens proposed in `seconds`."""
        self.draft_s = _smooth(self.draft_s, seconds / proposals)

    def draft_seconds(self, ks: list[int], batched: bool) -> float | None:
        """Return the draft's expected seconds to propose ks[i] tokens for each row (None:
        not measured yet): `batched`, one call per draft step over the rows still
        proposing (its fit, once told apart); else each proposal at the measured rate."""
        fit = self._draft.fit() if batched else None
        if fit is not None:
            fixed, per_position = fit
            return fixed * max(ks) + per_position * sum(ks)
        return None if self.draft_s is None else self.draft_s * sum(ks)

    def observe_draft_encoder(self, seconds: float) -> None:
        """Fold in one row's draft encoder (run at its first proposal)."""
        self.draft_encoder_s = _smooth(self.draft_encoder_s, seconds)

    def observe_acceptance(self, accepted: int, block: list[int], choice: list[int]) -> None:
        """Fold in one row's round: proposals tried (up to the first rejection) and kept."""
        d = ACCEPT_DECAY
        self._accepted = d * self._accepted + accepted
        self._trials = d * self._trials + min(accepted + 1, len(block) - 1)

    def acceptance(self, state: RowState) -> float:
        """Return the chance that `state`'s draft's next proposal is accepted: its own
        rounds so far, weighed with every row's as a prior."""
        prior_a = (self._accepted + 1.0) / (self._trials + 2.0)
        trials = state.drafts + sum(state.per_position[:-1])
        return min((state.accepted + PRIOR_TRIALS * prior_a) / (trials + PRIOR_TRIALS), 1.0)


class RowTokenCosts:
    """What a step of B rows measured: seconds until every row has one more token (the
    step's seconds times B over the tokens it emitted, each smoothed apart), by B."""

    def __init__(self) -> None:
        self._steps: dict[int, tuple[float, float]] = {}

    def observe(self, rows: int, seconds: float, tokens: int) -> None:
        """Fold in one step of `rows` rows that took `seconds` and emitted `tokens`."""
        old = self._steps.get(rows)
        self._steps[rows] = ((seconds, float(tokens)) if old is None else
                             (_smooth(old[0], seconds), _smooth(old[1], float(tokens))))

    def row_token_s(self, rows: int) -> float | None:
        """Return the seconds until each of `rows` rows has one more token, None until a
        step of that many was measured."""
        seconds_tokens = self._steps.get(rows)
        if seconds_tokens is None:
            return None
        seconds, tokens = seconds_tokens
        return seconds * rows / tokens


class Scheduler:
    """Own up to `max_batch` rows (`extra_row`: one more, admission's extra slot, while
    synthetic rows pause) and the loop that steps them (see the module doc).

    `recorder` (a StepRecorder unless given) may be replaced while the loop runs: the next
    step records into the new one, and snapshot() reads it.
    """

    def __init__(self, owner: RowOwner, *, max_batch: int, window_max_s: float,
                 waiting: Callable[[], int], clock: Clock = time.perf_counter,
                 recorder: StepRecorder | None = None, extra_row: int | None = None) -> None:
        """`extra_row`: admission's extra slot (synthetic rows pause for real ones; None:
        no row is ever paused)."""
        self._owner = owner
        self.recorder = recorder if recorder is not None else StepRecorder()
        self.max_batch = max_batch
        self.extra_row = extra_row
        # Real rows that paused a synthetic one without the extra row (admission counts
        # those with it): written by the loop only.
        self.preemptions = 0
        self.window_max_s = window_max_s
        self._waiting = waiting
        self._clock = clock
        self._cond = threading.Condition()
        self._inbox: deque[Job] = deque()
        self._tasks: deque[tuple[Callable[[], Any], Future]] = deque()  # run by the loop
        self._active: list[tuple[Job, RowState]] = []
        self._closed = False
        self._busy = 0.0  # smoothed share of time with callers waiting for a row
        self._busy_at = clock()
        self._window = window_max_s
        # Measured by the loop: batched direct step seconds by batch size, and tokens per
        # second of speculative rounds (the per-step choice between them: _speculate).
        self._step_s: dict[int, float] = {}
        self._round_tps: float | None = None
        # C-step calls' measured costs: the per-step choice between verifying every row's
        # draft proposals in one call and a direct step of every row (_draft_lengths).
        self._costs = StepCosts()
        self._choices = 0
        # Off (benches, tests): each row's draft proposes in its own call, as a lone row's.
        self.batch_drafts = True
        # Measured by the loop, whatever each step ran: the choice between rows taking
        # turns and stepping together (_turn). Off (benches, tests): every row steps.
        self._row_costs = RowTokenCosts()
        self.turns = True
        self._turns = 0
        self._passes = 0  # the loop's passes (take, then step) ...
        self._counted = -1  # ... and the last one that counted in _turns
        self._holding = False  # jobs wait in the inbox for their turn (_take)
        self.turn_steps = 0  # steps in which rows waited their turn (written by the loop)
        self._thread = threading.Thread(target=self._loop, name="tailwatch-batch", daemon=True)
        self._thread.start()

    # --- callers --------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue `job` to join the batch at the next step boundary; raise DoesNotFit."""
        room = self._owner.row_room(job.k)
        if job.max_new > room:
            raise DoesNotFit("max_new_tokens", f"{job.max_new} tokens do not fit a batch row "
                             f"({room} slots after the look-ahead)", value=job.max_new,
                             limit=room)
        job.t_submitted = self._clock()
        with self._cond:
            if self._closed:
                raise NotReady("engine is closed")
            self._inbox.append(job)
            self._cond.notify()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the loop thread between steps (the warm-up's compiled calls: the
        loop owns them); return its result or raise its error."""
        if threading.current_thread() is self._thread:
            return fn()
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise NotReady("engine is closed")
            self._tasks.append((fn, future))
            self._cond.notify()
        return future.result()

    @property
    def thread(self) -> threading.Thread:
        """Return the loop thread (it owns every compiled call)."""
        return self._thread

    def wait(self, job: Job) -> Decoded:
        """Block until the loop finished `job`; return its tokens or raise its error."""
        try:
            job.done.wait()
        finally:
            if not job.done.is_set():  # the caller was interrupted: free the row
                job.cancel()
                # Until the loop let it go at the next step boundary the row is still in
                # the batch: returning now would hand its admission slot to a new job
                # while it is, one row more than max_batch.
                job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.decoded is not None
        return job.decoded

    def snapshot(self) -> BatchSnapshot:
        """Return the batch now and the step seconds by phase since start."""
        steps, count, seconds, buckets = self.recorder.totals()
        with self._cond:
            return BatchSnapshot(
                max_batch=self.max_batch, batch_size=len(self._stepping()),
                rows_waiting=self._waiting() + len(self._inbox), window_s=self._window,
                window_max_s=self.window_max_s, steps=steps, turn_steps=self.turn_steps,
                step_count=count,
                step_seconds_sum=seconds, step_buckets=buckets)

    @property
    def paused(self) -> int:
        """Return the synthetic rows paused for real ones now."""
        with self._cond:
            return sum(1 for job, _state in self._active if job.paused_at is not None)

    def close(self) -> None:
        """Stop the loop; requests not finished get NotReady."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    # --- the loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (not self._inbox and not self._active and not self._tasks
                       and not self._closed):
                    self._cond.wait()
                if self._closed:
                    break
                tasks = list(self._tasks)
                self._tasks.clear()
            for fn, future in tasks:
                _run_task(fn, future)
            new: list[Job] = []
            self._passes += 1
            try:
                self._leave_cancelled()  # their rows are free before new ones join
                with self._cond:
                    self._adapt_window()
                    rows = len(self._active) + len(self._inbox)
                    if self._window > 0 and rows < self.max_batch and not self._solo():
                        # Wait for more arrivals before this step: a fuller step for
                        # everyone, at the price of this wait for the rows already here.
                        def arrived(n: int = rows) -> bool:
                            return len(self._inbox) + len(self._active) > n or self._closed

                        self._cond.wait_for(arrived, timeout=self._window)
                    new = self._take()
                for group in self._groups(new):
                    if len(group) == 1:
                        self._join(group[0])
                    else:
                        self._join_group(group)
                self._leave_cancelled()
                if self._active:
                    self._step()
                self._leave_finished()
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any one step
                # Not any one row's failure (those leave with their own error inside the
                # step): the rows of this step fail with it, and the loop goes on.
                log.exception("scheduler: a step failed outside any one request; its %d "
                              "rows fail with it", len(self._active))
                self._fail_rows(new, exc)
        self._fail_all(NotReady("engine is closed"))
        with self._cond:
            tasks = list(self._tasks)
            self._tasks.clear()
        for _fn, future in tasks:
            future.set_exception(NotReady("engine is closed"))

    def _solo(self) -> bool:
        """Return whether the next step is one job's that runs alone (no window to wait)."""
        if self._active:
            return any(job.alone for job, _state in self._stepping())
        queued = self._queued()
        return bool(queued) and queued[0].alone

    def _queued(self) -> list[Job]:
        """Return the waiting jobs in the order they join: real ones first, then synthetic
        ones, each in arrival order (a probe never makes a user's request wait for it)."""
        return sorted(self._inbox, key=lambda job: job.synthetic)  # stable

    def _take(self) -> list[Job]:
        """Return the waiting jobs that join now, in the order of _queued, up to the first
        that does not fit (_fits: the jobs after it wait for it). While rows take turns
        (_turns_now) a waiting job joins only when no row ahead of it runs (a real job: no
        real row; a synthetic one: no row), and alone: its encoder would delay the running
        row for nothing, as it waits its turn either way."""
        queued = self._queued()
        self._holding = False
        rows = len(self._active) + len(queued)
        # An arrival held for its turn had its choice when first held: the passes it waits
        # are not choices (one in EXPLORE_EVERY would take nearly every held arrival up).
        if queued and rows > 1 and self._turns_now(rows, count=not queued[0].turn_chosen):
            first = queued[0]
            ahead = [job for job, _state in self._active if first.synthetic or not job.synthetic]
            self._holding = bool(ahead) or len(queued) > 1
            first.turn_chosen = first.turn_chosen or bool(ahead)
            queued = [] if ahead else [first]
        taken: list[Job] = []
        for job in queued:
            if not self._fits(job, taken):
                break
            taken.append(job)
        for job in taken:
            self._inbox.remove(job)
        return taken

    def _fits(self, job: Job, taken: list[Job]) -> bool:
        """Return whether `job` joins now beside the batch's rows and those `taken` before
        it: none that runs alone among them, `job` itself running alone only where there
        are none, and room for it in the step. Where synthetic rows pause for real ones
        (extra_row), a real job counts the real rows only: the synthetic ones make way."""
        rows = [j for j, _state in self._active] + taken
        if self.extra_row is not None and not job.synthetic:
            rows = [j for j in rows if not j.synthetic]
        if any(j.alone for j in rows) or (job.alone and rows):
            return False
        return len(rows) < self.max_batch

    def _adapt_window(self) -> None:
        """Shorten the window while callers wait for rows, lengthen it while none do."""
        now = self._clock()
        alpha = 1.0 - math.exp(-max(now - self._busy_at, 0.0) / WINDOW_SMOOTHING_S)
        self._busy_at = now
        sample = 1.0 if self._waiting() > 0 or len(self._inbox) > 1 else 0.0
        self._busy += alpha * (sample - self._busy)
        self._window = self.window_max_s * (1.0 - self._busy)

    def _groups(self, jobs: list[Job]) -> list[list[Job]]:
        """Return `jobs` in groups whose inputs are encoded in one call (engine.group_encode:
        one target, bucket edge and set of functions; at most GROUP_MAX), in arrival order
        of each group's first job; a job that cannot be grouped is a group of its own."""
        groups: list[list[Job]] = []
        open_: dict[Hashable, list[Job]] = {}
        for job in jobs:
            key = self._owner.group_key(job)
            group = open_.get(key) if key is not None else None
            if group is None or len(group) >= GROUP_MAX:
                group = []
                groups.append(group)
                if key is not None:
                    open_[key] = group
            group.append(job)
        return groups

    def _join_group(self, jobs: list[Job]) -> None:
        """Encode the inputs of `jobs` in one call and join each; each alone if it fails."""
        started = self._clock()
        for job in jobs:
            job.t_picked = started
        live = [job for job in jobs if not self._gone(job)]  # the others are not encoded
        if len(live) < 2:
            for job in live:
                self._join(job)
            return
        try:
            encoded = self._owner.encode_rows(live)
        except Exception:  # noqa: BLE001 - each alone: only a failing request fails
            log.exception("scheduler: %d inputs encoded together failed; each is "
                          "encoded alone", len(live))
            for job in live:
                self._join(job)
            return
        # Each row is recorded as joining after an equal share of the one encoder call
        # (none of it is any one request's), plus its own row set-up.
        share = (self._clock() - started) / len(live)
        for job, tenc in zip(live, encoded, strict=True):
            self._join(job, tenc, share)

    def _join(self, job: Job, tenc: Encoded | None = None, encode_s: float = 0.0) -> None:
        """Start `job`'s row (encoding its input unless `tenc`) and add it to the batch."""
        if tenc is None:
            job.t_picked = self._clock()
            if self._gone(job):
                return
        started = self._clock()
        try:
            state = self._owner.start_row(job, tenc)
        except BaseException as exc:  # noqa: BLE001 - fails this request only
            self._finish(job, None, exc)
            return
        self.recorder.joined(job, encode_s + self._clock() - started)
        rows = self.max_batch + (self.extra_row is not None)
        with self._cond:
            # Admission grants at most max_batch rows (and the extra one): more would be a
            # bug, failing this request (its row's caches may be another's) and no other.
            full = len(self._active) >= rows
            if not full:
                self._active.append((job, state))
        if full:
            log.error("scheduler: a job joined a full batch (%d rows)", rows)
            self._finish(job, None, RuntimeError("scheduler: more rows than max_batch"))

    def _gone(self, job: Job) -> bool:
        """Finish `job` with an error when it was cancelled or is past its deadline."""
        error = self._stopped(job)
        if error is not None:
            self._finish(job, None, error)
        return error is not None

    def _stopped(self, job: Job) -> Exception | None:
        """Return what ends `job` early (cancelled, or past its deadline), else None."""
        if job.cancelled.is_set():
            return Cancelled("request cancelled")
        if job.deadline is not None and self._clock() > job.deadline:
            return RequestTimeout("timeout_s: generation did not finish before the deadline")
        return None

    def _leave_cancelled(self) -> None:
        """Drop the rows and the waiting jobs that were cancelled or are past their deadline
        (a waiting job's caller gets its slot back without waiting for a job running alone)."""
        with self._cond:
            waiting = [(job, error) for job in self._inbox
                       if (error := self._stopped(job)) is not None]
            for job, _error in waiting:
                self._inbox.remove(job)
        for job, error in waiting:
            self._finish(job, None, error)
        for job, state in list(self._active):
            if not state.done and self._gone(job):
                self._remove(job)

    def _leave_finished(self) -> None:
        for job, state in list(self._active):
            if state.done:
                self._remove(job)
                self._finish(job, state.decoded(), None)

    def _remove(self, job: Job) -> None:
        with self._cond:
            self._active = [(j, s) for j, s in self._active if j is not job]

    def _stepping(self) -> list[tuple[Job, RowState]]:
        """Return the rows the next step decodes, in the batch's order: every row, but
        where synthetic rows pause for real ones (extra_row) the real rows and the
        synthetic rows that fit beside them, oldest first (the module doc)."""
        active = self._active
        real = [job for job, _state in active if not job.synthetic]
        if self.extra_row is None or not real or len(real) == len(active):
            return list(active)
        keep = set(real)
        if not any(job.alone for job in real):
            room = self.max_batch - len(real)
            keep.update([job for job, _state in active
                         if job.synthetic and not job.alone][:max(room, 0)])
        return [(job, state) for job, state in active if job in keep]

    def _pause(self, stepping: list[tuple[Job, RowState]], now: float) -> None:
        """Pause the rows that do not step now and resume those that step again, recording
        each pause; count a pause no extra row was granted for in `preemptions`."""
        if len(stepping) == len(self._active) and not any(
                job.paused_at is not None for job, _state in self._active):
            return  # the common case: nothing paused, nothing to pause
        steps = {job for job, _state in stepping}
        paused = False
        for job, _state in self._active:
            if job in steps:
                if job.paused_at is not None:
                    job.pauses.append((now, now - job.paused_at))
                    job.paused_at = None
            elif job.paused_at is None:
                job.paused_at = now
                paused = True
        if paused and all(job.row != self.extra_row for job in steps):
            self.preemptions += 1

    def _speculate(self, active: list[tuple[Job, RowState]]) -> bool:
        """Return whether this step runs a speculative round per row instead of one
        batched direct step: a lone row with a draft always does (as unbatched); several
        do when every row has a draft and the rounds' measured tokens per second beat the
        batched step's at this batch size (both measured here, both exact)."""
        if not all(state.can_speculate for _job, state in active):
            return False
        b = len(active)
        if b == 1:
            return True
        step_s = self._step_s.get(b)
        return (self._round_tps is not None and step_s is not None
                and self._round_tps > b / step_s)

    def _step(self) -> None:
        active = self._stepping()
        b = len(active)
        started = self._clock()
        self._pause(active, started)
        groups: dict[tuple[int, int], list[tuple[Job, RowState]]] = {}
        for job, state in active:
            groups.setdefault((id(state.target), id(state.tfns)), []).append((job, state))
        speculated = direct_only = False
        stepped: list[tuple[Job, RowState]] = []
        emitted = 0
        for rows in groups.values():
            turn = self._turn(rows)
            if turn is not None:
                rows = [turn]  # the others wait their turn
            before = sum(len(state.tokens) for _job, state in rows)
            if _on_c(rows[0][1].target, rows[0][1].tfns):
                ks = self._draft_lengths(rows)
                self._verify(rows, ks)
                speculated = speculated or any(ks)
            elif self._speculate(rows):
                for job, state in rows:
                    self._round(job, state)
                speculated = True
            else:
                self._direct(rows)
                direct_only = True
            emitted += sum(len(state.tokens) for _job, state in rows) - before
            stepped += rows
        seconds = self._clock() - started
        n = len(stepped)
        if direct_only and not speculated and n > 1:
            self._step_s[n] = _smooth(self._step_s.get(n), seconds)
        if emitted and not any(state.done for _job, state in stepped):
            # A row's last step is cut at EOS or its limit: not a rate.
            self._row_costs.observe(n, seconds, emitted)
        if n < b or self._holding:
            self.turn_steps += 1
        if n < b:
            steps = {job for job, _state in stepped}
            for job, _state in active:
                if job not in steps:
                    job.turn_s += seconds
        jobs = [job for job, _state in stepped]
        for job in jobs:
            job.batch_max = max(job.batch_max, n)
        self.recorder.stepped(PHASE_VERIFY if speculated else PHASE_DECODE, seconds, jobs)

    def _turn(self, rows: list[tuple[Job, RowState]]) -> tuple[Job, RowState] | None:
        """Return the row that steps alone while the others wait their turn, or None (every
        row steps). The oldest real row takes its turn where the batch holds 2..TURN_ROWS
        rows, no caller waits for a row, and the measured steps say the rows finish sooner
        in sum one after another than together: B rows that each need N tokens finish
        together at N * t(B) each (t(B): a step of B rows' seconds until every row has one
        more token, RowTokenCosts), in turn at N * t(1), 2 N * t(1), ... B N * t(1), so
        turns pay while (B + 1) / 2 * t(1) < t(B). Every EXPLORE_EVERY-th such step is
        taken together, so that t(B) stays measured."""
        if len(rows) < 2 or not self._turns_now(len(rows)):
            return None
        return next((row for row in rows if not row[0].synthetic), rows[0])

    def _turns_now(self, rows: int, *, count: bool = True) -> bool:
        """Return whether `rows` rows (running and waiting to join) take turns in this
        pass's step (_turn); `count` False: no choice in the exploring count is made here
        (the rule alone, unless this pass already made one)."""
        if not self.turns or not 2 <= rows <= TURN_ROWS or self._waiting() > 0:
            return False  # throughput first: callers wait for a row
        alone, together = self._row_costs.row_token_s(1), self._row_costs.row_token_s(rows)
        if alone is None or together is None:
            return False  # this step measures what is not measured yet
        if count and self._counted != self._passes:
            # One choice a pass: _take and the step it feeds agree, so an arrival taken up
            # to explore (its encoder run) steps together, never waits its turn after all.
            self._counted = self._passes
            self._turns += 1
        exploring = self._counted == self._passes and self._turns % EXPLORE_EVERY == 0
        return not exploring and (rows + 1) / 2 * alone < together

    def _draft_lengths(self, rows: list[tuple[Job, RowState]]) -> list[int]:
        """Return the tokens each row's draft proposes this step (0: a direct step for it):
        every row with a draft at its own k (capped to what it still needs), or none,
        whichever the measured costs expect to emit more tokens per second."""
        ks = [min(s.k, s.max_new - len(s.tokens) - 1) if s.can_speculate else 0
              for _j, s in rows]
        if not any(ks) or len(rows) == 1:
            return ks  # a lone row speculates, as unbatched
        self._choices += 1
        costs = self._costs
        fit = costs.fit()
        draft_s = costs.draft_seconds(ks, self._drafts_together(rows, ks))
        if fit is None or draft_s is None:
            # Not measured yet: alternate, so that both kinds of call are measured.
            return ks if self._choices % 2 else [0] * len(ks)
        fixed, per_position = fit
        spec_tokens = sum(expected_tokens(costs.acceptance(s), k)
                          for (_j, s), k in zip(rows, ks, strict=True))
        # A row that never speculated runs its draft's encoder first: a cost of this step.
        unencoded = sum(1 for (_j, s), k in zip(rows, ks, strict=True)
                        if k and s.denc is None)
        spec_s = (fixed + per_position * (len(ks) + sum(ks)) + draft_s
                  + (costs.draft_encoder_s or 0.0) * unencoded)
        direct_s = fixed + per_position * len(ks)
        speculate = spec_tokens / spec_s >= len(ks) / direct_s
        if self._choices % EXPLORE_EVERY == 0:
            speculate = not speculate  # keep the other choice's costs measured
        return ks if speculate else [0] * len(ks)

    def _drafts_together(self, rows: list[tuple[Job, RowState]], ks: list[int]) -> bool:
        """Return whether the drafts of the rows that propose (ks) propose together: two
        or more, all on the C step (one row's chain is one C call for all its steps)."""
        proposing = [s for (_j, s), k in zip(rows, ks, strict=True) if k]
        return (self.batch_drafts and len(proposing) > 1
                and all(_on_c(s.draft, s.dfns) for s in proposing))

    def _verify(self, rows: list[tuple[Job, RowState]], ks: list[int]) -> None:
        """Decode the rows of one C-step model in one call: each row feeds its next token
        and, where ks says so, its draft's proposals after it (a verification), so each
        weight is read once for every position of every row."""
        blocks = self._proposals(rows, ks)
        if not blocks:
            return
        t1 = self._clock()
        try:
            with torch.no_grad():
                choices = _verified([(s, block) for _j, s, block in blocks])
        except Exception:  # noqa: BLE001 - find the row that failed: each alone
            choices = None
        now = self._clock()
        if choices is not None:
            positions = sum(len(block) for _j, _s, block in blocks)
            self._costs.observe(positions, now - t1)
            for (job, state, block), choice in zip(blocks, choices, strict=True):
                self._settle(job, state, block, choice, now, (now - t1) * len(block)
                             / positions)
            return
        self._each_alone(
            blocks, lambda b: _verified([(b[1], b[2])])[0],
            lambda b, choice: self._settle(b[0], b[1], b[2], choice, self._clock(), 0.0))

    def _proposals(self, rows: list[tuple[Job, RowState]], ks: list[int]
                   ) -> list[tuple[Job, RowState, list[int]]]:
        """Return each row's block to verify: seq[-1], then, where ks says so, its draft's
        proposals (made together where the drafts are on the C step: _drafted); a row
        whose draft fails leaves with its error."""
        blocks: list[tuple[Job, RowState, list[int]]] = []
        together: list[tuple[Job, RowState, int, list[int]]] = []
        batched = self._drafts_together(rows, ks)
        for (job, state), k in zip(rows, ks, strict=True):
            try:
                with torch.no_grad():
                    if not k:
                        blocks.append((job, state, [state.seq[-1]]))
                    elif batched:
                        together.append((job, state, k, state.draft_feed()))
                    else:
                        blocks.append((job, state, state.propose(k)))
            except BaseException as exc:  # noqa: BLE001 - fails this request only
                self._drop(job, exc)
        if together:
            blocks += self._drafted(together)
        drafted, chain_s = 0, 0.0
        for _job, state, block in blocks:
            if len(block) > 1:
                drafted += len(block) - 1
                chain_s += state.chain_s
                if state.encoded_s:
                    self._costs.observe_draft_encoder(state.encoded_s)
        if drafted:
            self._costs.observe_draft(drafted, chain_s)
        return blocks

    def _drafted(self, rows: list[tuple[Job, RowState, int, list[int]]]
                 ) -> list[tuple[Job, RowState, list[int]]]:
        """Return the blocks of rows (job, state, k, what state.draft_feed() returned)
        whose drafts propose together: one C call a draft step (_draft_rows). Where a call
        fails, each row proposes alone, so that only a row that fails alone fails."""
        try:
            with torch.no_grad():
                made = _draft_rows([(state, k, feed) for _j, state, k, feed in rows],
                                   self._clock, self._costs.observe_draft_call)
        except Exception:  # noqa: BLE001 - find the row that failed: each alone
            made = None
        if made is not None:
            return [(job, state, state.drafted(props, catch_up_s, chain_s))
                    for (job, state, _k, _feed), (props, catch_up_s, chain_s)
                    in zip(rows, made, strict=True)]
        blocks: list[tuple[Job, RowState, list[int]]] = []
        self._each_alone(rows, lambda r: r[1].propose(r[2]),
                         lambda r, block: blocks.append((r[0], r[1], block)))
        return blocks

    def _each_alone(self, items: list[Any], call: Callable[[Any], Any],
                    settle: Callable[[Any, Any], None]) -> None:
        """Run `call` for each item (a tuple whose first element is its Job) on its own,
        then `settle(item, result)`; a call that fails fails its own job only (where
        the rows' joint call failed: find the row that did)."""
        for item in items:
            try:
                with torch.no_grad():
                    result = call(item)
            except BaseException as exc:  # noqa: BLE001 - fails this request only
                self._drop(item[0], exc)
                continue
            settle(item, result)

    def _drop(self, job: Job, error: BaseException) -> None:
        """Take `job` out of the batch with `error` (it fails its own caller only)."""
        self._remove(job)
        self._finish(job, None, error)

    def _settle(self, job: Job, state: RowState, block: list[int], choice: list[int],
                now: float, verify_s: float) -> None:
        if len(block) == 1:
            state.accept(choice[0], now)
        else:
            before = state.accepted
            state.settle(block, choice, now, verify_s)
            self._costs.observe_acceptance(state.accepted - before, block, choice)
        job.first_token.set()

    def _round(self, job: Job, state: RowState) -> None:
        """Run one speculative round of one row; measure its tokens per second."""
        before, started = len(state.tokens), self._clock()
        try:
            with torch.no_grad():
                state.round()
        except BaseException as exc:  # noqa: BLE001 - fails this request only
            self._drop(job, exc)
            return
        job.first_token.set()
        seconds = self._clock() - started
        if seconds > 0 and not state.done:  # a last round is cut at EOS: not a rate
            self._round_tps = _smooth(self._round_tps, (len(state.tokens) - before) / seconds)

    def _direct(self, rows: list[tuple[Job, RowState]]) -> None:
        """Decode one token for each row of one model and one set of functions."""
        try:
            with torch.no_grad():
                tokens = _batched(rows)
        except Exception:  # noqa: BLE001 - find the row that failed: step each alone
            tokens = None
        if tokens is not None:
            now = self._clock()
            for (job, state), token in zip(rows, tokens, strict=True):
                state.accept(token, now)
                job.first_token.set()
            return

        def accept(row: tuple[Job, RowState], token: int) -> None:
            row[1].accept(token, self._clock())
            row[0].first_token.set()

        self._each_alone(rows, lambda row: _batched([row])[0], accept)

    def _finish(self, job: Job, decoded: Decoded | None, error: BaseException | None) -> None:
        if job.paused_at is not None:  # it leaves paused (cancelled, past its deadline)
            now = self._clock()
            job.pauses.append((now, now - job.paused_at))
            job.paused_at = None
        if job.held:
            self._owner.kv_release(job.held)
        job.decoded, job.error = decoded, error
        job.done.set()

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            jobs = [j for j, _s in self._active] + list(self._inbox)
            self._active, self._inbox = [], deque()
        for job in jobs:
            self._finish(job, None, error)

    def _fail_rows(self, jobs: list[Job], error: BaseException) -> None:
        """Fail the batch's rows and those of `jobs` (taken this turn) not finished yet with
        `error`; the queue stays."""
        with self._cond:
            active = [j for j, _s in self._active]
            self._active = []
        for job in active + [j for j in jobs if all(j is not a for a in active)]:
            if not job.done.is_set():
                self._finish(job, None, error)


def _run_task(fn: Callable[[], Any], future: Future) -> None:
    try:
        future.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - its caller gets it
        future.set_exception(exc)


def _smooth(old: float | None, new: float, weight: float = 0.2) -> float:
    """Return an exponential moving average of a measured cost (the first value as is)."""
    return new if old is None else old + weight * (new - old)


def _batched(rows: list[tuple[Job, RowState]]) -> list[int]:
    """Return the next token of each row (all on one model and one set of functions)."""
    states = [s for _j, s in rows]
    first = states[0]
    runner, fns, m = first.target, first.tfns, first.target.m
    native: Any = runner.native
    on_c = _on_c(runner, fns)
    if len(states) == 1 and not on_c:
        s = first  # one row on a compiled or eager step: the unbatched engine's own call
        p = s.position
        out = fns.step(m, s.last, runner.positions[p], s.tcache, s.tenc.cross,
                       s.tenc.mask_bias, runner.bias_for(p + 1), 1)
        return [int(out.view(-1)[0])]
    buffers = first.buffers
    if (not on_c and fns.rows is not None and buffers is not None
            and all(s.buffers is buffers for s in states)):
        # The fixed-row compiled step: the rows' own lanes of buffers allocated once, in
        # the smallest batch-size class (engine.row_buffers).
        return buffers.step(fns.rows, m, [job.row for job, _s in rows],
                            [s.seq[-1] for s in states], [s.position for s in states],
                            runner.dec_bias)
    tokens = torch.tensor([s.seq[-1] for s in states], dtype=torch.long, device=m.device_)
    positions = torch.tensor([s.position for s in states], dtype=torch.long,
                             device=m.device_)
    caches = [s.tcache for s in states]
    crosses = [s.tenc.cross for s in states]
    masks = [s.tenc.mask_bias for s in states]
    if on_c:
        out = native.rows(m, tokens, positions, caches, crosses, masks, runner.dec_bias)
    elif fns is runner.eager:
        out = t5.decode_rows(m, tokens, positions, caches, crosses, masks, runner.dec_bias)
    else:
        # A compiled step with no fixed-row step (the exact-shape path, or rows that joined
        # before its buffers were made): its graph is for one row, so each row calls it.
        # Each token is read before the next call: under CUDA graphs that call may reuse
        # the previous output's memory.
        return [int(fns.step(m, s.last, runner.positions[s.position], s.tcache, s.tenc.cross,
                             s.tenc.mask_bias, runner.bias_for(s.position + 1), 1).view(-1)[0])
                for s in states]
    return [int(t) for t in out.tolist()]


def _on_c(runner: ModelRunner | None, fns: Fns | None) -> bool:
    """Return whether `runner` steps with the C step (it decodes rows batched)."""
    native: Any = runner.native if runner is not None else None
    return native is not None and fns is not None and fns.step is native


def _rows_call(runner: ModelRunner, feeds: list[tuple[int, list[int], torch.Tensor, Encoded]]
               ) -> list[list[int]]:
    """Return, for each feed (first position, tokens, self-attention cache, encoder output),
    the greedy token after each of its tokens fed at its positions onward: every feed of
    one C-step model in one call."""
    tokens: list[int] = []
    positions: list[int] = []
    caches: list[torch.Tensor] = []
    crosses: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    for start, block, cache, enc in feeds:
        tokens += block
        positions += range(start, start + len(block))
        caches += [cache] * len(block)
        crosses += [enc.cross] * len(block)
        masks += [enc.mask_bias] * len(block)
    native: Any = runner.native
    out = native.rows(runner.m, torch.tensor(tokens, dtype=torch.long),
                      torch.tensor(positions, dtype=torch.long), caches, crosses, masks,
                      runner.dec_bias).tolist()
    choices, at = [], 0
    for _start, block, _cache, _enc in feeds:
        choices.append(out[at:at + len(block)])
        at += len(block)
    return choices


def _verified(blocks: list[tuple[RowState, list[int]]]) -> list[list[int]]:
    """Return, for each row, the target's greedy token after each of its block's tokens (fed
    at the row's positions onward), every row of one C-step model in one call."""
    if len(blocks) == 1:
        # A lone row: the unbatched engine's C entry for one request's positions (the same
        # arithmetic as native.rows on them), without the per-position lists rows take.
        state, block = blocks[0]
        runner, p = state.target, state.position
        native: Any = runner.native
        return [native.verify(runner.m, torch.tensor(block), torch.arange(p, p + len(block)),
                              state.tcache, state.tenc.cross, state.tenc.mask_bias,
                              runner.bias_for(p + len(block))).tolist()]
    return _rows_call(blocks[0][0].target, [(state.position, block, state.tcache, state.tenc)
                                            for state, block in blocks])


def _draft_rows(rows: list[tuple[RowState, int, list[int]]], clock: Clock,
                observe: Callable[[int, float], None]
                ) -> list[tuple[list[int], float, float]]:
    """Return each row's k proposals (rows: state, k, what state.draft_feed() returned) and
    its shares of the calls' seconds, catch-up and proposals: draft step j is one C call
    over the rows with k > j, each reading the draft's weights once for all of them (the
    first feeds each row's tokens from its d_pos onward, catching its draft up in the same
    call). Each row's arithmetic is its own chain's, so the proposals are bitwise what it
    proposes alone. `observe(positions, seconds)` gets each call."""
    draft = rows[0][0].draft
    assert draft is not None
    props: list[list[int]] = [[] for _ in rows]
    catch_up = [0.0] * len(rows)
    chain = [0.0] * len(rows)
    for j in range(max(k for _s, k, _f in rows)):
        live = [i for i, (_s, k, _f) in enumerate(rows) if k > j]
        feeds = []
        for i in live:
            state, _k, feed = rows[i]
            assert state.dcache is not None and state.denc is not None
            start, block = ((state.d_pos, feed) if j == 0
                            else (state.position + j, [props[i][-1]]))
            feeds.append((start, block, state.dcache, state.denc))
        t0 = clock()
        outs = _rows_call(draft, feeds)
        seconds = clock() - t0
        positions = sum(len(block) for _s, block, _c, _e in feeds)
        observe(positions, seconds)
        for i, (_start, block, _cache, _enc), out in zip(live, feeds, outs, strict=True):
            props[i].append(out[-1])
            share = seconds / positions
            chain[i] += share
            catch_up[i] += share * (len(block) - 1)
    return list(zip(props, catch_up, chain, strict=True))
