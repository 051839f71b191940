"""Compiled functions saved ahead of time: build once, load at start without tracing.

`tailwatch engine precompile` AOT-compiles each function the buckets share (engine.aot)
once and saves it under a directory keyed on what changes it: the weights, the
optimization config, the torch version and the device type. A runtime loads those files
instead of calling torch.compile: no dynamo trace, no inductor lowering. On another
machine (the directory copied, the inductor cache empty) the `.aot` files still load
without tracing; only their C++ kernels are rebuilt. The CPU encoder is an AOTInductor
package (engine.aot.save_package), machine code for the CPU it was built on: its name
carries the CPU's flags, so another CPU compiles its own.

torch's portable cache artifacts (`torch.compiler.save_cache_artifacts`) are not written:
they serve only the torch.compile path and give no cache hit for functions compiled
ahead of time.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from engine.config import EngineConfig

DEFAULT_CACHE_DIR = "var/compile-cache"
_INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_root(config: EngineConfig) -> Path:
    """Return the compile cache directory for `config`: engine.cache_dir, else the one the
    operator gave inductor (TORCHINDUCTOR_CACHE_DIR), else ./var/compile-cache.

    The runtime resolves it once and passes it on (saved functions, the C step's build,
    the traffic file); nothing reads it back from the environment later.
    """
    if config.cache_dir is not None:
        return Path(config.cache_dir).resolve()
    return Path(os.environ.get(_INDUCTOR_ENV, DEFAULT_CACHE_DIR)).resolve()


def point_inductor(root: Path) -> None:
    """Make inductor cache its compiled code under `root`.

    torch reads its cache directory only from this environment variable (inductor has no
    config option for it), so this is the one place the engine writes it.
    """
    os.environ[_INDUCTOR_ENV] = str(root)


def saved_key(model_version: str, config_hash: str, device_type: str,
              compile_options: str) -> str:
    """Return the key of the saved functions for a model, an optimization config, a device."""
    import torch

    blob = f"{model_version}|{config_hash}|{torch.__version__}|{device_type}|{compile_options}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def saved_dir(root: Path, config: EngineConfig, model_version: str, device_type: str,
              compile_options: str) -> Path:
    """Return where the saved functions for this model, config and device live under the
    cache `root` (cache_root).

    compile_options: the engine's own inductor options (a new release may change them).
    """
    key = saved_key(model_version, config.config_hash(), device_type, compile_options)
    return root / "precompiled" / key


def dir_bytes(path: Path) -> int:
    """Return the bytes of the files directly under `path` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in path.glob("*") if p.is_file())
