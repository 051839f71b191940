"""Compiled functions saved ahead of time and loaded at start without dynamo.

`tailwatch engine precompile` compiles each function the buckets share once, with
`torch.compile(fullgraph=True).aot_compile`, and saves it (engine.precompile says
where). A restart loads those files instead of calling torch.compile: no dynamo
trace, no fake-tensor propagation, no guard building from the model; only the
inductor modules are imported (their C++ kernels come from the local inductor cache,
or are rebuilt from the saved source when it is empty).

On the CPU the encoder is saved as an AOTInductor package instead (`save_package`,
`load_package`): exported with its input length dynamic, compiled to one shared library
with its weights, and loaded by torch's C++ loader, so a warm start imports neither
dynamo nor inductor (seconds of a restart). Its code is built for this CPU's vector ISA:
the file name carries the CPU's tag (`cpu_tag`), so another machine compiles its own.

Two torch 2.13 limits shape the `.aot` functions:
- Only tensor-metadata, shape and global-state guards survive saving. The loader
  rebuilds every other guard against the saved frame, which has no `m` (the
  LeanT5 argument) and fails on guards that walk its module tree; `guard_filter`
  keeps just the portable guards on the non-model arguments.
- Saved tensor guards keep a tensor's metadata but not its Python attributes, so
  the rebuilt dimension-marking guard rejects every tensor given `mark_dynamic`
  (the runner's self-attention bias corners): "_has_dynamo_dim_marking is present
  on runtime tensor but was absent at compile time". `load` checks the guards once
  on the warm-up inputs with unmarked views, then turns per-call guard checks off:
  each function is only ever called by its runner with the shapes it was saved for.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.errors import EngineError

log = logging.getLogger(__name__)

SUFFIX = ".aot"
PACKAGE_SUFFIX = ".pt2"


class AOTLoadError(EngineError):
    """A saved compiled function cannot serve this runtime."""


_isa_probe: threading.Thread | None = None
_isa_lock = threading.Lock()


def start_isa_probe() -> None:
    """Run inductor's CPU vector-ISA probe in a thread, overlapping the start-up that follows.

    The first inductor kernel loaded on a CPU asks which vector ISA the machine and the
    compiler support: a cached test library dlopened in a child Python per candidate ISA
    (one on an AVX2-only CPU; ten on an AVX-512 one with AMX), waiting
    on other processes (the answer is cached for the process). Run here, it waits on the
    second core while the main thread loads weights and tokenizers; the warm-up
    joins it before it loads or compiles anything.
    """
    global _isa_probe
    # Everything the probe imports is imported on this thread first: two threads importing
    # the same package cycle can see each other's half-initialized modules, and the
    # probe's build imports setuptools and packaging (through torch.utils.cpp_extension)
    # while this thread imports transformers, which imports packaging too.
    import torch.utils.cpp_extension  # noqa: F401
    from torch._inductor import codecache, cpp_builder, cpu_vec_isa  # noqa: F401

    with _isa_lock:
        if _isa_probe is None:
            _isa_probe = threading.Thread(target=_probe_isa, name="inductor-isa-probe",
                                          daemon=True)
            _isa_probe.start()


def _probe_isa() -> None:
    from torch._inductor import cpu_vec_isa

    try:
        cpu_vec_isa.valid_vec_isa_list()
    except Exception as exc:  # noqa: BLE001 - the loader probes again and reports it
        log.debug("inductor ISA probe failed early: %s", exc)


def join_isa_probe() -> None:
    """Wait for the probe `start_isa_probe` started, if any (its answer is then cached)."""
    with _isa_lock:
        probe = _isa_probe
    if probe is not None:
        probe.join()


def guard_filter(keep: Callable[[Sequence[Any]], list[bool]]
                 ) -> Callable[[Sequence[Any]], list[bool]]:
    """Return a guard filter that keeps what `keep` keeps, and only portable guards."""
    def _filter(entries: Sequence[Any]) -> list[bool]:
        portable = torch.compiler.keep_portable_guards_unsafe(entries)
        return [a and b for a, b in zip(keep(entries), portable, strict=True)]

    return _filter


def _unmarked(args: Sequence[Any]) -> tuple[Any, ...]:
    # A view is a new Python object: same storage and metadata, no dynamo markings.
    return tuple(a.view(a.shape) if isinstance(a, torch.Tensor)
                 and hasattr(a, "_dynamo_dynamic_indices") else a for a in args)


def save(compiled: Any, example: Sequence[Any], path: Path) -> None:
    """AOT-compile `compiled` (a fullgraph torch.compile wrapper) on `example`; save it."""
    with torch.no_grad():  # the runtime calls every function under no_grad
        fn = compiled.aot_compile((tuple(example), {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    fn.save_compiled_function(str(path))


def load(path: Path, example: Sequence[Any]) -> Callable[..., Any]:
    """Load a saved function and check its guards once on `example`; raise AOTLoadError."""
    try:
        # A saved function's kernels are loaded from the inductor cache by their source's
        # hash; the precompiled header only speeds a rebuild, yet inductor preprocesses
        # its header (a g++ run) to key it before it looks for the library.
        from torch._inductor import config as inductor_config

        with path.open("rb") as file, inductor_config.patch(cpp_cache_precompile_headers=False):
            fn: Any = torch.compiler.load_compiled_function(file)  # an AOTCompiledFunction
        args = _unmarked(example)
        with torch.no_grad():
            ok = fn.guard_check(*args)
            if not ok:
                reason = fn._artifacts.guard_manager.check_verbose(fn.prepare_f_locals(*args))
                raise AOTLoadError(f"{path.name}: guards fail on this runtime's inputs: "
                                   f"{getattr(reason, 'verbose_code_parts', reason)}")
    except AOTLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - any torch error means: compile instead
        raise AOTLoadError(f"{path.name}: {type(exc).__name__}: {exc}"[:500]) from exc
    fn.disable_guard_check()  # checked above; see the module docstring
    return fn


@functools.cache
def cpu_tag() -> str:
    """Return what compiled CPU code depends on besides its source: machine and CPU flags
    (read once: every saved-file lookup names it)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()}|{flags}"


