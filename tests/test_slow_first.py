"""The slow-first order of tests/conftest.py: on real collected items, and under xdist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import conftest

# Collection order q0 s0 q1 q2 s1 q3 s2 q4 q5 s3 q6: slow tests scattered, one at the end.
ORDER = ["q0", "s0", "q1", "q2", "s1", "q3", "s2", "q4", "q5", "s3", "q6"]

INI = """
[pytest]
markers =
    slow: takes long
"""


def _source(names: list[str]) -> str:
    return "import pytest\n" + "".join(
        ("@pytest.mark.slow\n" if name.startswith("s") else "") + f"def test_{name}():\n    pass\n"
        for name in names
    )


def _ordered(pytester: pytest.Pytester, workerinput: dict | None,
             names: list[str] = ORDER) -> list[str]:
    pytester.makeini(INI)
    items = pytester.getitems(_source(names))
    config = items[0].config
    if workerinput is not None:
        config.workerinput = workerinput  # type: ignore[attr-defined]
    conftest.pytest_collection_modifyitems(config=config, items=items)
    return [item.name.removeprefix("test_") for item in items]


def test_without_xdist_the_slow_tests_run_first_in_collection_order(pytester):
    assert _ordered(pytester, None) == [
        "s0", "s1", "s2", "s3", "q0", "q1", "q2", "q3", "q4", "q5", "q6"]


def test_under_worksteal_each_first_run_starts_with_its_share_of_slow_tests(pytester):
    # 11 items on 2 workers: worksteal hands out runs of 5 and 6.
    got = _ordered(pytester, {"workercount": 2, "dist": "worksteal"})
    assert got[:5] == ["s0", "s2", "q0", "q1", "q2"]
    assert got[5:] == ["s1", "s3", "q3", "q4", "q5", "q6"]


def test_under_load_the_slow_tests_run_first_overall(pytester):
    got = _ordered(pytester, {"workercount": 2, "dist": "load"})
    assert got == ["s0", "s1", "s2", "s3", "q0", "q1", "q2", "q3", "q4", "q5", "q6"]


def test_more_slow_tests_than_a_run_holds_keeps_every_item_once(pytester):
    # Runs of 1, 1, 2, 2 on 4 workers: the first is dealt two slow tests, s0 and s4.
    names = ["s0", "s1", "s2", "s3", "s4", "q0"]
    got = _ordered(pytester, {"workercount": 4, "dist": "worksteal"}, names)
    assert got == ["s0", "s4", "s1", "s2", "q0", "s3"]


def test_first_runs_split_like_the_worksteal_scheduler():
    assert conftest.first_runs(11, 2) == [5, 6]
    assert conftest.first_runs(12, 4) == [3, 3, 3, 3]
    assert conftest.first_runs(6, 4) == [1, 1, 2, 2]
    assert conftest.first_runs(1, 2) == [0, 1]


@pytest.mark.slow
def test_under_xdist_worksteal_every_worker_starts_on_a_slow_test(pytester, monkeypatch):
    # All slow tests last in collection order: without the hook both workers start quick.
    names = [f"q{i}" for i in range(10)] + ["s0", "s1"]
    pytester.makeini(INI)
    pytester.makepyfile(test_order=_source(names))
    pytester.makeconftest(
        "from tests.conftest import pytest_collection_modifyitems, pytest_configure_node\n")
    monkeypatch.setenv("PYTHONPATH", str(Path(conftest.__file__).parents[1]))
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = pytester.runpytest_subprocess(
        "-p", "xdist.plugin", "-n", "2", "--dist", "worksteal", "-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=12)
    first: dict[str, str] = {}
    for line in result.outlines:
        match = re.match(r"\[(gw\d+)\].* PASSED test_order\.py::test_(\w+)", line)
        if match:
            first.setdefault(match[1], match[2])
    assert sorted(first) == ["gw0", "gw1"]
    assert sorted(first.values()) == ["s0", "s1"]  # one slow test opens each worker's run
