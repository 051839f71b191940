"""Reference outputs per cohort, and every probe cycle's outputs compared with them.

The reference output of a canary is what the engine generates on the reference path
(engine.protocol.REFERENCE: eager, direct, exact shape, float32 weights) in the cohort
(model_version, config_hash) that ran the cycle. The checker loads a cohort's stored
references once, generates the missing ones (the first cycle of a cohort, a new canary),
stores them through the Writer, and compares each output of the cycle with its reference
(probes.quality). A cohort change (another model or config) starts from its own stored
references, or generates them anew.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import partial

from sqlalchemy.orm import Session, sessionmaker

from engine.errors import EngineError, Overloaded
from engine.protocol import REFERENCE, Engine
from probes.cycle import CycleResult
from probes.quality import Compared, compare, golden_match, prompt_key, summarize
from probes.sink import add_cycle
from storage.db import reading
from storage.models import CanaryReference, OutputAgreement, ProbeRun
from storage.queries import quality as queries
from storage.queries.quality import AgreementGroup
from storage.writer import Writer
from vocab import Source

log = logging.getLogger(__name__)

Cohort = tuple[str, str]


class OutputChecker:
    """Keep each canary's reference output per cohort; compare cycle outputs with it.

    Example:
        checker = OutputChecker(engine, sessions=sessions, writer=writer)
        groups = checker.check(cycle_result, max_new_tokens=32)
    """

    def __init__(self, engine: Engine, *, sessions: sessionmaker[Session] | None = None,
                 writer: Writer | None = None, timeout_s: float = 120.0,
                 store_text: bool = False) -> None:
        self.engine = engine
        self.sessions = sessions
        self.writer = writer
        self.timeout_s = timeout_s
        self.store_text = store_text
        self._cohort: Cohort | None = None
        self._refs: dict[str, tuple[int, ...]] = {}
        self.generated = 0  # reference outputs generated (not loaded) since start

    def references(self, cohort: Cohort, prompts: Sequence[str], max_new_tokens: int | None,
                   *, suite: str = "") -> dict[str, tuple[int, ...]]:
        """Return prompt_key -> reference ids for `prompts`, generating the missing ones."""
        if cohort != self._cohort:
            self._cohort, self._refs = cohort, self._load(cohort)
        wanted = {prompt_key(p, max_new_tokens): p for p in prompts}
        new: list[CanaryReference] = []
        deadline = time.monotonic() + self.timeout_s
        for key, prompt in wanted.items():
            if key in self._refs:
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("reference outputs: out of time, %d left for a later cycle",
                            len(set(wanted) - set(self._refs)))
                break
            try:
                r = self.engine.generate(prompt, max_new_tokens=max_new_tokens, canary=True,
                                         override=REFERENCE, timeout_s=remaining)
            except Overloaded as exc:
                # Synthetic load is shed first by design: while real requests wait, the
                # rest would be shed too. Not a failure; a later cycle generates them.
                log.info("reference outputs: %d left for a later cycle (%s)",
                         len(set(wanted) - set(self._refs)), exc)
                break
            except EngineError as exc:  # retried on the next cycle
                log.warning("reference output not generated: %s", exc)
                continue
            self._refs[key] = tuple(r.output_ids)
            self.generated += 1
            new.append(CanaryReference(
                model_version=cohort[0], config_hash=cohort[1], prompt_key=key, suite=suite,
                bucket=r.bucket, output_ids=list(r.output_ids),
                text=r.text if self.store_text else None))
        if new and self.writer is not None:
            self.writer.submit(partial(add_references, rows=tuple(new)))
        return {k: self._refs[k] for k in wanted if k in self._refs}

    def _load(self, cohort: Cohort) -> dict[str, tuple[int, ...]]:
        if self.sessions is None:
            return {}
        try:
            with reading(self.sessions) as session:
                stored = queries.references(session, *cohort)
        except Exception:  # noqa: BLE001 - a down database means regenerating, not failing
            log.warning("reference outputs: stored ones unreadable, generating", exc_info=True)
            return {}
        return {k: tuple(v) for k, v in stored.items()}

    def check(self, cycle: CycleResult, *, max_new_tokens: int | None,
              expected: Mapping[str, str] | None = None) -> tuple[AgreementGroup, ...]:
        """Compare every output of `cycle` with its reference (and golden answer); return the groups.

        `expected`: prompt -> golden answer (CanarySuite.expected); an output is checked
        against it when it is compared with its reference.
        """
        golden = expected or {}
        if not cycle.outputs or not cycle.model_version:
            return ()
        info = self.engine.info
        cohort = (cycle.model_version, cycle.config_hash)
        if (info.model_version, info.config_hash) != cohort:
            return ()  # the engine changed under the cycle: its reference would be another's
        prompts = list(dict.fromkeys(p for p, _, _ in cycle.outputs))
        refs = self.references(cohort, prompts, max_new_tokens, suite=cycle.suite)
        compared = []
        for prompt, variant, r in cycle.outputs:
            key = prompt_key(prompt, max_new_tokens)
            if key in refs:
                compared.append(Compared(
                    key, r.bucket, r.path, r.decoding, variant, compare(r.output_ids, refs[key]),
                    golden_match(r.text, golden[prompt]) if prompt in golden else None))
        return summarize(compared)


def add_references(session: Session, rows: Sequence[CanaryReference]) -> None:
    """Add reference rows another instance has not stored yet (no commit)."""
    by_cohort: dict[Cohort, list[CanaryReference]] = {}
    for row in rows:
        by_cohort.setdefault((row.model_version, row.config_hash), []).append(row)
    for cohort, items in by_cohort.items():
        have = queries.stored_reference_keys(session, *cohort, [r.prompt_key for r in items])
        for row in items:
            if row.prompt_key not in have:
                have.add(row.prompt_key)
                session.add(CanaryReference(
                    model_version=row.model_version, config_hash=row.config_hash,
                    prompt_key=row.prompt_key, suite=row.suite, bucket=row.bucket,
                    output_ids=list(row.output_ids), text=row.text))


def agreement_row(g: AgreementGroup, *, at: datetime, source: str, instance_id: str,
                  model_version: str, config_hash: str,
                  run_id: int | None = None) -> OutputAgreement:
    """Return the OutputAgreement row of one group."""
    return OutputAgreement(
        run_id=run_id, at=at, source=source, instance_id=instance_id,
        model_version=model_version, config_hash=config_hash, bucket=g.bucket, path=g.path,
        decoding=g.decoding, variant=g.variant, count=g.count, exact=g.exact,
        agreement_sum=g.agreement_sum, length_diff_sum=g.length_diff_sum,
        first_divergence_min=g.first_divergence_min,
        golden_count=g.golden_count, golden_exact=g.golden_exact,
        worst=[{**w, "key": str(w["key"])[:16]} for w in g.worst])


def add_checked_cycle(session: Session, c: CycleResult,
                      groups: Sequence[AgreementGroup]) -> ProbeRun:
    """Add a cycle's rows and its output agreements to `session` (no commit)."""
    run = add_cycle(session, c)
    session.flush()  # run.id for the agreement rows
    for g in groups:
        session.add(agreement_row(g, at=c.started_at, source=Source.CANARY.value,
                                  instance_id=c.instance_id, model_version=c.model_version,
                                  config_hash=c.config_hash, run_id=run.id))
    return run