def cpu_key() -> str:
    """Return a short hash of `cpu_tag` for file names."""
    return hashlib.sha256(cpu_tag().encode()).hexdigest()[:8]


class _Bound(torch.nn.Module):
    """`fn(m, *tensors)` as a module holding `m`, for torch.export."""

    def __init__(self, fn: Callable[..., Any], m: torch.nn.Module) -> None:
        super().__init__()
        self.fn, self.m = fn, m

    def forward(self, *tensors: torch.Tensor) -> Any:
        return self.fn(self.m, *tensors)


def save_package(fn: Callable[..., Any], example: Sequence[Any], dynamic: Sequence[Any],
                 path: Path, options: dict[str, Any]) -> None:
    """Export `fn(m, *tensors)` on `example` (m first) with `dynamic` shapes and save it as an
    AOTInductor package (weights included) at `path`."""
    from torch._inductor import aoti_compile_and_package

    m, *tensors = example
    with torch.no_grad(), warnings.catch_warnings():
        # torch's own deprecation notices from export's pytree (nothing the user can act on).
        warnings.simplefilter("ignore", FutureWarning)
        # forward(*tensors): one positional group, so the shapes nest once more.
        exported = torch.export.export(_Bound(fn, m).eval(), tuple(tensors),
                                       dynamic_shapes=(tuple(dynamic),))
        path.parent.mkdir(parents=True, exist_ok=True)
        aoti_compile_and_package(exported, package_path=str(path),
                                 inductor_configs=dict(options))


def load_package(path: Path) -> Callable[..., Any]:
    """Load a package `save_package` wrote: `fn(m, *tensors)` -> its one output; raise
    AOTLoadError. torch's C++ loader only: neither dynamo nor inductor is imported."""
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except Exception as exc:  # noqa: BLE001 - any torch error means: compile instead
        raise AOTLoadError(f"{path.name}: {type(exc).__name__}: {exc}"[:500]) from exc

    def run(m: Any, *tensors: torch.Tensor) -> torch.Tensor:
        return loader.boxed_run(list(tensors))[0]

    return run
