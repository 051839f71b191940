"""Users' own T5s: tiny random-weight models with real SentencePiece tokenizers.

Each model is built from a config in the test (no download), its tokenizer trained here
with `sentencepiece.SentencePieceTrainer` on a small generated text file, and saved the
way published checkpoints are: t5-small-shaped (v1.0: ReLU, tied, scaled output) with
only `spiece.model`, sharded; flan-t5-small-shaped (gated GELU, untied lm_head) with
`tokenizer.json`; mT5-shaped (gated GELU, untied, bfloat16 weights) with `spiece.model`.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

BUCKETS = (8, 16, 32)
MAX_INPUT = 48
SYLLABLES = ("ka", "lo", "mi", "ren", "ta", "su", "vo", "ne", "pi", "dar", "gel", "ox", "ul",
             "wi", "ze", "bra", "ith", "mon", "qu", "es")


def sample_lines(count: int, *, seed: int, words: tuple[int, int] = (3, 24)) -> list[str]:
    """Return `count` lines of pseudo-words (a language the tokenizer is trained on)."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
             for _ in range(400)]
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(*words)))
            for _ in range(count)]


def train_spiece(root: Path, *, seed: int, vocab_size: int = 200) -> Path:
    """Train a unigram SentencePiece model (T5's ids: pad 0, eos 1, unk 2) and return it."""
    import sentencepiece as spm

    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(sample_lines(600, seed=seed)) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(root / "sp"), vocab_size=vocab_size,
        model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        character_coverage=1.0, minloglevel=2, num_threads=1, hard_vocab_limit=False)
    return root / "sp.model"


def _randomize(model, *, seed: int, untied: bool) -> dict:
    """Widen a random init so greedy outputs vary; return the state dict to save."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                std = 1.0 if "shared" in name else 1.5 / param.shape[1] ** 0.5
                param.normal_(0.0, 4.0 if "relative" in name else std)
        # Pad never comes out; EOS now and then, so some outputs stop early.
        model.shared.weight[0].zero_()
        model.shared.weight[1].mul_(1.5)
    # Tied aliases (embed_tokens, a tied lm_head) are saved once, under shared.weight.
    state, seen = {}, set()
    for name in sorted(model.state_dict(), key=lambda k: k != "shared.weight"):
        tensor = model.state_dict()[name]
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            state[name] = tensor.contiguous()
    if untied:
        gen = torch.Generator().manual_seed(seed + 1)
        head = torch.randn(model.shared.weight.shape, generator=gen)
        head[0].zero_()
        state["lm_head.weight"] = head
    return state


def build_model(path: Path, kind: str, spiece: Path, *, seed: int, layout: str = "spiece",
                shards: int = 1, dtype: str = "float32") -> Path:
    """Save a tiny random `kind` ("t5", "flan", "mt5") model to `path` and return it."""
    import torch
    from safetensors.torch import save_file
    from transformers import (
        MT5Config,
        MT5ForConditionalGeneration,
        T5Config,
        T5ForConditionalGeneration,
        T5Tokenizer,
    )

    path.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f"{path.name}-tok"
    staging.mkdir(exist_ok=True)
    shutil.copy(spiece, staging / "spiece.model")
    (staging / "config.json").write_text(json.dumps({"model_type": "t5"}))
    tokenizer = T5Tokenizer.from_pretrained(staging)
    shape = dict(vocab_size=len(tokenizer), d_model=32, d_kv=16, d_ff=64, num_layers=2,
                 num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8,
                 relative_attention_max_distance=32, decoder_start_token_id=0, pad_token_id=0,
                 eos_token_id=1, dropout_rate=0.0)
    if kind == "t5":
        config, cls = T5Config(feed_forward_proj="relu", **shape), T5ForConditionalGeneration
    elif kind == "flan":
        config = T5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, **shape)
        cls = T5ForConditionalGeneration
    else:
        config = MT5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, **shape)
        cls = MT5ForConditionalGeneration
    model = cls(config).eval()
    state = _randomize(model, seed=seed, untied=kind != "t5")
    state = {k: v.to(getattr(torch, dtype)) for k, v in state.items()}
    model.save_pretrained(path)  # config.json and generation_config.json
    for old in path.glob("model*.safetensors*"):
        old.unlink()
    cfg = json.loads((path / "config.json").read_text())
    cfg["dtype"] = dtype
    if kind != "t5":
        # As published (flan-t5, mT5): untied, no scaling, a separate lm_head.weight.
        cfg["tie_word_embeddings"] = False
        cfg.pop("scale_decoder_outputs", None)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    names = sorted(state)
    if shards == 1:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(shards):
            part = names[i::shards]
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: state[k] for k in part}, str(path / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        total = sum(v.numel() * v.element_size() for v in state.values())
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if layout == "spiece":
        shutil.copy(spiece, path / "spiece.model")
    else:
        tokenizer.save_pretrained(path)  # tokenizer.json + tokenizer_config.json
    shutil.rmtree(staging)
    return path


@pytest.fixture(scope="session")
def own_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Return the three users' models and a draft with a different tokenizer."""
    root = tmp_path_factory.mktemp("own-t5")
    sp = train_spiece(root / "sp", seed=3)
    other_sp = train_spiece(root / "sp-other", seed=9, vocab_size=180)
    return {
        "t5": build_model(root / "t5-small-like", "t5", sp, seed=1, layout="spiece", shards=3),
        "flan": build_model(root / "flan-t5-like", "flan", sp, seed=2, layout="tokenizer_json"),
        "mt5": build_model(root / "mt5-like", "mt5", sp, seed=4, layout="spiece",
                           dtype="bfloat16"),
        "t5_draft": build_model(root / "t5-draft", "t5", sp, seed=5, layout="tokenizer_json"),
        "other_vocab": build_model(root / "other-vocab", "t5", other_sp, seed=6),
    }


def own_config(model_dir: Path, **changes: object):
    """Return an EngineConfig for a tiny own model (eager unless told otherwise)."""
    from engine.config import EngineConfig

    base: dict[str, object] = dict(model_dir=str(model_dir), buckets=BUCKETS,
                                   max_input_tokens=MAX_INPUT, max_new_tokens=12,
                                   max_new_tokens_cap=40, compile_mode="off", device="cpu",
                                   dtype="float32", speculative_k=3, kv_headroom=8)
    base.update(changes)
    return EngineConfig(**base)  # type: ignore[arg-type]


def texts_across_buckets(tokenizer, count: int, *, seed: int) -> list[str]:
    """Return `count` texts whose token counts cycle through every bucket and overflow."""
    ranges = [(2, BUCKETS[0]), (BUCKETS[0] + 1, BUCKETS[1]), (BUCKETS[1] + 1, BUCKETS[2]),
              (BUCKETS[2] + 1, MAX_INPUT)]
    pool = sample_lines(400, seed=seed, words=(1, 40))
    out: list[str] = []
    used: set[str] = set()
    for i in range(count * 20):
        lo, hi = ranges[len(out) % len(ranges)]
        text = pool[i % len(pool)]
        n = len(tokenizer(text).input_ids)
        if lo <= n <= hi and text not in used:
            used.add(text)
            out.append(text)
            if len(out) == count:
                return out
    raise AssertionError(f"only {len(out)} texts fit the buckets")
