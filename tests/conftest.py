"""Shared fixtures (database fixtures live in tests/utils/db.py) and the slow-first test order.

`make test` runs pytest-xdist with `--dist worksteal`: the scheduler first hands each worker
one contiguous run of the collection (the first len/n items to one worker, and so on) and
later idle workers steal from the *end* of a busy worker's run. A slow test left near the end
of a run starts last and becomes the tail of the whole suite, while stealing balances the
quick tests well on its own. So each worker's run is laid out to start with its share of the
`slow` tests, dealt round-robin so that no one run holds them all. Under the other xdist modes
(load, loadscope, loadfile) and without xdist, the slow tests go first overall: those
schedulers hand work out from the front of the collection as workers free up.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypeVar

import pytest

from monitor.logs import QUIET, StderrHandler

if TYPE_CHECKING:
    from xdist.workermanage import WorkerController

pytest_plugins = ["tests.utils.db", "tests.utils.cc_cache", "pytester"]

Item = TypeVar("Item", bound=pytest.Item)


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Undo configure_logging after each test (in-process `serve` calls install it).

    The CLI installs its root handler once per process; a test that runs `serve` in-process
    would otherwise leave INFO records going to whatever sys.stderr a later test captures.
    """
    root = logging.getLogger()
    levels = {name: logging.getLogger(name).level for name in QUIET}
    root_level = root.level
    yield
    for handler in [h for h in root.handlers if isinstance(h, StderrHandler)]:
        root.removeHandler(handler)
    root.setLevel(root_level)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def first_runs(total: int, workers: int) -> list[int]:
    """Return the sizes of the runs xdist's worksteal scheduler first hands each worker."""
    sizes = []
    left = total
    for i in range(workers):
        size = left // (workers - i)  # the scheduler's own split (WorkStealingScheduling)
        sizes.append(size)
        left -= size
    return sizes


def slow_first(items: list[Item], runs: int) -> list[Item]:
    """Return `items` laid out as `runs` runs, each starting with its share of slow tests.

    Collection order is kept among the slow tests and among the others.
    """
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    quick = [item for item in items if item.get_closest_marker("slow") is None]
    ordered: list[Item] = []
    for run, size in enumerate(first_runs(len(items), runs)):
        dealt = slow[run::runs]
        take = len(quick) if run == runs - 1 else max(0, size - len(dealt))
        ordered += dealt + quick[:take]
        del quick[:take]
    return ordered


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: WorkerController) -> None:
    """Tell each xdist worker the distribution mode (workers otherwise see only "no")."""
    node.workerinput["dist"] = node.config.getoption("dist")


# Last, so that deselection (-k, -m) and pytest's own fixture-scope grouping have run and the
# run sizes match the list the scheduler will split.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run slow tests first: at the start of each worker's first run under worksteal."""
    workerinput = getattr(config, "workerinput", None)
    worksteal = workerinput is not None and workerinput.get("dist") == "worksteal"
    items[:] = slow_first(items, workerinput["workercount"] if worksteal else 1)
