"""The seven scripted steps (`STEPS`, in order): act through the API, check with timeouts."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from monitor.demo.context import StepContext, epoch, firing, order
from monitor.demo.profile import AB_CYCLE_TIMEOUT_S, OPERATOR, DemoProfile
from monitor.demo.traffic import Lane, bucket_lanes, median_latency

# A shifted request in the fallback bucket must be at least this much faster once it
# decodes directly: rejected drafts make speculation slower there, and the demo's own
# load narrows the gap, so the bar is modest.
RECOVERY_RATIO = 0.9
RECOVERY_SAMPLES = 10  # requests compared on each side of the flip
# Prompt pairs per bucket and arm: the fewest that storage.queries.speedups gives a 95% CI.
AB_PAIRS = 6
# A forced A/B cycle's request blocks for the whole cycle (up to the demo's cycle timeout)
# and then for the store: the client waits that long and a minute more.
AB_CLIENT_TIMEOUT_S = AB_CYCLE_TIMEOUT_S + 60.0
# What the report says where no A/B prompt pair was measured (monitor.report.tables).
NOTHING_MEASURED = "nothing measured"
SPEEDUP_SECTION = "Expected vs measured speedup"


def warm_up_and_baseline(ctx: StepContext) -> None:
    """Wait for a warm engine, start in-domain traffic, wait for canary baselines per bucket."""
    p = ctx.profile

    def ready() -> tuple[bool, str]:
        code, body = ctx.api.readyz()
        return code == 200, f"{body.get('status')}: {body.get('engine')}"

    # Bucket by bucket: only a warm-up that stopped making progress fails.
    ctx.wait_progress("engine ready", "GET /readyz 200 (every bucket compiled)", ready,
                      p.warmup_timeout_s)
    ctx.traffic.set_lanes(bucket_lanes(p.buckets, "in_domain"))
    ctx.traffic.start()
    ctx.event(f"real traffic: in-domain requests in every bucket, {p.traffic_rate_per_s:g}/s")
    window = f"{p.window_s:g}s"

    def canary_baselines() -> tuple[bool, str]:
        rows = [b for b in ctx.api.baselines("p50_latency")
                if b["scope"].get("window") == window and b["kind"] == "rolling"]
        have = {b["scope"].get("bucket"): b for b in rows}
        done = [lb for lb in ctx.labels()
                if lb in have and have[lb]["samples"] >= p.min_baseline_cycles]
        cycles = ", ".join(f"{lb}:{have[lb]['samples'] if lb in have else 0}"
                           for lb in ctx.labels())
        return len(done) == len(ctx.labels()), f"cycles per bucket {cycles}"

    seen = ctx.wait_cycles("canary p50 baselines",
                           f">= {p.min_baseline_cycles} canary cycles in every bucket",
                           canary_baselines, p.baseline_cycles, p.baseline_timeout_s)
    ctx.event(f"canary p50 baselines ready ({seen})")
    ctx.headline = f"engine warm; canary p50 baselines in {len(ctx.labels())} buckets"


def traffic_shift(ctx: StepContext) -> None:
    """Shift one bucket's traffic: check alert, webhook, speculation off there only, latency."""
    shifted, started = _shift_one_bucket(ctx)
    alert = _acceptance_alert(ctx, shifted, started)
    _speculation_off(ctx, alert)
    _latency_recovers(ctx, shifted, started)
    shift = str(ctx.profile.shift_bucket)
    pre_s, post_s, _, _ = ctx.memo["latency"]
    ctx.headline = (f"acceptance_drop fired for bucket {shift} only; webhook received; "
                    f"speculation off there (auto, alert {alert['id']}); latency "
                    f"{pre_s:.2f}s -> {post_s:.2f}s")


