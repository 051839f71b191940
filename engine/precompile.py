"""Portable compile artifacts: build once, load at start so warm-up compiles nothing.

`tailwatch engine precompile` warms every bucket and saves torch's cache artifacts
(`torch.compiler.save_cache_artifacts`: the inductor FX graphs and AOT autograd
entries with their compiled kernels) to one file keyed on what changes them: the
weights, the optimization config, the torch version and the device type. A runtime
loads that file before warming (`load_cache_artifacts`), so its warm-up only
re-traces and every inductor compile is a cache hit, even on a machine whose local
inductor cache is empty (a fresh clone, a new container).

Next to the artifacts (`<key>.fns/`), precompile also saves each bucket's compiled
functions (engine.aot): a restart loads those instead of re-tracing with dynamo, and
falls back to the artifacts path when one cannot serve.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig


def cache_root(config: EngineConfig) -> Path:
    """Return the compile cache directory the runtime uses for `config`."""
    if config.cache_dir is not None:
        return Path(config.cache_dir).resolve()
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "var/compile-cache")).resolve()


def artifacts_key(model_version: str, config_hash: str, device_type: str) -> str:
    """Return the key of the artifacts for a model, an optimization config and a device."""
    import torch

    blob = f"{model_version}|{config_hash}|{torch.__version__}|{device_type}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def artifacts_path(config: EngineConfig, model_version: str, device_type: str) -> Path:
    """Return where the artifacts for this model, config and device live."""
    key = artifacts_key(model_version, config.config_hash(), device_type)
    return cache_root(config) / "precompiled" / f"{key}.bin"


@dataclass(frozen=True)
class Loaded:
    """What loading artifacts found."""

    path: Path
    hit: bool  # a file was there and torch accepted it
    entries: int  # cache entries it held
    seconds: float


def load_artifacts(path: Path) -> Loaded:
    """Load artifacts from `path` into torch's caches when the file exists."""
    import torch

    start = time.perf_counter()
    if not path.is_file():
        return Loaded(path, False, 0, 0.0)
    info = torch.compiler.load_cache_artifacts(path.read_bytes())
    entries = sum(len(v) for v in vars(info).values() if isinstance(v, list)) if info else 0
    return Loaded(path, info is not None, entries, time.perf_counter() - start)


def save_artifacts(path: Path) -> int:
    """Save everything compiled in this process to `path`; return the bytes written."""
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    blob, _info = saved
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(blob)
    tmp.replace(path)  # readers never see half a file
    return len(blob)


def saved_dir(path: Path) -> Path:
    """Return the directory of the compiled functions saved with the artifacts at `path`."""
    return path.with_suffix(".fns")
