"""Load a T5 and its tokenizer from a local Hugging Face directory, offline."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.json",
                   "spiece.model")


@dataclass(frozen=True)
class LoadedModel:
    """A loaded HF model, its tokenizer and the hash of its weights."""

    path: Path
    model: Any
    tokenizer: Any
    weights_hash: str


def _weights_file(path: Path) -> Path:
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return path / name
    shards = sorted(path.glob("model-*.safetensors"))
    if shards:
        return shards[0]
    raise ModelLoadError(f"{path}: missing weights file (one of {', '.join(WEIGHT_FILES)})")


def weights_hash(path: Path) -> str:
    """Return a short sha256 over the weight files and config of `path`."""
    h = hashlib.sha256()
    files = sorted(p for p in path.iterdir()
                   if p.suffix in (".safetensors", ".bin") or p.name == "config.json")
    for p in files:
        h.update(p.name.encode())
        with p.open("rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:12]


def load_model(path: str | Path) -> LoadedModel:
    """Load `T5ForConditionalGeneration` and its tokenizer from `path` without the hub."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: model directory does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: missing config.json")
    _weights_file(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{path}: missing tokenizer files (tokenizer_config.json)")
    from transformers import AutoConfig, AutoTokenizer, T5ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a load error
        raise ModelLoadError(f"{path}: unreadable config.json: {exc}") from exc
    if getattr(config, "model_type", None) not in ("t5", "mt5", "umt5"):
        raise ModelLoadError(f"{path}: not a T5 model (model_type={config.model_type!r})")
    try:
        model = T5ForConditionalGeneration.from_pretrained(path, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"{path}: cannot load model or tokenizer: {exc}") from exc
    return LoadedModel(path=path, model=model, tokenizer=tokenizer, weights_hash=weights_hash(path))
