"""Users' own T5s load through engine.model_dir and decode exactly like Hugging Face."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.errors import ModelLoadError
from tests.engine.own.conftest import BUCKETS, own_config, texts_across_buckets

MAX_NEW = 12


def hf_model(path: Path):
    """Return the HF reference model of `path` in float32."""
    import transformers

    cfg = json.loads((path / "config.json").read_text())
    cls = (transformers.MT5ForConditionalGeneration if cfg["model_type"] == "mt5"
           else transformers.T5ForConditionalGeneration)
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def assert_matches_hf(path: Path, engine, count: int = 24) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = hf_model(path)
    texts = texts_across_buckets(tok, count, seed=len(str(path)))
    buckets, outputs = set(), set()
    for text in texts:
        result = engine.generate(text, max_new_tokens=MAX_NEW)
        ids = torch.tensor([tok(text).input_ids])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=MAX_NEW, do_sample=False, num_beams=1)
        assert list(result.output_ids) == ref[0].tolist()[1:], text
        buckets.add(result.bucket)
        outputs.add(result.output_ids)
    assert buckets == {*map(str, BUCKETS), "overflow"}
    assert len(outputs) > count // 2  # the random model's outputs differ between inputs


@pytest.mark.parametrize("kind", ["t5", "flan", "mt5"])
def test_greedy_matches_hf_on_inputs_across_buckets(own_models, kind):
    """t5-small (v1.0, sharded, spiece.model), flan-t5 (tokenizer.json), mT5 (bf16)."""
    from engine import load_engine

    engine = load_engine(own_config(own_models[kind]))
    try:
        assert_matches_hf(own_models[kind], engine)
    finally:
        engine.close()


def _variant(src: Path, dst: Path, *, fmt: str, dtype) -> Path:
    """Copy `src` re-saving its weights as `fmt` ("bin", "bin-sharded", "safetensors")."""
    from safetensors.torch import load_file, save_file

    from engine.loader import weight_files

    shutil.copytree(src, dst)
    state: dict = {}
    for f in weight_files(dst):
        if f.suffix == ".safetensors":
            state.update(load_file(f))
        f.unlink()
    state = {k: v.to(dtype) for k, v in state.items()}
    if fmt == "safetensors":
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    elif fmt == "bin":
        torch.save(state, dst / "pytorch_model.bin")
    else:
        names = sorted(state)
        weight_map = {}
        for i, part in enumerate((names[::2], names[1::2])):
            file = f"pytorch_model-{i + 1:05d}-of-00002.bin"
            torch.save({k: state[k] for k in part}, dst / file)
            weight_map.update(dict.fromkeys(part, file))
        (dst / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.mark.parametrize(("fmt", "dtype"), [("bin", "float32"), ("bin-sharded", "float32"),
                                            ("safetensors", "float16")])
def test_weight_layouts_and_dtypes_load(own_models, tmp_path, fmt, dtype):
    from engine import load_engine

    path = _variant(own_models["flan"], tmp_path / "model", fmt=fmt, dtype=getattr(torch, dtype))
    engine = load_engine(own_config(path))
    try:
        assert_matches_hf(path, engine, count=8)
    finally:
        engine.close()


def _edited(src: Path, dst: Path, file: str, **changes: object) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / file).read_text()) if (dst / file).is_file() else {}
    data.update(changes)
    (dst / file).write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize(("file", "changes", "named"), [
    ("config.json", {"model_type": "umt5"}, "umt5"),
    ("config.json", {"model_type": "bart"}, "model_type='bart'"),
    ("config.json", {"feed_forward_proj": "gated-quick_gelu", "dense_act_fn": "quick_gelu"},
     "feed_forward_proj"),
    ("config.json", {"architectures": ["T5EncoderModel"]}, "architectures"),
    ("config.json", {"is_decoder": True}, "is_decoder"),
    ("config.json", {"quantization_config": {"quant_method": "bitsandbytes"}},
     "quantization_config"),
    ("generation_config.json", {"num_beams": 4}, "num_beams"),
    ("generation_config.json", {"no_repeat_ngram_size": 3}, "no_repeat_ngram_size"),
    ("generation_config.json", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("config.json", {"pruned_heads": {"0": [1]}}, "pruned_heads"),
])
def test_unsupported_config_fields_are_refused_by_name(own_models, tmp_path, file, changes,
                                                       named):
    from engine.loader import load_model

    path = _edited(own_models["flan"], tmp_path / "model", file, **changes)
    with pytest.raises(ModelLoadError) as err:
        load_model(path)
    message = str(err.value)
    assert named in message and len(message.splitlines()) == 1, message


def test_missing_shard_and_missing_weights_are_refused(own_models, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.loader import load_model

    sharded = shutil.copytree(own_models["t5"], tmp_path / "sharded")
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00003.safetensors"):
        load_model(sharded)
    lacking = shutil.copytree(own_models["flan"], tmp_path / "lacking")
    state = load_file(lacking / "model.safetensors")
    del state["decoder.block.1.layer.2.DenseReluDense.wo.weight"]
    save_file(state, str(lacking / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lacks 1 weights"):
        load_model(lacking)
    no_tokenizer = shutil.copytree(own_models["t5"], tmp_path / "no-tok")
    (no_tokenizer / "spiece.model").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json or spiece.model"):
        load_model(no_tokenizer)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_the_released_checkpoint_needs_no_cycle_collection(own_models, quantization):
    """Loading frees the checkpoint's tensors by reference counting alone: no tensor is left
    for a cycle collection to find (loading runs none: on a large heap a full collection
    costs a good part of a second)."""
    from engine import load_engine

    gc.collect()
    gc.disable()
    try:
        engine = load_engine(own_config(own_models["t5"], quantization=quantization))
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        held = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    try:
        assert engine._target_loaded.weights is None
        assert held == []
    finally:
        engine.close()


def test_checkpoint_released_and_weights_counted_once(own_models):
    """The lean copy holds the weights; the checkpoint's tensors are dropped and no HF module
    is built (importing HF's T5 modeling costs seconds at every start); tied embeddings
    count once."""
    import sys

    from engine import load_engine

    def live_hf_models() -> int:
        gc.collect()
        classes = [c for name in ("T5ForConditionalGeneration", "MT5ForConditionalGeneration")
                   if (c := getattr(sys.modules.get("transformers"), name, None)) is not None]
        return sum(type(o) in classes for o in gc.get_objects())

    before = live_hf_models()
    engine = load_engine(own_config(own_models["t5"]))
    try:
        assert live_hf_models() == before
        assert engine._target_loaded.weights is None
        reference = hf_model(own_models["t5"])
        unique = {p.data_ptr(): p.numel() * 4 for p in reference.parameters()}
        # v1.0 ties lm_head to the embedding: resident once in HF and once in the engine.
        assert reference.lm_head.weight.data_ptr() == reference.shared.weight.data_ptr()
        assert engine.memory_snapshot().weight_bytes == sum(unique.values())
    finally:
        engine.close()
