"""Load a T5 and its tokenizer from a local Hugging Face directory, offline.

A model directory is what `save_pretrained` writes: `config.json`; the weights as one
`model.safetensors` / `pytorch_model.bin` or as shards listed by
`model.safetensors.index.json` / `pytorch_model.bin.index.json`; the tokenizer as
`tokenizer.json` or a SentencePiece `spiece.model` (t5-small, flan-T5 and mT5 as
published), with `tokenizer_config.json` when it has one. Weights may be float32,
bfloat16 or float16: the lean forward casts them to the engine's dtype.

T5 v1.0 (ReLU, tied embeddings, scaled decoder output), v1.1 / flan-T5 (gated GELU,
untied lm_head) and mT5 load. Everything else that would change the math is refused
by name (`check_config`, `check_generation_config`), never ignored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

SINGLE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer_config.json")
MODEL_TYPES = ("t5", "mt5")
# The activations engine.t5 implements exactly as Hugging Face does.
ACTIVATIONS = ("relu", "gelu", "gelu_new", "gelu_pytorch_tanh", "silu")
# Generation settings a greedy decode would silently drop: (field, value that is a no-op).
_GENERATION_NOOPS: dict[str, Any] = {
    "num_beams": 1, "do_sample": False, "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "min_length": 0, "min_new_tokens": None, "sequence_bias": None,
    "forced_decoder_ids": None, "penalty_alpha": None, "epsilon_cutoff": None,
}


@dataclass(frozen=True)
class LoadedModel:
    """A checkpoint's config, its tensors by HF name (None once released), its tokenizer
    and the hash of its weights."""

    path: Path
    config: Any
    weights: dict[str, Any] | None
    tokenizer: Any
    weights_hash: str

    def released(self) -> LoadedModel:
        """Return this record without the checkpoint's tensors, so they can be freed."""
        return replace(self, weights=None)


def weight_files(path: Path) -> list[Path]:
    """Return the weight files of `path` (one file, or every shard its index lists)."""
    for name in SINGLE_WEIGHT_FILES:
        if (path / name).is_file():
            return [path / name]
    for name in INDEX_FILES:
        index = path / name
        if not index.is_file():
            continue
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index}: unreadable shard index ({exc})") from exc
        for shard in shards:
            if not (path / shard).is_file():
                raise ModelLoadError(f"{index}: lists shard {shard}, which is missing")
        return [index, *(path / s for s in shards)]
    raise ModelLoadError(f"{path}: missing weights file (one of {', '.join(SINGLE_WEIGHT_FILES)},"
                         f" or a sharded checkpoint with {' or '.join(INDEX_FILES)})")


def weights_hash(path: Path) -> str:
    """Return a short sha256 over the weight files and config of `path`."""
    h = hashlib.sha256()
    files = sorted([*weight_files(path), path / "config.json"], key=lambda p: p.name)
    for p in files:
        h.update(p.name.encode())
        with p.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:12]


def fingerprint(path: Path) -> tuple[tuple[str, int, int, int], ...]:
    """Return what identifies the weight files of `path` on disk now (name, inode, size,
    modification time): a file replaced or rewritten since changes it."""
    out = []
    for p in weight_files(path):
        st = p.stat()
        out.append((p.name, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def check_config(config: Any, path: Path) -> None:
    """Refuse, by field name, a config whose math the lean forward does not implement."""
    model_type = getattr(config, "model_type", None)
    if model_type == "umt5":
        raise ModelLoadError(f"{path}: model_type 'umt5' is not supported (UMT5 has a relative"
                             " position bias in every layer; tailwatch serves t5 and mt5)")
    if model_type not in MODEL_TYPES:
        raise ModelLoadError(f"{path}: not a T5 model (model_type={model_type!r}; supported:"
                             f" {', '.join(MODEL_TYPES)})")
    if not getattr(config, "is_encoder_decoder", True) or getattr(config, "is_decoder", False):
        raise ModelLoadError(f"{path}: config.json: is_encoder_decoder must be true and"
                             " is_decoder false (an encoder-decoder T5)")
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith("ForConditionalGeneration") for a in archs):
        raise ModelLoadError(f"{path}: config.json: architectures={archs} has no decoder and"
                             " lm_head (need *ForConditionalGeneration)")
    act = getattr(config, "dense_act_fn", None)
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"{path}: config.json: feed_forward_proj="
                             f"{getattr(config, 'feed_forward_proj', act)!r} (activation {act!r})"
                             f" is not supported; supported: {', '.join(ACTIVATIONS)}")
    if getattr(config, "pruned_heads", None):
        raise ModelLoadError(f"{path}: config.json: pruned_heads is not supported")
    if getattr(config, "quantization_config", None):
        raise ModelLoadError(f"{path}: config.json: quantization_config is not supported"
                             " (load float32, bfloat16 or float16 weights)")
    for name in ("d_model", "d_kv", "num_heads", "num_layers", "vocab_size"):
        value = getattr(config, name, None)
        if not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{path}: config.json: {name} must be a positive integer,"
                                 f" got {value!r}")


def check_generation_config(path: Path) -> None:
    """Refuse generation settings (in config.json or generation_config.json) greedy drops."""
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ModelLoadError(f"{file}: unreadable JSON ({exc})") from exc
        for field, noop in _GENERATION_NOOPS.items():
            value = data.get(field)
            if value is None or value == noop or value in ([], {}):
                continue
            raise ModelLoadError(f"{file}: {field}={value!r} is not supported (tailwatch"
                                 " decodes greedily and would ignore it)")