def _shift_one_bucket(ctx: StepContext) -> tuple[Lane, float]:
    """Wait for the bucket's acceptance baseline, then shift its traffic; return lane, start."""
    p = ctx.profile
    shift = str(p.shift_bucket)

    def acceptance_baseline() -> tuple[bool, str]:
        rows = {b["scope"].get("bucket"): b["value"] for b in ctx.api.baselines("acceptance_rate")
                if b["scope"].get("source") == "traffic"}
        text = ", ".join(f"{k}:{v:.2f}" for k, v in sorted(rows.items())) or "none yet"
        return shift in rows, f"acceptance baselines {text}"

    # Traffic is stored in minute rollups and baselines skip the warm-in: the first
    # usable cycle is the first whole minute of traffic after the first canary cycle.
    seen = ctx.wait_for("traffic acceptance baseline",
                        f"a whole minute of in-domain traffic measured in bucket {shift}",
                        acceptance_baseline, 150.0)
    ctx.event(seen)
    lanes = [ln for ln in bucket_lanes(p.buckets, "in_domain") if ln.name != f"in_domain/{shift}"]
    low = max((b for b in p.buckets if b < p.shift_bucket), default=8)
    shifted = Lane(f"shifted/{shift}", "shifted", low, p.shift_bucket - 1,
                   weight=max(1.0, len(lanes)))
    # Earlier steps may have legitimately lowered another bucket's acceptance (the faulty
    # int8 build's target rejects drafts): what this step claims is only what the shift adds.
    ctx.memo["acceptance_before"] = {a["labels"].get("bucket")
                                     for a in ctx.api.alerts("open")
                                     if a["rule"] == "acceptance_drop"}
    ctx.memo["speculation_off_before"] = {
        b for b, v in ctx.api.flags()["effective"]["speculative"].items() if v is False}
    # Shift at a minute's start, so every minute rollup is all in-domain or all shifted.
    # A minute that is half of each reads just inside the alert's threshold: it is then
    # no breach, and its mixed value joins the young acceptance baseline, whose spread
    # then slows the CUSUM to several minutes (seen on a loaded CI host).
    wait_s = until_next_minute(time.time())
    ctx.event(f"shifting at the next minute's start ({wait_s:.0f} s): whole minute rollups")
    time.sleep(wait_s)
    started = time.time()
    ctx.traffic.set_lanes([*lanes, shifted])
    ctx.event(f"bucket {shift}: traffic is now shifted-domain text; other buckets unchanged")
    return shifted, started


MINUTE_S = 60.0  # traffic rollups are per wall-clock minute (storage.rollups.RollupKey)
MINUTE_MARGIN_S = 0.2


def until_next_minute(now: float) -> float:
    """Return the seconds from epoch time `now` to just past the next minute's start."""
    return MINUTE_S - now % MINUTE_S + MINUTE_MARGIN_S


def _acceptance_alert(ctx: StepContext, shifted: Lane, started: float) -> dict[str, Any]:
    """Wait for acceptance_drop in the shifted bucket only and its webhook; return the alert."""
    p = ctx.profile
    shift = str(p.shift_bucket)
    began = time.monotonic()
    pending_since: list[float] = []  # when this bucket's alert was first seen pending

    def alert() -> tuple[bool, str]:
        open_ = [a for a in ctx.api.alerts("open") if a["rule"] == "acceptance_drop"]
        if not pending_since and any(a["labels"].get("bucket") == shift
                                     and a["state"] == "pending" for a in open_):
            pending_since.append(time.monotonic())
        recent = [s.acceptance_rate for s in ctx.traffic.samples(since=started, lane=shifted.name)
                  if s.acceptance_rate is not None][-20:]
        acc = f"{sum(recent) / len(recent):.2f}" if recent else "n/a"
        states = ", ".join(f"{a['labels'].get('bucket')}:{a['state']}" for a in open_) or "none"
        mine = [a for a in open_ if a["labels"].get("bucket") == shift and a["state"] == "firing"]
        if mine:
            ctx.memo["acceptance_alert"] = mine[0]
        # Why a pending alert is not confirmed yet, as the worker last judged it: a wait
        # that runs out then says whether the evaluations stopped or the rule held back.
        held = [f"; pending since {a['started_at']}, last judged {a['updated_at']}: "
                f"{a['annotations'].get('description', '')}" for a in open_
                if a["labels"].get("bucket") == shift and a["state"] == "pending"]
        return bool(mine), (f"bucket {shift} acceptance {acc} on shifted traffic; "
                            f"acceptance_drop alerts {states} (traffic rules use minute cycles)"
                            + "".join(held)[:600])

    def left() -> float:
        deadline = began + p.shift_timeout_s
        if pending_since:  # counting its `for` cycles: a late evaluation is no stuck rule
            deadline = max(deadline, pending_since[0] + p.shift_pending_s)
        return deadline - time.monotonic()

    ctx.wait_until("acceptance_drop fires", f"acceptance_drop firing for bucket={shift}",
                   alert, left)
    a: dict[str, Any] = ctx.memo["acceptance_alert"]
    ctx.event(f"alert acceptance_drop bucket={shift} fired: {a['annotations'].get('summary', '')}"
              [:160])
    before = ctx.memo["acceptance_before"]
    others = [x["labels"].get("bucket") for x in firing(ctx, "acceptance_drop")
              if x["labels"].get("bucket") not in {shift, *before}]
    ctx.expect("only that bucket alerted", "no new acceptance_drop in other buckets",
               not others, f"other buckets firing: {others or 'none'}"
               + (f" (already open before the shift: {sorted(before)})" if before else ""))

    def webhook() -> tuple[bool, str]:
        got = [x for _, x in ctx.receiver.alerts("acceptance_drop", "firing")
               if x["labels"].get("bucket") == shift]
        return bool(got), f"{len(ctx.receiver.deliveries())} POSTs at the receiver"

    ctx.wait_for("webhook delivered", f"an Alertmanager-format firing alert for bucket {shift}",
                 webhook, 20.0)
    ctx.event("webhook receiver got the firing acceptance_drop notification")
    return a


