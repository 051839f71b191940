"""Matplotlib figures of a week as PNG bytes (Agg canvas, no pyplot global state)."""

from __future__ import annotations

import io
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta

from monitor.report.data import WeekData
from monitor.report.metrics import _bucket_key

DPI = 96
SIZE = (8.0, 3.4)


@dataclass(frozen=True)
class Plot:
    """One rendered figure."""

    key: str
    title: str
    png: bytes


def render_plots(data: WeekData, acceptance_threshold: float | None = None) -> tuple[Plot, ...]:
    """Return every plot the week has data for."""
    out = []
    for key, title, draw in (
        ("p99", "p99 latency per bucket vs baseline", _p99),
        ("acceptance", "Speculative acceptance per bucket", _acceptance),
        ("memory", "Memory", _memory),
        ("recompiles", "Recompiles per hour", _recompiles),
        ("shapes", "Real input lengths vs bucket edges", _shapes),
    ):
        png = draw(data, acceptance_threshold)
        if png is not None:
            out.append(Plot(key, title, png))
    return tuple(out)


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _days(data: WeekData) -> list[str]:
    return [(data.week.start + timedelta(days=i)).strftime("%a %d") for i in range(7)]


def _p99(data: WeekData, _t: float | None) -> bytes | None:
    if not data.p99:
        return None
    fig, ax = _figure()
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for row in data.p99:
        series[row.bucket][row.day] = row.p99_s * 1000
    for i, (bucket, pts) in enumerate(sorted(series.items(), key=lambda kv: _bucket_key(kv[0]))):
        color = f"C{i % 10}"
        days = sorted(pts)
        ax.plot(days, [pts[d] for d in days], marker="o", color=color, label=f"bucket {bucket}")
        base = data.baseline_p99.get(bucket)
        if base:
            ax.axhline(base * 1000, color=color, linestyle="--", linewidth=1)
    ax.set_xticks(range(7), _days(data))
    ax.set_ylabel("p99 ms (dashed: baseline)")
    ax.legend(fontsize="small", ncols=3)
    return _png(fig)


def _acceptance(data: WeekData, threshold: float | None) -> bytes | None:
    if not data.acceptance:
        return None
    fig, ax = _figure()
    sums: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for row in data.acceptance:
        sums[row.bucket][row.day][0] += row.accepted
        sums[row.bucket][row.day][1] += row.proposed
    for bucket, days in sorted(sums.items(), key=lambda kv: _bucket_key(kv[0])):
        xs = sorted(d for d in days if days[d][1])
        ax.plot(xs, [days[d][0] / days[d][1] for d in xs], marker="o", label=f"bucket {bucket}")
    if threshold is not None:
        ax.axhline(threshold, color="red", linestyle="--", linewidth=1, label="threshold")
    ax.set_xticks(range(7), _days(data))
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accepted / proposed")
    ax.legend(fontsize="small", ncols=3)
    return _png(fig)


def _memory(data: WeekData, _t: float | None) -> bytes | None:
    if not data.memory:
        return None
    fig, ax = _figure()
    by_instance: dict[str, list] = defaultdict(list)
    for m in data.memory:
        by_instance[m.instance].append(m)
    for i, (instance, points) in enumerate(sorted(by_instance.items())):
        xs = [(m.at - data.week.start).total_seconds() / 86400 for m in points]
        name = f" {instance}" if len(by_instance) > 1 else ""
        ax.plot(xs, [m.rss_bytes / 2**20 for m in points], color=f"C{(2 * i) % 10}",
                label=f"RSS{name}")
        ax.plot(xs, [m.kv_cache_bytes / 2**20 for m in points], color=f"C{(2 * i + 1) % 10}",
                label=f"KV cache{name}")
    budget = data.kv_budget_bytes
    if budget:
        ax.axhline(budget / 2**20, color="red", linestyle="--", linewidth=1, label="KV budget")
    ax.set_xlim(0, 7)
    ax.set_xticks(range(7), _days(data))
    ax.set_ylabel("MiB")
    ax.legend(fontsize="small")
    return _png(fig)


def _recompiles(data: WeekData, _t: float | None) -> bytes | None:
    if not data.recompiles:
        return None
    fig, ax = _figure()
    xs = [(h.hour - data.week.start).total_seconds() / 86400 for h in data.recompiles]
    # An hour is 1/168 of the axis: markers keep isolated hours visible.
    ax.bar(xs, [h.recompiles for h in data.recompiles], width=1 / 24, align="edge",
           color="C7")
    ax.plot(xs, [h.recompiles for h in data.recompiles], "o", color="C7", label="all")
    late = [(x, h.after_warmup) for x, h in zip(xs, data.recompiles, strict=True)
            if h.after_warmup]
    if late:
        ax.plot([x for x, _ in late], [n for _, n in late], "o", color="C3",
                label="after warm-up")
    ax.set_ylim(bottom=0)
    ax.set_xlim(0, 7)
    ax.set_xticks(range(7), _days(data))
    ax.set_ylabel("recompiles / hour")
    ax.legend(fontsize="small")
    return _png(fig)


def _shapes(data: WeekData, _t: float | None) -> bytes | None:
    bins = [b for b in data.lengths if b.count]
    if not bins:
        return None
    fig, ax = _figure()
    ax.bar([b.lo for b in bins], [b.count for b in bins],
           width=[max(1, b.hi - b.lo + 1) for b in bins], align="edge", color="C0",
           label="real inputs")
    for i, edge in enumerate(data.buckets):
        ax.axvline(edge + 1, color="black", linestyle="--", linewidth=1,
                   label="bucket edges" if i == 0 else None)
    ax.set_xlabel("input tokens")
    ax.set_ylabel("requests")
    ax.legend(fontsize="small")
    return _png(fig)