def _check_files(path: Path) -> None:
    if not path.is_dir():
        raise ModelLoadError(f"{path}: model directory does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: missing config.json")
    weight_files(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{path}: missing tokenizer files (tokenizer.json or spiece.model)")


def load_tokenizer(path: str | Path) -> Any:
    """Load the tokenizer of the model directory `path` without the hub."""
    path = Path(path)
    _check_files(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure is a load error
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{path}: cannot load the tokenizer: {first}") from exc


def read_weights(path: Path) -> dict[str, Any]:
    """Return every tensor of `path`'s weight files by name, on the CPU, as saved."""
    import torch
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for file in weight_files(path):
        if file.name in INDEX_FILES:
            continue
        try:
            if file.suffix == ".safetensors":
                state.update(load_file(file))
            else:
                state.update(torch.load(file, map_location="cpu", weights_only=True))
        except Exception as exc:  # noqa: BLE001 - any failure is a load error
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelLoadError(f"{file}: cannot read the weights: {first}") from exc
    # Tied embeddings may be saved under one alias only (save_pretrained keeps `shared`).
    for alias in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        if "shared.weight" not in state and alias in state:
            state["shared.weight"] = state[alias]
    return state


def read_config(path: str | Path) -> Any:
    """Return the checked config of the T5 / mT5 checkpoint at `path` (ModelLoadError: why
    it cannot be served), without reading its weights."""
    path = Path(path)
    _check_files(path)
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a load error
        raise ModelLoadError(f"{path}: unreadable config.json: {exc}") from exc
    check_config(config, path)
    return config


def load_model(path: str | Path) -> LoadedModel:
    """Load a T5 / mT5 checkpoint (config, weights) and its tokenizer from `path`.

    The weights are read as tensors by name, as Hugging Face's `from_pretrained` would
    place them (a checkpoint's own lm_head, else the tied embedding), without building
    HF's modules: importing its T5 modeling code alone costs seconds at every start.
    """
    path = Path(path)
    config = read_config(path)
    from engine.t5 import required_weights

    check_generation_config(path)
    weights = read_weights(path)
    missing = [name for name in required_weights(config) if name not in weights]
    if missing:
        # from_pretrained would initialize them randomly: serving that is never right.
        raise ModelLoadError(f"{path}: the checkpoint lacks {len(missing)} weights"
                             f" (e.g. {missing[0]})")
    tokenizer = load_tokenizer(path)
    return LoadedModel(path=path, config=config, weights=weights, tokenizer=tokenizer,
                       weights_hash=weights_hash(path))


def describe_tokenizer(tokenizer: Any, path: Path) -> str:
    """Return a short description of a tokenizer's vocabulary for error messages."""
    return f"{type(tokenizer).__name__}, {len(tokenizer)} tokens, {path}"


def _special_ids(tokenizer: Any, config: Any) -> dict[str, object]:
    ids: dict[str, object] = {name: getattr(tokenizer, f"{name}_token_id", None)
                              for name in ("pad", "eos", "unk", "bos")}
    for name in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
        ids[f"config.{name}"] = getattr(config, name, None)
    return ids


def tokenizer_mismatch(target: LoadedModel, draft: LoadedModel, target_config: Any,
                       draft_config: Any) -> str | None:
    """Return why `draft` cannot speculate for `target` (vocabulary or special ids), or None."""
    a, b = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: (kv[1], kv[0]))
        token, _ = diff[0]
        return (f"token {token!r} is id {a.get(token)} in the target and {b.get(token)}"
                " in the draft")
    sa, sb = _special_ids(target.tokenizer, target_config), _special_ids(draft.tokenizer,
                                                                         draft_config)
    for name in sa:
        if sa[name] != sb[name]:
            return f"{name} is {sa[name]} in the target and {sb[name]} in the draft"
    if draft_config.vocab_size > target_config.vocab_size:
        return (f"the draft's embedding has {draft_config.vocab_size} rows, the target's"
                f" {target_config.vocab_size}")
    return None


def pair_draft(config: Any, target: LoadedModel) -> tuple[LoadedModel | None, str]:
    """Return the draft to speculate with for `target` (or None) and why.

    - `use_draft` off: none.
    - `draft_dir` set: that draft, if its tokenizer matches the target's (vocabulary and
      special ids); otherwise a ModelLoadError naming both vocabularies.
    - no `draft_dir`: the built-in draft for the built-in target only; a user model
      runs direct decoding (the built-in draft knows nothing of its vocabulary).
    """
    from engine.config import BUILTIN_DIR

    if not config.use_draft:
        return None, "off: engine.use_draft is false; direct decoding"
    if config.draft_dir is None:
        if config.model_dir is not None:
            return None, ("off: no engine.draft_dir for the model at "
                          f"{config.model_dir} (the built-in draft pairs only with the built-in"
                          " target); direct decoding")
        builtin = BUILTIN_DIR / "draft"
        if not builtin.is_dir():
            return None, "off: the built-in draft is not installed; direct decoding"
        return load_model(builtin), f"on: built-in draft {builtin}"
    draft = load_model(config.draft_dir)
    why = tokenizer_mismatch(target, draft, target.config, draft.config)
    if why is not None:
        raise ModelLoadError(
            f"draft_dir: the draft's vocabulary ({describe_tokenizer(draft.tokenizer, draft.path)})"
            f" differs from the target's ({describe_tokenizer(target.tokenizer, target.path)}):"
            f" {why}")
    return draft, f"on: draft {draft.path}"
