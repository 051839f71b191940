"""CTranslate2 beside the engine: the same weights converted once, greedy outputs by token id.

The benches (bench.engine, bench.throughput, bench.quality) compare the engine with
CTranslate2 (the `bench` extra, `make bench-deps`) on the same checkpoint. `convert` runs
CTranslate2's TransformersConverter into a cache folder (var/ct2 by default) keyed by a
hash of the weights, config, tokenizer, the CTranslate2 version and the quantization, so a
changed checkpoint or upgrade converts again and a rerun converts nothing. `Ct2` maps
token ids through the converted model's own vocabulary (any tokenizer, T5-small's 32128
ids included) and decodes greedily on one thread; `compare` counts identical outputs and
the mean token agreement (probes.quality) against the engine's.

    ct = Ct2(convert("engine/builtin/target", Path("var/ct2"), "int8"), "int8")
    ids = ct.generate([engine.tokenizer(text).input_ids], new=32)[0]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path("var/ct2")
COMPUTE_TYPES = ("float32", "int8")
_VOCAB = "shared_vocabulary.json"
# What a checkpoint folder holds that changes the converted model (weights in any format).
_SOURCE_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json", "spiece.model",
                 "special_tokens_map.json", "added_tokens.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


def available() -> bool:
    """Return whether CTranslate2 and its transformers converter import."""
    try:
        import ctranslate2  # noqa: F401
        from ctranslate2.converters import TransformersConverter  # noqa: F401
    except ImportError:
        return False
    return True


def version() -> str:
    """Return the installed CTranslate2's version."""
    import ctranslate2

    return str(ctranslate2.__version__)


def source_key(model_dir: str | Path, weights: Mapping[str, Any] | None = None) -> str:
    """Return a hash of what a conversion of `model_dir` reads (its files; `weights`, the
    in-memory tensors by name, in place of the weight files when given)."""
    h = hashlib.sha256(f"ctranslate2 {version()}\n".encode())
    root = Path(model_dir)
    names = sorted(p.name for p in root.iterdir() if p.is_file())
    for name in names:
        if name in _SOURCE_FILES or (weights is None and name.endswith(_WEIGHT_SUFFIXES)):
            h.update(f"file {name}\n".encode())
            with open(root / name, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    if weights:
        import torch

        for name in sorted(weights):
            t = weights[name].detach().contiguous().cpu()
            h.update(f"tensor {name} {t.dtype} {tuple(t.shape)}\n".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:20]


def convert(model_dir: str | Path, out_root: Path, quantization: str, *,
            model: Any = None, key: str | None = None) -> Path:
    """Return the CTranslate2 model of `model_dir` at `quantization`, converting it once.

    model: an in-memory transformers model to convert instead of loading the folder's
        weights (the folder then needs only config.json and the tokenizer's files).
    key: the source hash when the caller has it (`source_key`); computed otherwise.
    """
    if quantization not in COMPUTE_TYPES:
        raise ValueError(f"quantization: expected one of {', '.join(COMPUTE_TYPES)}, "
                         f"got {quantization!r}")
    if key is None:
        key = source_key(model_dir, model.state_dict() if model is not None else None)
    path = out_root / f"{Path(model_dir).name}-{key}-{quantization}"
    if (path / "model.bin").is_file() and (path / _VOCAB).is_file():
        return path
    out_root.mkdir(parents=True, exist_ok=True)
    # Converted beside its final name, then renamed: an interrupted run leaves no half model.
    tmp = out_root / f".{path.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _converter(str(model_dir), model).convert(str(tmp), quantization=quantization, force=True)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def _converter(model_dir: str, model: Any) -> Any:
    from ctranslate2.converters import TransformersConverter

    if model is None:
        return TransformersConverter(model_dir)

    class InMemory(TransformersConverter):  # type: ignore[misc]
        def load_model(self, model_class: Any, model_name_or_path: str, **kwargs: Any) -> Any:
            return model

    return InMemory(model_dir)


class Ct2:
    """One converted model on CPU, one thread: greedy decoding by token id."""

    def __init__(self, path: Path, compute_type: str) -> None:
        import ctranslate2

        self.path, self.compute_type = path, compute_type
        self.translator = ctranslate2.Translator(str(path), device="cpu",
                                                 compute_type=compute_type,
                                                 inter_threads=1, intra_threads=1)
        self.tokens: list[str] = json.loads((path / _VOCAB).read_text())
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        if len(self.ids) != len(self.tokens):
            raise ValueError(f"{path / _VOCAB}: repeated tokens; ids cannot round-trip")

    def generate(self, inputs: Sequence[Sequence[int]], new: int, *, max_batch_size: int = 0,
                 stop_at_eos: bool = True) -> list[list[int]]:
        """Return each input's greedy output ids (EOS included when it ends one, like the
        engine's output_ids): at most `new` tokens, `max_batch_size` inputs per batch
        (0: all at once). stop_at_eos False: exactly `new` tokens, EOS or not."""
        source = [[self.tokens[i] for i in ids] for ids in inputs]
        # min_decoding_length 0: an EOS may come first, as in the engine; no input truncation.
        results = self.translator.translate_batch(
            source, max_batch_size=max_batch_size, beam_size=1, max_decoding_length=new,
            min_decoding_length=0, max_input_length=0, return_end_token=True,
            end_token=None if stop_at_eos else [])
        return [[self.ids[t] for t in r.hypotheses[0]] for r in results]


def load(model_dir: str | Path, out_root: Path, compute_types: Sequence[str] = COMPUTE_TYPES,
         *, model: Any = None) -> dict[str, Ct2]:
    """Return a Ct2 per compute type for `model_dir` ({} when CTranslate2 is missing)."""
    if not available():
        return {}
    key = source_key(model_dir, model.state_dict() if model is not None else None)
    return {c: Ct2(convert(model_dir, out_root, c, model=model, key=key), c)
            for c in compute_types}


@dataclass(frozen=True)
class Comparison:
    """CTranslate2's outputs against the engine's, input by input."""

    outputs: int
    identical: int
    agreement: float  # mean token agreement (probes.quality.compare), 1.0: all identical

    @property
    def differences(self) -> int:
        return self.outputs - self.identical

    def __str__(self) -> str:
        return (f"{self.identical}/{self.outputs} identical, token agreement "
                f"{self.agreement:.4f}")


def compare(engine: Sequence[Sequence[int]], ct2: Sequence[Sequence[int]]) -> Comparison:
    """Compare outputs pairwise, token for token (same order, same length of lists)."""
    from probes.quality import compare as compare_ids

    if len(engine) != len(ct2):
        raise ValueError(f"{len(engine)} engine outputs against {len(ct2)} CTranslate2 outputs")
    results = [compare_ids(list(c), list(e)) for e, c in zip(engine, ct2, strict=True)]
    return Comparison(outputs=len(results), identical=sum(r.exact for r in results),
                      agreement=statistics.fmean(r.agreement for r in results)
                      if results else float("nan"))
