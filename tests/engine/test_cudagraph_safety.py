"""CUDA-graph safety, checked on CPU where it can be seen: a compiled call never receives
another compiled call's output uncopied, compiled calls run only on the owner thread, and
the warm-up records on the caches and spans requests use (none recorded after it)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from engine import compat
from engine.protocol import CUDAGRAPH_NONE, PATH_COMPILED, FlagOverride
from engine.runtime import Runtime
from tests.engine.conftest import random_texts, tiny_config

SPECULATE = FlagOverride(speculative=True)
DIRECT = FlagOverride(speculative=False)


@pytest.fixture(autouse=True)
def fresh_counters():
    """Leave dynamo's counters as the next test expects them (per process)."""
    yield
    from torch._dynamo.utils import counters

    counters.clear()


def _runtime(tiny_dirs, **changes: object) -> Runtime:
    # A cheap backend: what is checked is the engine's hand-offs, not the compiler.
    base: dict[str, object] = dict(compile_backend="eager", compile_mode="reduce-overhead",
                                   native_step=False)
    base.update(changes)
    return Runtime(tiny_config(tiny_dirs, **base))


def test_no_compiled_output_feeds_a_compiled_call_uncopied(tiny_dirs):
    rt = _runtime(tiny_dirs)
    rt.ledger.check_aliases = True  # holds each call's outputs: their storage stays theirs
    try:
        rt.warm_up(background=False)
        for i, text in enumerate(random_texts(12, seed=3, overflow=False)):
            r = rt.generate(text, max_new_tokens=24, override=SPECULATE if i % 2 else None)
            assert r.path == PATH_COMPILED
        snap = rt.graph_snapshot()
        assert snap.replayed > 100  # the seam saw the decode steps and verifications
        assert snap.aliased_inputs == 0
        # The check itself: an output fed back without a copy is caught.
        fns, m = rt.target.compiled(16), rt.target.m
        enc = rt.target._encode_example(16, mark=False)
        cross = fns.encode(*enc)
        kv = rt.rows.caches[0]["target"]
        out = fns.step(m, rt.target.start, rt.target.positions[0], kv, cross.clone(), enc[2],
                       rt.target.bias_for(1), 1)
        fns.step(m, out[-1:].view(1, 1), rt.target.positions[1], kv, cross, enc[2],
                 rt.target.bias_for(2), 1)
        assert rt.graph_snapshot().aliased_inputs == 2  # the token and the encoder output
    finally:
        rt.close()


@pytest.mark.parametrize("max_batch", [1, 4])
def test_compiled_calls_run_only_on_the_owner_thread(tiny_dirs, max_batch):
    rt = _runtime(tiny_dirs, max_batch=max_batch, max_concurrency=2)
    try:
        rt.warm_up(background=True)  # its compiled calls too run on the owner
        texts = random_texts(8, seed=5, overflow=False)
        errors: list[BaseException] = []

        def client(offset: int) -> None:
            try:
                for i, text in enumerate(texts[offset::4]):
                    rt.generate(text, max_new_tokens=12,
                                override=SPECULATE if (offset + i) % 2 else None)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        rt.warm_up(background=False)  # waits for the warm-up
        assert errors == []
        for text in texts:
            assert rt.generate(text, max_new_tokens=12).path == PATH_COMPILED
        snap = rt.graph_snapshot()
        assert snap.replayed > 0 and snap.off_owner_calls == 0
        # The check itself: a compiled call from this thread is counted.
        fns = rt.target.compiled(8)
        fns.encode(*rt.target._encode_example(8, mark=False))
        assert rt.graph_snapshot().off_owner_calls == 1
    finally:
        rt.close()


@pytest.mark.parametrize("older_torch", [False, True], ids=["pinned", "features_off"])
def test_warm_up_records_what_200_requests_use(tiny_dirs, older_torch):
    """200 requests over every bucket, direct and speculative, up to the cache's last span:
    no new signature (a CUDA graph recording) and no recompile after the warm-up."""
    features = compat.FEATURES if older_torch else ()
    with compat.forced_off(*features):
        rt = _runtime(tiny_dirs, max_concurrency=2)
        try:
            rt.warm_up(background=False)
            status = rt.warmup_status()
            assert status.error is None and status.eager_buckets == ()
            assert status.bucket_graphs == {
                str(e): "no CUDA graphs: cpu device" for e in rt.config.buckets}
            before, compiled = rt.graph_snapshot(), rt.compile_snapshot()
            assert before.recorded > 0 and before.recorded_after_warmup == 0
            texts = random_texts(200, seed=11, overflow=False)
            for i, text in enumerate(texts):
                r = rt.generate(text, max_new_tokens=[4, 16, rt.config.max_new_tokens_cap][i % 3],
                                override=SPECULATE if i % 2 else None)
                assert r.path == PATH_COMPILED and r.cudagraph == CUDAGRAPH_NONE
            after = rt.graph_snapshot()
            assert after.recorded_after_warmup == 0
            assert after.signatures == before.signatures
            assert after.replayed > before.replayed + 200
            assert rt.compile_snapshot().diff(compiled).recompiles == 0
        finally:
            rt.close()


