"""The model runtime: the only package that imports torch and transformers.

Import the contract from `engine.protocol` and `engine.errors` (no torch); build a
runtime with `load_engine(config)`, which imports torch on first call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine import malloc
from engine.config import EngineConfig
from engine.errors import (
    Cancelled,
    EngineError,
    InputTooLong,
    InvalidRequest,
    ModelLoadError,
    NotReady,
    Overloaded,
    RequestTimeout,
)
from engine.protocol import (
    CancelSignal,
    Engine,
    FlagOverride,
    FlagProvider,
    GenerateResult,
    InMemoryFlagProvider,
    RuntimeFlags,
)

if TYPE_CHECKING:
    from engine.protocol import FlagProvider as _FP


def load_engine(config: EngineConfig, flags: _FP | None = None) -> Engine:
    """Build the torch-backed runtime (imports torch)."""
    from engine.runtime import Runtime

    return Runtime(config, flags=flags)


# On import, before the service starts its threads: glibc fixes the arena limit once more
# than 8 arenas exist, so a cap set when the model loads can come too late.
malloc.limit_arenas()

__all__ = [
    "CancelSignal",
    "Cancelled",
    "Engine",
    "EngineConfig",
    "EngineError",
    "FlagOverride",
    "FlagProvider",
    "GenerateResult",
    "InMemoryFlagProvider",
    "InputTooLong",
    "InvalidRequest",
    "ModelLoadError",
    "NotReady",
    "Overloaded",
    "RequestTimeout",
    "RuntimeFlags",
    "load_engine",
]
