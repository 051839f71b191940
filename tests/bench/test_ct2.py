"""bench.ct2 on a tiny random T5: converted once per weights, greedy outputs token for token
against the engine's (the folder conversion and bench.quality's in-memory one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import ct2
from tests.engine.conftest import build_tiny_t5, random_texts

pytest.importorskip("ctranslate2")

NEW = 24


def _engine_outputs(model_dir: Path, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Return the engine's input ids and greedy outputs (eager, float32, direct)."""
    from engine import load_engine
    from engine.config import EngineConfig

    engine = load_engine(EngineConfig(model_dir=str(model_dir), use_draft=False,
                                      compile_mode="off", buckets=(8, 16, 32),
                                      max_input_tokens=48, flags_file=""))
    try:
        outs = [list(engine.generate(t, max_new_tokens=NEW).output_ids) for t in texts]
        return [engine.tokenizer(t).input_ids for t in texts], outs
    finally:
        engine.close()


def test_a_checkpoint_converts_once_and_float32_gives_the_engines_tokens(
        tmp_path: Path) -> None:
    model_dir = build_tiny_t5(tmp_path / "tiny", seed=0)
    root = tmp_path / "ct2"
    texts = random_texts(9, seed=3, overflow=False)
    inputs, ours = _engine_outputs(model_dir, texts)

    models = ct2.load(model_dir, root)
    assert set(models) == {"float32", "int8"}
    alone = [models["float32"].generate([ids], NEW)[0] for ids in inputs]
    assert ct2.compare(ours, alone).differences == 0
    assert all(len(o) == NEW or (o[-1] == 1 and len(o) < NEW) for o in alone)  # EOS kept
    batched = models["float32"].generate(inputs, NEW, max_batch_size=4)
    assert ct2.compare(ours, batched).agreement > 0.9  # padding may move a near tie
    int8 = ct2.compare(ours, models["int8"].generate(inputs, NEW))
    assert int8.outputs == len(texts) and 0.0 <= int8.agreement <= 1.0

    # A rerun converts nothing; changed weights convert again, into their own folder.
    stamps = {p: (p / "model.bin").stat().st_mtime_ns for p in root.iterdir()}
    assert len(stamps) == 2 and not [p for p in root.iterdir() if p.name.startswith(".")]
    ct2.load(model_dir, root)
    assert {p: (p / "model.bin").stat().st_mtime_ns for p in root.iterdir()} == stamps
    build_tiny_t5(model_dir, seed=1)
    ct2.load(model_dir, root, ("float32",))
    assert len(list(root.iterdir())) == 3


def test_the_in_memory_conversion_of_bench_quality_matches_its_c_step(tmp_path: Path) -> None:
    import torch

    from bench.quality import small_config, small_decode, small_hf, small_model, small_weights
    from engine import native

    lib = native.load(tmp_path / "native")
    if lib is None:
        pytest.skip("no C compiler: the C step cannot be built")
    # The T5-small shape's construction at a tiny size: vocabulary beyond the byte tokens.
    cfg = small_config(vocab_size=400, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                       num_heads=4)
    weights = small_weights(cfg)
    model = small_model(cfg, weights)
    source = tmp_path / "small"
    models = ct2.load(source, tmp_path / "ct2", ("float32",),
                      model=small_hf(cfg, weights, source))
    gen = torch.Generator().manual_seed(1)
    ours, theirs = [], []
    for length in (5, 12, 30):
        ids = torch.randint(2, 400, (1, length), generator=gen)
        ours.append(small_decode(lib.bind(model), model, ids, NEW))
        theirs.append(models["float32"].generate(ids.tolist(), NEW, stop_at_eos=False)[0])
    assert all(len(t) == NEW for t in theirs)  # no EOS stop, like the C step
    assert max(max(o) for o in ours) >= 259  # ids past the byte tokens round-trip
    assert ct2.compare(ours, theirs).differences == 0


def test_compare_counts_identical_outputs_and_token_agreement() -> None:
    c = ct2.compare([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert (c.outputs, c.identical, c.differences) == (2, 1, 1)
    assert c.agreement == pytest.approx((1.0 + 2 / 3) / 2)
    with pytest.raises(ValueError, match="2 engine outputs against 1"):
        ct2.compare([[1], [2]], [[1]])


def test_an_unknown_quantization_is_refused_before_converting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization: expected one of float32, int8"):
        ct2.convert(tmp_path, tmp_path / "out", "int4")
    assert not (tmp_path / "out").exists()