def _speculation_off(ctx: StepContext, a: dict[str, Any]) -> None:
    """Wait for the policy to turn speculation off in the shifted bucket only, by alert `a`."""
    shift = str(ctx.profile.shift_bucket)

    def flag() -> tuple[bool, str]:
        body = ctx.api.flags()
        rows = [r for r in body["flags"] if r["name"] == "speculative" and r["scope"] == shift
                and r["source"] == "auto" and r["value"] is False]
        off = sorted(b for b, v in body["effective"]["speculative"].items() if v is False
                     and b not in ctx.memo["speculation_off_before"])
        if rows:
            ctx.memo["spec_flag"] = rows[0]
        ok = bool(rows) and rows[0]["alert_id"] == a["id"] and off == [shift]
        return ok, (f"speculative newly off in buckets {off or 'none'}; auto row alert_id "
                    f"{rows[0]['alert_id'] if rows else '-'}")

    ctx.wait_for("speculation off in that bucket only",
                 f"GET /v1/flags: speculative[{shift}]=false, source auto, alert {a['id']}; "
                 "no other bucket newly off", flag, 20.0)
    ctx.event(f"flag speculative[{shift}] = false (source auto, alert {a['id']})")


def _latency_recovers(ctx: StepContext, shifted: Lane, started: float) -> None:
    """Wait until the shifted bucket's direct latency is below its speculative latency."""
    shift = str(ctx.profile.shift_bucket)
    flipped = epoch(ctx.memo["spec_flag"]["updated_at"]) + 1.5  # flag cache TTL + margin
    before = [s for s in ctx.traffic.samples(since=started, lane=shifted.name)
              if s.at < flipped and s.decoding == "speculative"]
    pre = median_latency(before[-RECOVERY_SAMPLES:])

    def recovered() -> tuple[bool, str]:
        after = [s for s in ctx.traffic.samples(since=flipped, lane=shifted.name)
                 if s.status == 200]
        direct = [s for s in after if s.decoding == "direct"]
        post = median_latency(direct[-RECOVERY_SAMPLES:])
        if pre is None or post is None or len(direct) < RECOVERY_SAMPLES:
            return False, f"{len(direct)} direct requests since the flip"
        ctx.memo["latency"] = (pre, post, len(direct), len(after))
        return post < RECOVERY_RATIO * pre, (
            f"median {pre:.3f}s speculative -> {post:.3f}s direct ({post / pre - 1:+.0%}); "
            f"{len(direct)}/{len(after)} requests direct (the rest: probation)")

    seen = ctx.wait_for("latency recovers", f"median latency in bucket {shift} below "
                        f"{RECOVERY_RATIO:.0%} of the speculative one", recovered, 60.0)
    ctx.event(f"bucket {shift} latency recovered: {seen}")
    ctx.say.say(f"[dim]note: bucket {shift}'s in-domain canaries decode directly now too, so "
                "their p99 may rise: the price of the fallback (the shipped policy's `revert` "
                "would undo the change on a p99 regression; the demo turns revert off)[/dim]")