def test_a_bucket_that_falls_back_to_eager_is_an_error_and_a_metric(tiny_dirs, caplog,
                                                                    monkeypatch):
    from prometheus_client import CollectorRegistry

    from monitor.metrics import EngineCollector, Metrics

    rt = _runtime(tiny_dirs)
    real = type(rt.target).warm

    def warm(runner, edge, **kwargs):
        if edge == 16:
            raise RuntimeError("no graph for you")
        return real(runner, edge, **kwargs)

    monkeypatch.setattr(type(rt.target), "warm", warm)
    try:
        with caplog.at_level(logging.ERROR, logger="engine.warmup"):
            rt.warm_up(background=False)
        assert any("bucket 16 serves eager" in r.getMessage() for r in caplog.records)
        status = rt.warmup_status()
        assert status.eager_buckets == ("16",)
        assert status.bucket_graphs["16"] == "eager: RuntimeError: no graph for you"
        assert status.error == "bucket 16: RuntimeError: no graph for you"
        text = next(t for t in random_texts(9, seed=2, overflow=False)
                    if rt.bucket_for(rt.count_tokens(t)) == "16")
        assert rt.generate(text, max_new_tokens=4).path == "eager"
        registry = CollectorRegistry()
        EngineCollector(Metrics(registry), lambda: rt)
        assert registry.get_sample_value("tailwatch_engine_eager_buckets") == 1
        assert registry.get_sample_value("tailwatch_engine_cudagraph_replays_total") == 0
        assert registry.get_sample_value("tailwatch_engine_cudagraph_recordings_total",
                                         {"phase": "serving"}) == 0
    finally:
        rt.close()


def test_warm_up_leaves_a_rows_cache_as_it_found_it(tiny_dirs):
    """The warm-up writes every span of each row's cache: a request decoding in that row
    meanwhile (eager, its bucket not warm yet) must find its keys and values unchanged."""
    rt = _runtime(tiny_dirs)
    try:
        cache = rt.rows.caches[0]["target"]
        with torch.no_grad():
            cache.normal_()
        kept = cache.clone()
        rt.warm_up(background=False)
        assert torch.equal(cache, kept)
    finally:
        rt.close()


def _has_tree_state() -> bool:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch._inductor import cudagraph_trees as trees

    return (hasattr(trees.local, "tree_manager_containers")
            or torch._C._is_key_in_tls("tree_manager_containers"))


def _on_fresh_thread(fn):
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


@pytest.mark.parametrize("max_batch", [1, 4])
def test_the_owner_thread_holds_cudagraph_trees_state(tiny_dirs, max_batch, monkeypatch):
    """A plain thread has no cudagraph-trees state (its first recording would fail on a
    bare assert in torch, every bucket serving eager); the owner thread is given its own."""
    import engine.runtime

    _has_tree_state()  # inductor imported here, as the engine's compile does it first
    assert _on_fresh_thread(_has_tree_state) is False
    # As on CUDA: the runtime records CUDA graphs (here nothing is recorded on the CPU).
    monkeypatch.setattr(engine.runtime, "cudagraphs_off", lambda config, device: None)
    rt = _runtime(tiny_dirs, max_batch=max_batch)
    try:
        assert rt._on_owner(_has_tree_state) is True
    finally:
        rt.close()


@pytest.mark.parametrize("initialize", [True, False], ids=["torch_helper", "older_torch"])
def test_prepare_owner_thread_sets_up_what_a_recording_reads(monkeypatch, initialize):
    from engine.graphs import prepare_owner_thread

    _has_tree_state()  # imports inductor's module quietly
    from torch._inductor import cudagraph_trees as trees

    if not initialize:  # a torch without the helper: the engine's own steps
        monkeypatch.delattr(trees, "_initialize_tls", raising=False)

    def prepared() -> tuple[object, object]:
        prepare_owner_thread()
        prepare_owner_thread()  # a second call keeps the first's state
        containers = trees.get_obj(trees.local, "tree_manager_containers")
        locks = trees.get_obj(trees.local, "tree_manager_locks")
        return containers, locks[0]

    containers, lock = _on_fresh_thread(prepared)
    assert containers == {} and hasattr(lock, "acquire")


