"""The report's "Quality" section: outputs vs the reference path per optimization and bucket.

Rows come from `output_agreements` (storage.queries.quality) for the week; each A/B arm is
named after the optimization it measures: the `optimized` arm is what users got (every
optimization on), `float32` / `quantized` measure int8 weights, `eager` / `compiled`
torch.compile, `direct` / `speculative` speculative decoding, `exact` bucketing.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from monitor.report.data import QualityRow
from monitor.report.tables import Table
from storage.queries import quality as queries

OPTIMIZATION_OF_ARM = {
    "optimized": "served path", "float32": "int8 weights (off)", "quantized": "int8 weights",
    "eager": "torch.compile (off)", "compiled": "torch.compile", "direct": "speculation (off)",
    "speculative": "speculative decoding", "exact": "bucketing (off)",
    "compiled_step": "C decode step (off)", "native_step": "C decode step",
}


def collect_quality(session: Session, start: datetime, end: datetime) -> tuple[QualityRow, ...]:
    """Return the week's agreement per (source, bucket, arm)."""
    return tuple(QualityRow(r.source, r.bucket, r.variant, r.count, r.exact, r.agreement,
                            r.first_divergence_min, r.worst, r.golden_count, r.golden_exact)
                 for r in queries.agreement_rollups(session, start, end))


def _bucket_order(label: str) -> tuple[int, str]:
    return (int(label), "") if label.isdigit() else (1 << 30, label)


def quality_table(rows: tuple[QualityRow, ...]) -> Table:
    """Return the Quality table: worst agreement first within each optimization."""
    ordered = sorted(rows, key=lambda r: (OPTIMIZATION_OF_ARM.get(r.arm, r.arm), r.source,
                                          _bucket_order(r.bucket)))
    out = []
    for r in ordered:
        worst = "; ".join(
            f"{w.get('key', '?')[:8]} {w.get('agreement', 0.0):.2f} "
            f"@{w.get('first_divergence')}" for w in r.worst) or "-"
        out.append((OPTIMIZATION_OF_ARM.get(r.arm, r.arm), r.arm, r.source, r.bucket,
                    str(r.compared), f"{r.exact / r.compared:.1%}" if r.compared else "-",
                    f"{r.agreement:.4f}" if r.agreement is not None else "-",
                    str(r.first_divergence) if r.first_divergence is not None else "-", worst,
                    f"{r.golden_exact}/{r.golden_compared} ({r.golden_exact / r.golden_compared:.1%})"
                    if r.golden_compared else "-"))
    return Table(("Optimization", "Arm", "Source", "Bucket", "Compared", "Exact",
                  "Agreement", "First divergence", "Worst canaries (key agreement @position)",
                  "Golden answers matched"),
                 tuple(out), "No outputs were compared with reference outputs this week.")
