"""Evaluation benchmark: every shipped rule over 7 days of history from 4 replicas.

Writes `--days` of synthetic history per replica (storage.synthetic: a canary cycle per
bucket every minute, traffic rollups per minute, memory samples, compile events) into
SQLite and PostgreSQL, then times `alerts.evaluator.evaluate` with every shipped rule
and the shipped policy, as the scheduler calls it each minute:

    backfill      the first evaluations, a minute apart: each stores the hour chunks of
                  up to 6 more hours per rule (once per database, like a migration)
    steady        evaluations a minute apart within one hour (median): fresh baselines
    hour          the first evaluation of a new hour: one new chunk per rule, the
                  jittered baseline refreshes that fall due
    refresh-all   every baseline refreshed (refresh_s=0): chunks plus the current hour

Each evaluation runs as the job runs it (`alerts.evaluator.evaluate_split`: scored in a
read-only transaction, then recorded in a write transaction). Each line shows wall
seconds, this process's CPU seconds (the database server's time is in the wall figure
only), the write transaction's wall seconds (on SQLite, how long other writers wait) and
the measurement rows read (EvaluationReport.rows_read);
the steady line also the SELECT statements of its last evaluation (one per row kind and
per shared read, not per rule or scope: tests/alerts/test_evaluator_cost.py).

    taskset -c 1 python -m bench.evaluation [--days 7] [--replicas 4]
        [--databases sqlite,postgres] [--no-postgres]

The last line reads `seconds per full evaluation: 0.123` (steady, the slower database;
target < 0.5 s).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, event

from alerts.baselines import BaselineConfig
from alerts.evaluator import EvaluationOptions, EvaluationReport, evaluate_split
from alerts.policy import load_policy
from alerts.rule_file import load_rules
from bench.storage import _postgres, _sqlite
from storage.db import make_sessionmaker
from storage.synthetic import simulate

END = datetime(2026, 1, 12, 10, 0, tzinfo=UTC)  # a Monday, on the hour


def _fill(engine: Engine, days: float, replicas: int) -> int:
    rows = 0
    for i in range(replicas):
        c = simulate(engine, END - timedelta(days=days), days, instance_id=f"sim-{i + 1}",
                     seed=i)
        rows += c.probe_results + c.traffic_rollups + c.memory_samples + c.compile_events
    return rows


class _Statements:
    """Count the SELECT statements an engine runs (the evaluation's reads)."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.selects = engine, 0

    def __call__(self, conn: object, cursor: object, statement: str, *args: object) -> None:
        self.selects += statement.lstrip().upper().startswith("SELECT")

    def __enter__(self) -> _Statements:
        event.listen(self.engine, "before_cursor_execute", self)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self)


_LAST_SELECTS = [0]  # SELECTs of the latest _timed evaluation


_LAST_WRITE = [0.0]  # wall seconds of the latest _timed evaluation's write transaction


def _timed(engine: Engine, now: datetime,
           config: BaselineConfig | None = None) -> tuple[float, float, EvaluationReport]:
    """Return (wall s, CPU s of this process, report) of one evaluation at `now`, as the
    job runs it (scored in a read transaction, then recorded in a write transaction)."""
    rules, policy = load_rules(), load_policy()  # loaded once by the service, not timed
    maker = make_sessionmaker(engine)
    scored: list[float] = []
    with _Statements(engine) as count:
        t0, c0 = time.perf_counter(), time.process_time()
        report = evaluate_split(
            maker,
            EvaluationOptions(rules, policy=policy, baseline_config=config or BaselineConfig()),
            now, scored=lambda _: scored.append(time.perf_counter()),
        )
        end = time.perf_counter()
        took, cpu = end - t0, time.process_time() - c0
    _LAST_SELECTS[0] = count.selects
    _LAST_WRITE[0] = end - scored[0]  # from the read's end: the write transaction's span
    return took, cpu, report


def run(name: str, db: Callable[[], AbstractContextManager[Engine]], days: float,
        replicas: int) -> float:
    """Print one database's timings; return the steady seconds per evaluation."""
    with db() as engine:
        t0 = time.perf_counter()
        rows = _fill(engine, days, replicas)
        print(f"{name}: {rows} rows ({days:g} days x {replicas} replicas) written in "
              f"{time.perf_counter() - t0:.0f} s")
        # Replayed as of a time inside the data (rows after `now` are never read). The
        # service backfills the chunks over its first evaluations (6 hours per rule each).
        base = END - timedelta(hours=2) + timedelta(minutes=5, seconds=30)
        steps = math.ceil(days * 24 / BaselineConfig().backfill_hours) + 1
        walls, cpus, writes = [], [], []
        for i in range(steps):
            took, cpu, rep = _timed(engine, base - timedelta(minutes=steps - i))
            assert not rep.errors, rep.errors
            walls.append(took)
            cpus.append(cpu)
            writes.append(_LAST_WRITE[0])
        print(f"{name}: backfill     {sum(walls):7.3f} s  cpu {sum(cpus):7.3f} s  over {steps} "
              f"evaluations (max {max(walls):.3f} s each, write {max(writes):.3f} s; one-time)")
        steady: list[float] = []
        cpus, writes = [], []
        for i in range(1, 6):
            took, cpu, rep = _timed(engine, base + timedelta(minutes=i))
            steady.append(took)
            cpus.append(cpu)
            writes.append(_LAST_WRITE[0])
        print(f"{name}: steady       {statistics.median(steady):7.3f} s  cpu "
              f"{statistics.median(cpus):7.3f} s  write {statistics.median(writes):.3f} s  "
              f"rows read {rep.rows_read}  SELECTs {_LAST_SELECTS[0]}  (median of 5)")
        took, cpu, rep = _timed(engine, END - timedelta(hours=1) + timedelta(seconds=30))
        print(f"{name}: hour         {took:7.3f} s  cpu {cpu:7.3f} s  write {_LAST_WRITE[0]:.3f} s  "
              f"rows read {rep.rows_read}")
        took, cpu, rep = _timed(engine, END - timedelta(hours=1) + timedelta(minutes=1, seconds=30),
                                BaselineConfig(refresh_s=0))
        print(f"{name}: refresh-all  {took:7.3f} s  cpu {cpu:7.3f} s  write {_LAST_WRITE[0]:.3f} s  "
              f"rows read {rep.rows_read}")
        return statistics.median(steady)


_DBS: dict[str, Callable[[], AbstractContextManager[Engine]]] = {
    "sqlite": _sqlite, "postgres": _postgres}


def _dbs(names: str, postgres: bool) -> Iterator[
        tuple[str, Callable[[], AbstractContextManager[Engine]]]]:
    for name in names.split(","):
        if name not in _DBS:
            raise SystemExit(f"--databases: unknown database {name!r} (sqlite, postgres)")
        if postgres or name != "postgres":
            yield name, _DBS[name]


def main() -> None:
    """Run the benchmark and print one line per measurement."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--databases", default="sqlite,postgres")
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()
    worst = max(run(name, db, args.days, args.replicas)
                for name, db in _dbs(args.databases, not args.no_postgres))
    print(f"seconds per full evaluation: {worst:.3f}")


if __name__ == "__main__":
    main()