# The demo rule fires at +200%: the injected delay is at least this many times the
# slowest bucket's canary p50 baseline, so a loaded machine, whose baselines are higher,
# still sees a change past the band.
DELAY_PER_BASELINE = 3.0
# A probe cycle's result rows are stamped when it finished (probes.sink.add_cycle), so
# they count in the rule cycle running then; the evaluator judges the newest finished rule
# cycle, and one without rows is no_data (nothing changes: alerts.rules.RuleResult). A
# slowed probe cycle no longer than a rule cycle finishes in every rule cycle, so each one
# is judged; one up to two rule cycles long leaves some rule cycles empty, so the alert
# needs more wall time to fire and resolve; past that, too few rule cycles hold a slowed
# probe cycle for the step to wait on (the check in regression_delay fails).
FIT_CYCLES = 1.0
MAX_CYCLES = 2.0


def regression_delay(ctx: StepContext) -> float:
    """Return the delay to inject: past the band over the slowest baseline, fitting a rule cycle.

    The profile's delay where the slowed probe cycle fits in a rule cycle, less where it
    would not (never less than the band needs). Where even the band's delay stretches the
    probe cycle past one rule cycle the step says so and goes on; past two, a check fails
    (naming the numbers): the rule could never see a slowed cycle.
    """
    p = ctx.profile
    window = f"{p.window_s:g}s"
    values = [b["value"] for b in ctx.api.baselines("p50_latency")
              if b["scope"].get("window") == window and b["scope"].get("bucket") in ctx.labels()]
    band = max((DELAY_PER_BASELINE * v for v in values), default=0.0)
    want = max(p.delay_s, band)
    took = ctx.cycle_seconds()
    if took is None:
        return want
    calls = (len(p.buckets) + 1) * p.canaries_per_bucket  # and one bucket past the largest
    slowed = took + calls * band
    ctx.expect("slowed probe cycle can be judged",
               f"{took:.1f}s probe cycle + {calls} x {band:.2f}s (3x the slowest p50 baseline) "
               f"<= {MAX_CYCLES:g} x the {window} rule cycle", slowed <= MAX_CYCLES * p.window_s,
               f"{slowed:.1f}s" + (
                   "" if slowed <= MAX_CYCLES * p.window_s else
                   f": this machine is too slow for the {p.name} profile's rule cycle"))
    room = (FIT_CYCLES * p.window_s - took) / calls
    delay = max(band, min(want, room))
    ctx.event(f"probe cycles take {took:.1f}s; slowed by {calls} x {delay:.2f}s: "
              f"~{took + calls * delay:.1f}s against the {window} rule cycle")
    if slowed > FIT_CYCLES * p.window_s:
        ctx.event(f"note: the slowed probe cycle (~{slowed:.1f}s) outlasts the {window} rule "
                  "cycle: only those that start early in a rule cycle are judged (slower)")
    return delay


