"""Tiny random-weight T5s saved like real model directories."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.protocol import FlagOverride, InMemoryFlagProvider, RuntimeFlags


def build_tiny_t5(path: Path, *, seed: int, d_model: int = 32, layers: int = 2,
                  heads: int = 2, eos_scale: float = 2.0, noise: float = 0.0) -> Path:
    """Save a random T5 with a ByT5 tokenizer to `path` and return it."""
    import torch
    from transformers import ByT5Tokenizer, T5Config, T5ForConditionalGeneration

    tok = ByT5Tokenizer()
    cfg = T5Config(vocab_size=len(tok), d_model=d_model, d_kv=d_model // heads,
                   d_ff=2 * d_model, num_layers=layers, num_decoder_layers=layers,
                   num_heads=heads, relative_attention_num_buckets=8,
                   relative_attention_max_distance=32, decoder_start_token_id=0,
                   pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        # HF's init makes a random T5 repeat one token; wider weights give varied outputs.
        for name, param in model.named_parameters():
            if param.dim() == 2:
                std = 1.0 if "embed" in name or "shared" in name else 1.5
                std = 4.0 if "relative" in name else std
                param.normal_(0.0, std if std != 1.5 else std / param.shape[1] ** 0.5)
        # Pad never comes out; a larger EOS row makes some outputs stop early, most run long.
        model.lm_head.weight[0].zero_()
        model.lm_head.weight[1].mul_(eos_scale)
        if noise:
            # A noisy copy of the target: a draft that agrees often but not always.
            gen = torch.Generator().manual_seed(seed + 1000)
            for param in model.parameters():
                param.add_(noise * param.std() * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


BUCKETS = (8, 16, 32)
MAX_INPUT = 48
CAP = 40


def random_texts(count: int, *, seed: int, overflow: bool = True) -> list[str]:
    """Return ASCII texts whose token counts cycle through every bucket (and overflow)."""
    rng = random.Random(seed)
    ranges = [(2, BUCKETS[0])]
    ranges += [(lo + 1, hi) for lo, hi in zip(BUCKETS, BUCKETS[1:], strict=False)]
    if overflow:
        ranges.append((BUCKETS[-1] + 1, MAX_INPUT))
    texts = []
    for i in range(count):
        lo, hi = ranges[i % len(ranges)]
        chars = [rng.choice("abcdefghij klmnop") for _ in range(rng.randint(lo, hi) - 1)]
        chars[0] = chars[-1] = "x"  # ByT5: one token per byte plus EOS; keep the ends
        texts.append("".join(chars))
    return texts


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Return a tiny target, a noisy-copy draft, and an unrelated smaller model."""
    root = tmp_path_factory.mktemp("tiny-t5")
    return {
        "target": build_tiny_t5(root / "target", seed=0),
        "draft": build_tiny_t5(root / "draft", seed=0, noise=0.05),
        "other": build_tiny_t5(root / "other", seed=7, d_model=16, layers=1),
    }


def tiny_config(dirs: dict[str, Path], **changes: object) -> EngineConfig:
    """Return an EngineConfig for the tiny models (dynamo-level compile, no inductor)."""
    base = dict(model_dir=str(dirs["target"]), draft_dir=str(dirs["draft"]), buckets=BUCKETS,
                max_input_tokens=MAX_INPUT, max_new_tokens=16, max_new_tokens_cap=CAP,
                compile_backend="aot_eager", speculative_k=3, kv_headroom=4,
                # Random weights draft badly: keep speculation where the flags say so.
                speculative_fallback=False)
    base.update(changes)
    return EngineConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def shared_flags() -> InMemoryFlagProvider:
    """Return the flag provider of the shared engine."""
    return InMemoryFlagProvider()


WARM_GRAPHS: dict[str, int] = {}  # graphs the shared warm engine's load and warm-up compiled


@pytest.fixture(scope="session")
def warm_engine(tiny_dirs: dict[str, Path], shared_flags: InMemoryFlagProvider):
    """Return one warmed tiny engine shared by the session (compiling costs seconds)."""
    from engine import load_engine
    from engine.compile_watch import shared_watch

    # Dynamo counts graphs per process: other tests' runtimes may have compiled before.
    before = shared_watch().snapshot().graphs
    engine = load_engine(tiny_config(tiny_dirs), flags=shared_flags)
    engine.warm_up(background=False)
    WARM_GRAPHS["warm_engine"] = engine.compile_snapshot().graphs - before
    yield engine
    engine.close()


@pytest.fixture
def flags(shared_flags: InMemoryFlagProvider) -> InMemoryFlagProvider:
    """Reset the shared engine's flags to defaults around a test."""
    shared_flags.set(RuntimeFlags())
    yield shared_flags
    shared_flags.set(RuntimeFlags())


# Compiler flags that build the C step without the wider vector paths (parametrized ISAs).
# "vectors": the machine's own build without AMX (its int8 products on vector registers only)
ISA_LIMITS = {"sse": "-mno-avx -mno-avx2 -mno-avx512f", "avx2": "-mno-avx512f",
              "vectors": "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"}


def limit_isa(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    """Make the C step build for `isa` ("native": the machine's own; skip where it cannot)."""
    if isa not in ISA_LIMITS:
        return
    import platform

    from engine import native

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"x86 only: {ISA_LIMITS[isa]}")
    if isa == "avx2" and " avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no AVX2 on this CPU")
    if isa == "vectors" and " amx_int8" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no AMX on this CPU: the native build is already the vectors'")
    cc = tmp_path / f"cc-{isa}"
    cc.write_text(f'#!/bin/sh\nexec {native._compiler()} "$@" {ISA_LIMITS[isa]}\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))


def batching_runtime(tmp_path: Path, dirs: dict[str, Path], *, warm: bool = True,
                     turns: bool = True, **changes: object) -> Any:
    """Return a runtime on the tiny models (eager backend), warmed unless `warm` is False;
    `turns` False: its rows never take turns (engine.scheduler._turn)."""
    from engine.runtime import Runtime

    rt = Runtime(tiny_config(dirs, compile_backend="eager", cache_dir=str(tmp_path / "cache"),
                             **changes))
    if not turns and rt.batch_scheduler is not None:
        # Turns are chosen from measured step times, a noisy step's among them: a test of
        # which rows share a step pins the choice (the turn tests inject the costs).
        rt.batch_scheduler.turns = False
    if warm:
        rt.warm_up(background=False)
    return rt


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory, tiny_dirs: dict[str, Path]
          ) -> Iterator[Callable[..., tuple[int, ...]]]:
    """Return a function giving a text's tokens decoded alone by an unbatched engine."""
    rt = batching_runtime(tmp_path_factory.mktemp("alone"), tiny_dirs, max_batch=1)
    memo: dict[tuple[str, int], tuple[int, ...]] = {}

    def tokens(text: str, max_new: int = 16) -> tuple[int, ...]:
        if (text, max_new) not in memo:
            memo[(text, max_new)] = rt.generate(
                text, max_new_tokens=max_new, override=FlagOverride(speculative=False)
            ).output_ids
        return memo[(text, max_new)]

    yield tokens
    rt.close()
