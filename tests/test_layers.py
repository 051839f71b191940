"""Imports point one way: monitor -> alerts/probes -> storage, and the engine is reached
through the interface it publishes.

- A package imports its own modules, the packages below it and `vocab`; `alerts` and
  `probes` are siblings and import neither each other nor `monitor`; `engine` imports
  none of them.
- Outside `engine`, only the modules that compose an engine (load it, configure it, wrap
  it for the demo or the CLI) import more of it than its published interface: the
  `Engine` protocol and its types, its exception tree and the request checks every engine
  runs. Everything else (the API, metrics, probes, alerts, storage) sees the protocol,
  and calls what it declares: no `getattr(engine, ...)` for a method it might lack. The
  process's malloc helpers (`engine.malloc`) belong to no engine and are open to all.
- No runtime package imports `tests`; a test helper (conftest, fakes, builders) under
  `tests/<package>/` follows its package's direction, so a lower package's tests can use
  it without pulling in a higher one. Test modules themselves are end-to-end and free.

Edges come from tests.test_import_cycles: every import in a module's source counts.
"""

from __future__ import annotations

import ast

import pytest

from tests.test_import_cycles import ROOT, import_graph

LAYER = {"vocab": 0, "storage": 1, "alerts": 2, "probes": 2, "monitor": 3}
RUNTIME = ("vocab", "engine", "storage", "alerts", "probes", "monitor")
ENGINE_INTERFACE = {"engine.protocol", "engine.errors", "engine.validation"}
# What the engine package owns for the whole process, torch-free: importing `engine` caps
# glibc's arenas (engine.malloc), and `serve` and its worker trim their heaps with it.
PROCESS_WIDE = {"engine.malloc"}
# Modules that build or wrap an engine, and why they may see more than the interface.
COMPOSERS = {
    "monitor.engine_holder": "loads the runtime in the background",
    "monitor.settings": "engine.config is the engine's section of the settings",
    "monitor.cli.": "engine precompile and generate drive the runtime directly",
    "monitor.demo.": "wraps the runtime to inject the scripted faults",
    "probes.fake": "a stand-in engine admitting through the real admission control",
}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "tests" and len(parts) > 2 else parts[0]


def _is_test_module(module: str) -> bool:
    return module.split(".")[-1].startswith("test_")


def direction_errors(graph: dict[str, set[str]]) -> list[str]:
    """Return one line per import that runs up or sideways between layered packages."""
    out = []
    for module, targets in sorted(graph.items()):
        if module.startswith("tests.") and _is_test_module(module):
            continue
        here = _package(module)
        for target in sorted(targets):
            there = _package(target)
            if there == here:
                continue
            if here == "engine" and there in LAYER and there != "vocab":
                out.append(f"{module} -> {target}: the engine imports no monitoring package")
            elif (here in LAYER and there in LAYER and LAYER[there] >= LAYER[here]):
                out.append(f"{module} -> {target}: {there} is not below {here}")
    return out


def engine_access_errors(graph: dict[str, set[str]]) -> list[str]:
    """Return one line per import of engine internals from a module that is no composer."""
    out = []
    for module, targets in sorted(graph.items()):
        if _package(module) not in LAYER or module.startswith("tests."):
            continue
        if any(module == c or (c.endswith(".") and module.startswith(c)) for c in COMPOSERS):
            continue
        out += [f"{module} -> {t}: reach the engine through engine.protocol"
                for t in sorted(targets)
                if (t == "engine" or t.startswith("engine."))
                and t not in ENGINE_INTERFACE | PROCESS_WIDE]
    return out


def probing_errors(source: str, where: str) -> list[str]:
    """Return one line per getattr/hasattr on something named like an engine."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and node.args):
            target = ast.unparse(node.args[0])
            if target.split(".")[-1].lower().endswith("engine"):
                out.append(f"{where}:{node.lineno}: {node.func.id}({target}, ...): "
                           "declare it in engine.protocol's Engine")
    return out


def test_imports_point_one_way() -> None:
    assert direction_errors(import_graph()) == []


def test_the_engine_is_reached_through_its_interface() -> None:
    assert engine_access_errors(import_graph()) == []


def test_engine_methods_are_called_as_the_protocol_declares_them() -> None:
    found = []
    for package in ("probes", "alerts", "storage", "monitor"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found += probing_errors(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []


def test_the_probing_check_sees_getattr_on_an_engine() -> None:
    source = ("read = getattr(engine, 'batch_snapshot', None)\n"
              "hasattr(self.engine, 'x')\ngetattr(report, 'results', ())\n")
    assert probing_errors(source, "m.py") == [
        "m.py:1: getattr(engine, ...): declare it in engine.protocol's Engine",
        "m.py:2: hasattr(self.engine, ...): declare it in engine.protocol's Engine"]


def test_no_runtime_package_imports_the_tests() -> None:
    graph = import_graph()
    assert [f"{m} -> {t}" for m, ts in sorted(graph.items()) if m.split(".")[0] in RUNTIME
            for t in sorted(ts) if t.split(".")[0] == "tests"] == []


@pytest.mark.parametrize(("graph", "found"), [
    ({"storage.a": {"alerts.b"}}, ["storage.a -> alerts.b: alerts is not below storage"]),
    ({"alerts.a": {"probes.b"}}, ["alerts.a -> probes.b: probes is not below alerts"]),
    ({"engine.a": {"storage.b", "vocab"}},
     ["engine.a -> storage.b: the engine imports no monitoring package"]),
    ({"tests.storage.builders": {"monitor.app"}},
     ["tests.storage.builders -> monitor.app: monitor is not below storage"]),
    ({"tests.storage.test_x": {"monitor.app"}, "monitor.a": {"alerts.b", "storage.c"}}, []),
])
def test_the_direction_check_sees_an_import_running_up(
        graph: dict[str, set[str]], found: list[str]) -> None:
    assert direction_errors(graph) == found


def test_the_engine_check_sees_internals_and_spares_composers() -> None:
    graph = {"probes.prober": {"engine.runtime", "engine.protocol"},
             "monitor.metrics": {"engine.admission", "engine.errors"},
             "monitor.cli.engine": {"engine.precompile"}, "probes.fake": {"engine.admission"}}
    assert engine_access_errors(graph) == [
        "monitor.metrics -> engine.admission: reach the engine through engine.protocol",
        "probes.prober -> engine.runtime: reach the engine through engine.protocol"]
