"""The shipped built-in checkpoints and their task, checked with plain transformers."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from engine.builtin import task

BUILTIN = Path(__file__).resolve().parents[2] / "engine" / "builtin"
NEW_TOKENS = 32
PER_BUCKET = 2  # per domain: 2 x 5 buckets x 2 domains = 20 examples


def _bucket(text: str) -> int:
    n = len(text.encode())
    return next(i for i, (lo, hi) in enumerate(task.BYTE_BUCKETS) if lo <= n <= hi)


@pytest.fixture(scope="module")
def heldout_sample() -> list[dict[str, str]]:
    rows = task.read_heldout()
    sample = []
    for domain in task.DOMAINS:
        for b in range(len(task.BYTE_BUCKETS)):
            picks = [r for r in rows if r["domain"] == domain and _bucket(r["input"]) == b]
            sample.extend(picks[:PER_BUCKET])
    return sample


@pytest.fixture(scope="module")
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _load(name: str):
    import torch
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_pretrained(BUILTIN / name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(BUILTIN / name)


def _greedy(name: str, texts: list[str]) -> list[str]:
    import torch

    model, tok = _load(name)
    enc = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1)
    return tok.batch_decode(out, skip_special_tokens=True)


# ---------------------------------------------------------------- the task


def test_task_inputs_have_the_requested_length_and_a_defined_output():
    rng = random.Random(7)
    for domain in task.DOMAINS:
        for n in (8, 9, 15, 16, 63, 128, 255, 1000):
            text, out = task.make_example(domain, rng, n)
            assert len(text) == n and text.isascii()
            assert task.domain_of(text) == domain
            assert task.MIN_OUTPUT_BYTES <= len(out) <= task.MAX_OUTPUT_BYTES
            assert out == task.expected_output(text)


def test_task_is_deterministic_for_a_seed():
    a = [task.make_example("shifted", random.Random(3), 40) for _ in range(3)]
    b = [task.make_example("shifted", random.Random(3), 40) for _ in range(3)]
    assert a == b


def test_task_continues_the_chain_to_the_terminator():
    chain = task.CHAINS["in_domain"]
    end = task.valid_end_indices("in_domain")[0]
    out = task.expected_output(task.input_for("in_domain", end, 30)).split(" ")
    assert out[0] == chain[(end + 1) % len(chain)]
    assert out[-1].endswith(".") and not any(w.endswith(".") for w in out[:-1])


def test_task_domains_do_not_share_words():
    assert not set(task.CHAINS["in_domain"]) & set(task.CHAINS["shifted"])


@pytest.mark.parametrize(("domain", "n"), [("sql", 20), ("in_domain", 7)])
def test_task_rejects_bad_arguments(domain, n):
    with pytest.raises(task.TaskError):
        task.make_input(domain, random.Random(0), n)


def test_task_rejects_text_off_the_chain():
    with pytest.raises(task.TaskError, match="input_text"):
        task.expected_output("hello world")


# ---------------------------------------------------------------- the shipped files


def test_canaries_cover_every_bucket_and_are_held_out():
    heldout = {row["input"] for row in task.read_heldout()}
    for domain in task.DOMAINS:
        lines = task.read_canaries(domain)
        counts = [0] * len(task.BYTE_BUCKETS)
        for line in lines:
            assert task.domain_of(line) == domain
            counts[_bucket(line)] += 1
        assert min(counts) >= 8
        assert not heldout & set(lines)


def test_checkpoints_fit_in_20_mb():
    files = [p for d in ("target", "draft") for p in (BUILTIN / d).iterdir()]
    names = {p.name for p in files}
    assert {"config.json", "model.safetensors", "generation_config.json",
            "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in files) <= 20_000_000


@pytest.mark.slow
def test_tokenizer_and_model_load_offline():
    code = (
        "from transformers import AutoTokenizer, AutoConfig\n"
        f"tok = AutoTokenizer.from_pretrained({str(BUILTIN / 'draft')!r})\n"
        f"cfg = AutoConfig.from_pretrained({str(BUILTIN / 'target')!r})\n"
        "print(tok('ab').input_ids, cfg.model_type)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[100, 101, 1] t5"


# ---------------------------------------------------------------- the models


@pytest.mark.slow
def test_target_greedy_output_is_correct_on_both_domains(heldout_sample, one_thread):
    got = _greedy("target", [r["input"] for r in heldout_sample])
    wrong = [(r["input"], g) for r, g in zip(heldout_sample, got, strict=True)
             if g[:NEW_TOKENS] != r["expected"][:NEW_TOKENS]]
    assert not wrong


def test_draft_is_correct_in_domain_only(heldout_sample, one_thread):
    rows = [r for r in heldout_sample if r["domain"] == "in_domain"]
    shifted = [r for r in heldout_sample if r["domain"] == "shifted"]
    got = _greedy("draft", [r["input"] for r in rows + shifted])
    right = [g[:NEW_TOKENS] == r["expected"][:NEW_TOKENS]
             for r, g in zip(rows + shifted, got, strict=True)]
    assert all(right[: len(rows)])
    # Never trained on shifted text: the draft must not know it (that is the drift signal).
    assert not any(right[len(rows):])


def test_draft_is_at_least_four_times_smaller_per_decoder_step():
    target, _ = _load("target")
    draft, _ = _load("draft")

    def decoder_params(m) -> int:
        return sum(p.numel() for p in m.decoder.parameters()) - m.shared.weight.numel()

    assert decoder_params(target) >= 4 * decoder_params(draft)
    assert target.config.num_layers == target.config.num_decoder_layers