def test_a_bare_assert_in_the_warm_up_says_where_it_was_raised(tiny_dirs, caplog, monkeypatch):
    """An error with no message (torch's bare asserts) names its file and line, and the log
    carries the traceback."""
    rt = _runtime(tiny_dirs)
    real = type(rt.target).warm

    def warm(runner, edge, **kwargs):
        if edge == 16:
            raise AssertionError  # as a bare `assert` outside pytest's rewriting raises
        return real(runner, edge, **kwargs)

    monkeypatch.setattr(type(rt.target), "warm", warm)
    try:
        with caplog.at_level(logging.ERROR, logger="engine.warmup"):
            rt.warm_up(background=False)
        graphs = rt.warmup_status().bucket_graphs["16"]
        assert graphs.startswith("eager: AssertionError: (raised at test_cudagraph_safety.py:")
        assert graphs.endswith(" in warm)")
        record = next(r for r in caplog.records if "bucket 16 serves eager" in r.getMessage())
        assert record.exc_info is not None and record.exc_info[0] is AssertionError
    finally:
        rt.close()


@pytest.mark.parametrize("max_batch", [1, 4])
def test_no_output_is_read_after_the_next_compiled_call(tiny_dirs, max_batch):
    """Each compiled call starts a new generation of the trees on CUDA, so an output read
    once the next call has run would read a replay's writes: with the check on, the held
    outputs are overwritten at every call, and the tokens still equal the eager engine's
    (batched: rows of one bucket, so direct steps run several rows)."""
    eager = Runtime(tiny_config(tiny_dirs, compile_mode="off"))
    rt = _runtime(tiny_dirs, max_batch=max_batch, max_concurrency=max_batch)
    rt.ledger.check_aliases = True
    try:
        rt.warm_up(background=False)
        texts = [t for t in random_texts(60, seed=9, overflow=False)
                 if rt.bucket_for(rt.count_tokens(t)) == "16"][:8]
        want = {t: eager.generate(t, max_new_tokens=16).output_ids for t in texts}
        got: dict[str, tuple[int, ...]] = {}
        widest = [1]
        lock = threading.Lock()
        start = threading.Barrier(max_batch)

        def client(offset: int) -> None:
            start.wait()
            for i, text in enumerate(texts[offset::max_batch]):
                r = rt.generate(text, max_new_tokens=16,
                                override=SPECULATE if (offset + i) % 4 == 3 else DIRECT)
                with lock:
                    got[text] = r.output_ids if r.path == PATH_COMPILED else r.path
                    widest[0] = max(widest[0], r.batch_size_max or 1)

        clients = [threading.Thread(target=client, args=(i,)) for i in range(max_batch)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        assert len(texts) == 8 and got == want
        assert widest[0] == (1 if max_batch == 1 else widest[0]) and (
            max_batch == 1 or widest[0] > 1)
        # The check itself: a step's output read after the next step was overwritten.
        fns, m = rt.target.compiled(16), rt.target.m
        enc = rt.target._encode_example(16, mark=False)
        cross = fns.encode(*enc).clone()
        kv = rt.rows.caches[0]["target"]
        first = fns.step(m, rt.target.start, rt.target.positions[0], kv, cross, enc[2],
                         rt.target.bias_for(1), 1)
        kept = first.clone()
        fns.step(m, kept[-1:].view(1, 1).clone(), rt.target.positions[1], kv, cross, enc[2],
                 rt.target.bias_for(2), 1)
        assert not torch.equal(first, kept)
    finally:
        rt.close()
        eager.close()


def test_a_cuda_graph_ledger_starts_a_generation_at_every_call():
    import warnings

    from engine.graphs import GraphLedger

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch._inductor import cudagraph_trees as trees

    ledger = GraphLedger(cudagraphs=True)
    fn = ledger.wrap(lambda x: x + 1, "f")
    before = trees.MarkStepBox.mark_step_counter
    fn(torch.ones(1))
    fn(torch.ones(1))
    assert trees.MarkStepBox.mark_step_counter == before - 2
    plain = GraphLedger(cudagraphs=False).wrap(lambda x: x + 1, "f")
    plain(torch.ones(1))
    assert trees.MarkStepBox.mark_step_counter == before - 2


def test_the_ledger_counts_as_cudagraph_trees_do():
    """A compiled function's first call is the trees' warm-up run (nothing recorded); the
    next records; a static input at another address (another row's cache) records again."""
    from engine.graphs import GraphLedger

    ledger = GraphLedger(cudagraphs=False, tree_warmup=True)
    fn = ledger.wrap(lambda x, kv: x + 1, "step")
    rows = [torch.zeros(4), torch.zeros(4)]
    for kv in rows:
        torch._dynamo.mark_static_address(kv)
    x = torch.ones(1)
    fn(x, rows[0])
    assert ledger.snapshot().recorded == 0
    fn(x, rows[0])
    fn(x, rows[1])
    fn(x, rows[1])
    snap = ledger.snapshot()
    assert (snap.recorded, snap.replayed) == (2, 1)
    plain = GraphLedger(cudagraphs=False)  # default mode: the first call is the graph's
    plain.wrap(lambda x: x + 1, "step")(x)
    assert plain.snapshot().recorded == 1
