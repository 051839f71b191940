"""No implicit draft: a user model speculates only with an explicit, matching draft_dir."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from engine.errors import ModelLoadError
from engine.protocol import FlagOverride
from tests.engine.own.conftest import own_config, texts_across_buckets


def test_user_model_without_draft_dir_runs_direct_and_says_why(own_models, caplog):
    from engine import load_engine

    with caplog.at_level("WARNING", logger="engine.runtime"):
        engine = load_engine(own_config(own_models["t5"]))
    try:
        info = engine.info
        assert not info.speculative_available
        assert "draft_dir" in info.speculative_reason and info.speculative_reason.startswith("off")
        said = [r for r in caplog.records if "speculative decoding" in r.getMessage()]
        assert len(said) == 1 and "draft_dir" in said[0].getMessage()
        result = engine.generate("kalo mi ren", override=FlagOverride(speculative=True))
        assert result.decoding == "direct" and result.spec.drafts == 0
    finally:
        engine.close()


def test_matching_draft_speculates_exactly(own_models):
    """Same SentencePiece vocabulary (spiece.model vs tokenizer.json layouts): it pairs."""
    from transformers import AutoTokenizer

    from engine import load_engine

    engine = load_engine(own_config(own_models["t5"], draft_dir=str(own_models["t5_draft"])))
    try:
        assert engine.info.speculative_available
        assert engine.info.speculative_reason.startswith("on")
        tok = AutoTokenizer.from_pretrained(own_models["t5"])
        drafts = 0
        for text in texts_across_buckets(tok, 8, seed=5):
            direct = engine.generate(text, override=FlagOverride(speculative=False))
            spec = engine.generate(text, override=FlagOverride(speculative=True))
            assert spec.output_ids == direct.output_ids and spec.decoding == "speculative"
            drafts += spec.spec.drafts
        assert drafts > 0
    finally:
        engine.close()


def test_mismatched_draft_is_one_line_naming_both_vocabularies(own_models):
    from engine import load_engine

    with pytest.raises(ModelLoadError) as err:
        load_engine(own_config(own_models["t5"], draft_dir=str(own_models["other_vocab"])))
    message = str(err.value)
    assert len(message.splitlines()) == 1 and message.startswith("draft_dir:")
    assert str(own_models["t5"]) in message and str(own_models["other_vocab"]) in message
    assert message.count("T5Tokenizer") == 2 and "tokens" in message


def test_builtin_target_keeps_the_builtin_draft():
    from engine.config import BUILTIN_DIR, EngineConfig
    from engine.loader import load_model, pair_draft

    target = load_model(BUILTIN_DIR / "target")
    draft, reason = pair_draft(EngineConfig(), target)
    assert draft is not None and draft.path == BUILTIN_DIR / "draft" and reason.startswith("on")
    none, why = pair_draft(EngineConfig(use_draft=False), target)
    assert none is None and "use_draft" in why


def test_generate_cli_follows_the_same_rules(own_models):
    from monitor.cli.generate import generate

    runner = CliRunner()
    out = runner.invoke(generate, ["kalo mi ren", "--model-dir", str(own_models["t5"]),
                                   "--max-new-tokens", "4", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["decoding"] == "direct"
    bad = runner.invoke(generate, ["kalo mi ren", "--model-dir", str(own_models["t5"]),
                                   "--draft-dir", str(own_models["other_vocab"])])
    assert bad.exit_code == 1
    lines = bad.output.strip().splitlines()
    assert len(lines) == 1 and "draft_dir" in lines[0] and "Traceback" not in bad.output