def latency_regression(ctx: StepContext) -> None:
    """Slow every call: check the latency alert fires in every bucket, then resolves."""
    p = ctx.profile
    engine = ctx.engine()
    ctx.expect("fault-injection seam", "the demo engine wrapper", engine is not None,
               "engine wrapper in place" if engine is not None else "no engine built")
    assert engine is not None
    delay_s = regression_delay(ctx)
    engine.slow_down(delay_s)
    started = time.time()
    ctx.event(f"injected +{delay_s * 1000:.0f} ms into every engine call")
    ids: dict[str, int] = {}

    def fired() -> tuple[bool, str]:
        open_ = [a for a in ctx.api.alerts("open") if a["rule"] == "canary_latency_regression"]
        for a in open_:
            b = a["labels"].get("bucket")
            if (a["state"] == "firing" and b in ctx.labels()
                    and epoch(a["fired_at"]) >= started - 1):
                ids.setdefault(b, a["id"])
        missing = [b for b in ctx.labels() if b not in ids]
        pending = order({a["labels"].get("bucket") for a in open_ if a["state"] == "pending"})
        return not missing, (f"firing in {order(ids) or 'none'}; pending in "
                             f"{pending or 'none'}; waiting for {missing or 'none'}")

    ctx.wait_cycles("latency alert fires in every bucket", "canary_latency_regression firing for "
                    f"buckets {list(ctx.labels())}", fired, p.regression_cycles,
                    p.regression_timeout_s)
    ctx.event(f"canary_latency_regression fired in every bucket ({len(ids)} alerts)")

    def paged() -> tuple[bool, str]:
        got = {x["labels"].get("bucket")
               for _, x in ctx.receiver.alerts("canary_latency_regression", "firing")}
        missing = [b for b in ctx.labels() if b not in got]
        return not missing, f"notifications for {order(got) if got else 'none'}"

    ctx.wait_for("webhooks delivered", "a firing notification per bucket", paged, 20.0)
    engine.restore()
    ctx.event("injection stopped")

    def resolved() -> tuple[bool, str]:
        states = {a["id"]: a["state"] for a in ctx.api.alerts("all")}
        open_ = [b for b, i in ids.items() if states.get(i) != "resolved"]
        return not open_, f"still open in {order(open_) or 'none'}"

    ctx.wait_cycles("latency alerts resolve", "every latency alert of this step resolved", resolved,
                    p.regression_cycles, p.regression_timeout_s)
    ctx.event("latency back inside the band: every latency alert resolved")

    def resolved_hooks() -> tuple[bool, str]:
        got = {x["labels"].get("bucket")
               for _, x in ctx.receiver.alerts("canary_latency_regression", "resolved")}
        missing = [b for b in ctx.labels() if b not in got]
        return not missing, f"resolved notifications for {order(got) if got else 'none'}"

    ctx.wait_for("resolved webhooks delivered", "a resolved notification per bucket",
                 resolved_hooks, 20.0)
    ctx.headline = (f"+{delay_s * 1000:.0f} ms injected: canary_latency_regression fired in "
                    f"{len(ids)} buckets, resolved after the injection stopped")


def canary_agreement(ctx: StepContext) -> dict[str, float]:
    """Return bucket -> the optimized canaries' agreement with the reference (last hour)."""
    return {labels["bucket"]: value
            for labels, value in ctx.api.metric_samples("tailwatch_output_agreement_ratio")
            if labels.get("source") == "canary" and labels.get("arm") == "optimized"}


def _agreements(values: dict[str, float]) -> str:
    return ", ".join(f"{b}:{values[b]:.2f}" for b in order(values)) or "none yet"


