"""Canary suites: YAML loading, validation messages, bucket grouping."""

from __future__ import annotations

from pathlib import Path

import pytest

from probes.canaries import (
    DEFAULT_SUITES_FILE,
    by_bucket,
    load_suites,
    load_suites_file,
    missing_buckets,
)
from probes.errors import SuiteError
from tests.probes.fakes import FakeEngine, prompt_of


def test_inline_and_file_prompts(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text(" starts with a space\n\n#def is a prompt too\n")
    f = tmp_path / "suites.yaml"
    f.write_text("suites:\n"
                 "  - name: mine\n    domain: logs\n    max_new_tokens: 8\n"
                 "    prompts: [hello world, {file: p.txt}]\n")
    suite = load_suites_file(f)["mine"]
    assert suite.prompts == ("hello world", " starts with a space", "#def is a prompt too")
    assert suite.max_new_tokens == 8
    assert suite.domain == "logs"


@pytest.mark.parametrize(("body", "field"), [
    ("suites: 3\n", "suites"),
    ("suites:\n  - name: a\n    prompts: [x]\n", "suites[0].domain"),
    ("suites:\n  - name: a\n    domain: d\n    prompts: []\n", "suites[0].prompts"),
    ("suites:\n  - name: a\n    domain: d\n    prompts: [x]\n    max_new_tokens: 0\n",
     "suites[0].max_new_tokens"),
    ("suites:\n  - name: a\n    domain: d\n    prompts: [x]\n    colour: red\n",
     "suites[0].colour"),
    ("suites:\n  - name: a\n    domain: d\n    prompts: {file: nope.txt}\n",
     "suites[0].prompts.file"),
    ("suites:\n  - {name: a, domain: d, prompts: [x]}\n  - {name: a, domain: d, prompts: [y]}\n",
     "suites[1].name"),
    ("suites: [unclosed\n", "file"),
])
def test_validation_names_field_and_file(tmp_path: Path, body: str, field: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(body)
    with pytest.raises(SuiteError) as info:
        load_suites_file(f)
    assert info.value.field == field
    assert str(f) in str(info.value) and field in str(info.value)
    assert isinstance(info.value, ValueError)


def test_user_file_adds_and_replaces(tmp_path: Path) -> None:
    f = tmp_path / "user.yaml"
    f.write_text("suites:\n  - {name: in_domain, domain: in_domain, prompts: [only one]}\n"
                 "  - {name: extra, domain: x, prompts: [a]}\n")
    suites = load_suites(f)
    assert suites["in_domain"].prompts == ("only one",)
    assert {"shifted", "extra"} <= set(suites)


def test_by_bucket_takes_first_n_per_bucket_in_order() -> None:
    engine = FakeEngine(buckets=(16, 32, 64), max_input_tokens=256)
    from probes.canaries import CanarySuite

    prompts = (prompt_of(40), prompt_of(10), prompt_of(11), prompt_of(12), prompt_of(100))
    plan = by_bucket(CanarySuite("s", "d", prompts), engine, per_bucket=2)
    assert list(plan) == ["16", "64", "overflow"]
    assert plan["16"] == (prompt_of(10), prompt_of(11))
    assert missing_buckets(plan, engine) == ("32",)


def test_shipped_suites_cover_every_bucket() -> None:
    suites = load_suites_file(DEFAULT_SUITES_FILE)
    assert set(suites) == {"in_domain", "shifted"}
    engine = FakeEngine()  # byte-level token counts like the built-in models
    for suite in suites.values():
        plan = by_bucket(suite, engine, per_bucket=4)
        assert missing_buckets(plan, engine) == (), suite.name
        assert all(len(p) == 4 for b, p in plan.items() if b != "overflow"), suite.name


def test_golden_answers_load_with_their_canaries(tmp_path: Path) -> None:
    f = tmp_path / "golden.yaml"
    f.write_text("suites:\n  - name: g\n    domain: d\n    prompts:\n"
                 "      - {text: 'guten morgen', expected: good morning}\n"
                 "      - plain prompt\n")
    suite = load_suites_file(f)["g"]
    assert suite.prompts == ("guten morgen", "plain prompt")
    assert suite.expected == {"guten morgen": "good morning"}
    assert load_suites_file(DEFAULT_SUITES_FILE)["in_domain"].expected == {}


@pytest.mark.parametrize(("prompts", "field", "message"), [
    ("[{text: guten morgen, expected: 3}]", "suites[0].prompts[0].expected",
     "canary 'guten morgen': must be a non-empty string, got 3"),
    ("[{text: guten morgen, expected: ''}]", "suites[0].prompts[0].expected",
     "canary 'guten morgen': must be a non-empty string"),
    ("[x, {text: guten morgen, expectd: hi}]", "suites[0].prompts[1].expectd",
     "canary 'guten morgen': unknown field"),
    ("[{text: guten morgen, expected: a}, {text: guten morgen, expected: b}]",
     "suites[0].prompts", "canary 'guten morgen': two different expected answers"),
])
def test_golden_answer_errors_name_the_canary(tmp_path: Path, prompts: str, field: str,
                                              message: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(f"suites:\n  - name: a\n    domain: d\n    prompts: {prompts}\n")
    with pytest.raises(SuiteError) as info:
        load_suites_file(f)
    assert info.value.field == field
    assert str(info.value).startswith(f"{f}: {field}: {message}")
    assert "\n" not in str(info.value)


def test_written_suites_keep_their_golden_answers(tmp_path: Path) -> None:
    from probes.canaries import Canary, CanarySuite
    from probes.canary_builder import suites_yaml

    canaries = (Canary("guten morgen", 3, "16", (1, 2), "gm", "good morning"),
                Canary("hallo", 2, "16", (4,), "hi"))
    suite = CanarySuite("own", "own", tuple(c.text for c in canaries), 8, "", canaries,
                        {"model_version": "m"})
    f = tmp_path / "built.yaml"
    f.write_text(suites_yaml([suite]))
    again = load_suites_file(f)["own"]
    assert again.expected == {"guten morgen": "good morning"}
    assert again.canaries[1].expected is None