def int8_quality(ctx: StepContext) -> None:
    """Roll a faulty int8 build out to one bucket: check the agreement alert and float32 there."""
    p = ctx.profile
    bucket = str(p.int8_bucket)
    engine, rollout = ctx.engine(), ctx.rollout()
    if engine is None or rollout is None or engine.info.quantization != "int8":
        ctx.event("no int8 weights loaded (the fake engine has none): nothing to roll out")
        ctx.headline = "skipped: the engine has no int8 path"
        return
    before = canary_agreement(ctx)
    ctx.expect("outputs agree before", f"canary agreement 1.00 in bucket {bucket}",
               before.get(bucket) == 1.0, f"agreement per bucket {_agreements(before)}")
    started = time.time()
    rollout.roll_out(bucket)
    ctx.event(f"int8 weights rolled out to bucket {bucket} only (a faulty build: the quantizer "
              "adds noise to the weights); other buckets keep float32")

    def alert() -> tuple[bool, str]:
        open_ = [a for a in ctx.api.alerts("open") if a["rule"] == "output_agreement_drop"]
        mine = [a for a in open_ if a["labels"].get("bucket") == bucket
                and a["state"] == "firing" and epoch(a["fired_at"]) >= started - 1]
        if mine:
            ctx.memo["agreement_alert"] = mine[0]
        states = ", ".join(f"{a['labels'].get('bucket')}:{a['state']}" for a in open_) or "none"
        return bool(mine), (f"agreement (last hour) {_agreements(canary_agreement(ctx))}; "
                            f"output_agreement_drop {states}")

    ctx.wait_cycles("output_agreement_drop fires", f"output_agreement_drop firing for "
                    f"bucket={bucket}, variant=optimized", alert, p.regression_cycles,
                    p.regression_timeout_s)
    a = ctx.memo["agreement_alert"]
    value = a["value"]
    ctx.event(f"output_agreement_drop fired for bucket {bucket}: the optimized canaries' "
              f"outputs agree {value:.2f} with the reference path (floor 0.99)"
              if value is not None else f"output_agreement_drop fired for bucket {bucket}")
    others = sorted(x["labels"].get("bucket") for x in firing(ctx, "output_agreement_drop")
                    if x["labels"].get("bucket") != bucket)
    ctx.expect("only that bucket alerted", "no output_agreement_drop in other buckets",
               not others, f"other buckets firing: {others or 'none'}")

    def fallback() -> tuple[bool, str]:
        body = ctx.api.flags()
        rows = [r for r in body["flags"] if r["name"] == "quantized" and r["scope"] == bucket
                and r["source"] == "auto" and r["value"] is False]
        off = sorted(b for b, v in body["effective"]["quantized"].items() if v is False)
        ok = bool(rows) and rows[0]["alert_id"] == a["id"] and off == [bucket]
        return ok, (f"quantized off in buckets {off or 'none'}; auto row alert_id "
                    f"{rows[0]['alert_id'] if rows else '-'}")

    ctx.wait_for("float32 in that bucket", f"GET /v1/flags: quantized[{bucket}]=false, source "
                 f"auto, alert {a['id']}", fallback, 30.0)
    ctx.event(f"flag quantized[{bucket}] = false (policy float32_on_agreement_drop, source "
              f"auto, alert {a['id']}): bucket {bucket} serves float32 weights again")

    def resolved() -> tuple[bool, str]:
        state = {x["id"]: x["state"] for x in ctx.api.alerts("all")}.get(a["id"])
        return state == "resolved", (f"alert {a['id']} {state}; agreement (last hour) "
                                     f"{_agreements(canary_agreement(ctx))}")

    ctx.wait_cycles("outputs agree again", f"output_agreement_drop for bucket {bucket} resolved "
                    "(its canaries match the reference again)", resolved, p.regression_cycles,
                    p.regression_timeout_s)
    ctx.event(f"bucket {bucket}'s canaries match the reference again: alert {a['id']} resolved")
    shown = f"{value:.2f}" if value is not None else "below 0.99"
    ctx.headline = (f"faulty int8 in bucket {bucket}: agreement {shown}, "
                    f"output_agreement_drop fired there only; quantized[{bucket}]=false "
                    f"(auto, alert {a['id']}); resolved on float32")


def shape_churn(ctx: StepContext) -> None:
    """Turn bucketing off, send odd lengths: check recompiles, alert and eager fallback."""
    p = ctx.profile
    before = ctx.api.metric("tailwatch_compile_recompiles_total")
    r = ctx.api.set_flag("bucketing", False,
                         reason="experiment: serve exact input shapes (no padding)")
    ctx.expect("bucketing off via the API", "PUT /v1/flags/bucketing 200", r.status_code == 200,
               f"HTTP {r.status_code} {r.text[:200]}")
    started = time.time()
    lanes = bucket_lanes(p.buckets, "in_domain", prefix="exact:")
    # Two fixed odd lengths per bucket: each is a new exact input shape to compile.
    lengths = {ln.name: (ln.min_bytes + 3, (ln.min_bytes + ln.max_bytes) // 2 + 1)
               for ln in lanes}
    ctx.traffic.set_lanes(lanes, lengths=lengths)
    ctx.event(f"operator {OPERATOR} turned bucketing off; traffic sends "
              f"{2 * len(lanes)} odd input lengths")

    def recompiles() -> tuple[bool, str]:
        now = ctx.api.metric("tailwatch_compile_recompiles_total")
        exact = sum(s.path == "exact" for s in ctx.traffic.samples(since=started))
        ctx.memo["recompiles"] = now - before
        return now > before and exact > 0, (f"{now - before:.0f} recompiles; {exact} requests "
                                            "answered with path=exact")

    seen = ctx.wait_for("recompiles counted", "tailwatch_compile_recompiles_total rises and "
                        "requests run on the exact path",
                        recompiles, p.churn_timeout_s)
    ctx.event(f"torch.compile recompiles counted: {seen}")

    def alert() -> tuple[bool, str]:
        now_firing = firing(ctx, "recompiles_per_hour")
        if now_firing:
            ctx.memo["compile_alert"] = now_firing[0]
        n = ctx.api.metric("tailwatch_compile_recompiles_total") - before
        state = "recompiles_per_hour firing" if now_firing else "no recompiles_per_hour alert yet"
        return bool(now_firing), f"{n:.0f} recompiles so far; {state}"

    ctx.wait_cycles("recompile alert fires", "recompiles_per_hour firing", alert,
                    p.regression_cycles, p.churn_timeout_s)
    a = ctx.memo["compile_alert"]

    def eager() -> tuple[bool, str]:
        rows = [r for r in ctx.api.flags()["flags"] if r["name"] == "compiled"
                and r["source"] == "auto" and r["value"] is False]
        return bool(rows) and rows[0]["alert_id"] == a["id"], (
            f"compiled auto rows: {[(r['value'], r['alert_id']) for r in rows] or 'none'}")

    ctx.wait_for("eager fallback engages", f"compiled=false, source auto, alert {a['id']}",
                 eager, 30.0)
    flipped = time.time() + 1.0
    ctx.event(f"alert recompiles_per_hour fired; flag compiled = false (source auto, "
              f"alert {a['id']})")

    def served_eager() -> tuple[bool, str]:
        paths = [s.path for s in ctx.traffic.samples(since=flipped) if s.status == 200]
        return "eager" in paths, f"paths since the flip: {sorted(set(paths)) or 'none'}"

    ctx.wait_for("requests run eager", "a request answered with path=eager", served_eager, 60.0)
    ctx.headline = (f"bucketing off: {ctx.memo['recompiles']:.0f}+ recompiles counted; "
                    f"recompiles_per_hour fired; compiled=false (auto, alert {a['id']})")


def operator_override(ctx: StepContext) -> None:
    """Override a flag as the operator (token, reason); check the audit shows the actor."""
    p = ctx.profile
    r = ctx.api.set_flag("compiled", True, reason="no token", token=None)
    ctx.expect("writes need a token", "PUT without a bearer token -> 401", r.status_code == 401,
               f"HTTP {r.status_code}")
    r = ctx.api.clear_flag("bucketing", reason="experiment over: back to bucketed shapes")
    ctx.expect("bucketing restored", "DELETE /v1/flags/bucketing 200", r.status_code == 200,
               f"HTTP {r.status_code} {r.text[:200]}")
    reason = "shape churn over (bucketing restored); compiled path verified by hand"
    r = ctx.api.set_flag("compiled", True, reason=reason)
    ctx.expect("manual override", "PUT /v1/flags/compiled 200", r.status_code == 200,
               f"HTTP {r.status_code} {r.text[:200]}")
    at = time.time()
    ctx.traffic.set_lanes(bucket_lanes(p.buckets, "in_domain"))
    ctx.event(f"{OPERATOR} set compiled=true over the automatic fallback: \"{reason}\"")
    audit = ctx.api.audit("compiled")
    newest = audit[0] if audit else {}
    ctx.expect("audit shows the actor", f"newest compiled audit row by {OPERATOR}, manual, "
               "with the reason", newest.get("actor") == OPERATOR
               and newest.get("source") == "manual" and newest.get("reason") == reason,
               f"{ {k: newest.get(k) for k in ('actor', 'source', 'action', 'reason')} }")
    auto = [x for x in audit if x["source"] == "auto"]
    ctx.event(f"GET /v1/flags/audit: {newest['action']} by {newest['actor']} "
              f"(earlier: {auto[-1]['action']} by {auto[-1]['actor']})" if auto else
              f"GET /v1/flags/audit: {newest['action']} by {newest['actor']}")
    eff = ctx.api.flags()["effective"]
    ctx.expect("override in force", "effective compiled=true, bucketing=true",
               eff.get("compiled") is True and eff.get("bucketing") is True,
               f"compiled={eff.get('compiled')} bucketing={eff.get('bucketing')}")

    def compiled() -> tuple[bool, str]:
        paths = [s.path for s in ctx.traffic.samples(since=at + 1.0) if s.status == 200]
        return "compiled" in paths, f"paths since the override: {sorted(set(paths)) or 'none'}"

    ctx.wait_for("compiled path again", "a request answered with path=compiled", compiled, 60.0)
    ctx.headline = (f"{OPERATOR} (bearer token) cleared bucketing=false and set compiled=true; "
                    "audit shows actor and reason; a request without a token got 401")


def report_section(markdown: str, title: str) -> str:
    """Return the body of the Markdown report's section `title` ("" when absent)."""
    _, found, rest = markdown.partition(f"\n## {title}\n")
    return rest.split("\n## ", 1)[0].strip() if found else ""


def ab_cycles(profile: DemoProfile) -> int:
    """Return how many A/B cycles give every bucket the pairs a confidence interval needs."""
    return -(-AB_PAIRS // profile.canaries_per_bucket)


def weekly_report(ctx: StepContext) -> None:
    """Measure each optimization with A/B cycles, then write this week's report."""
    ctx.traffic.set_lanes([])
    cycles = ab_cycles(ctx.profile)
    for n in range(1, cycles + 1):
        done = ctx.api.run_cycle(ab=True, timeout_s=AB_CLIENT_TIMEOUT_S)
        ctx.expect(f"A/B cycle {n}/{cycles}", "status ok, rows stored",
                   done["status"] == "ok" and bool(done["stored"]),
                   f"{done['status']}, stored={done['stored']}: {done.get('error') or ''}")
    measured = ctx.api.speedups()
    ctx.expect("speedups measured", "a measured speedup per optimization", bool(measured),
               f"{len(measured)} bucket x optimization rows")
    md, html = ctx.run_report()
    ctx.memo["report"] = md
    ctx.expect("report written", "markdown and HTML files", bool(md and html),
               f"{md or '-'}, {html or '-'}")
    speedups = report_section(Path(md).read_text(), SPEEDUP_SECTION)
    ctx.expect("measured speedups reported", f"rows under '{SPEEDUP_SECTION}'",
               speedups.startswith("|") and NOTHING_MEASURED not in speedups,
               speedups.splitlines()[0] if speedups else "no such section")
    ctx.event(f"{cycles} A/B cycles: {len(measured)} measured bucket x optimization speedups")
    ctx.event(f"weekly report: {md}")
    ctx.headline = f"written: {md}; speedups from {cycles} A/B cycles"


STEPS: tuple[tuple[str, str, Callable[[StepContext], None]], ...] = (
    ("warm-up and baseline",
     "Start the service, compile every bucket, start real in-domain traffic and run canary "
     "cycles until every bucket has a p50 baseline.", warm_up_and_baseline),
    ("latency regression",
     "A slowed path adds latency to every call: the relative latency alert fires in every "
     "bucket, and resolves once the slowdown is gone.", latency_regression),
    ("int8 quality in one bucket",
     "A faulty int8 build is rolled out to one bucket: its canaries' outputs stop matching "
     "the reference path, the agreement alert fires there only and the policy serves that "
     "bucket float32 weights again.", int8_quality),
    ("shape churn",
     "An operator turns bucketing off and traffic arrives in odd lengths: torch.compile "
     "recompiles, the recompile alert fires and the eager fallback engages.", shape_churn),
    ("operator override",
     "An operator ends the experiment and overrides the automatic fallback through the API "
     "with a bearer token and a reason; the audit log shows who.", operator_override),
    ("traffic shift in one bucket",
     "Once a whole minute of traffic is measured (traffic is stored per minute), one "
     "bucket's traffic moves to text the draft model never saw: acceptance falls, an alert "
     "fires, a webhook goes out, speculation turns off there only.", traffic_shift),
    ("weekly report",
     "A/B cycles measure each optimization against its fallback, then this week's "
     "assumption-review report is written from everything recorded.", weekly_report),
)
