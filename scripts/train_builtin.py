"""Train tailwatch's built-in byte-level T5 target and draft from scratch (seeded).

    python scripts/train_builtin.py --out engine/builtin

Writes <out>/target, <out>/draft (save_pretrained, safetensors, tokenizer files),
<out>/canaries/{in_domain,shifted}.txt, <out>/heldout.jsonl and <out>/metrics.json.
The target learns both domains of `engine.builtin.task`; the draft only in_domain,
so speculative acceptance collapses on shifted text. Canary and held-out inputs are
generated first and excluded from training.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from transformers import ByT5Tokenizer, GenerationConfig, T5Config, T5ForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.builtin import task  # noqa: E402

SEED = 20261130
CANARIES_PER_BUCKET = 12
HELDOUT_PER_BUCKET = 24
EVAL_TOKENS = 64  # acceptance is measured over the first 64 generated tokens
EXACT_TOKENS = 32
# Option (short_share; 0 in the shipped specs): teacher-force only the start of some
# batches, since the slow part to learn is reading the input's last word, not the chain.
SHORT_LABELS = 24
# Mostly short inputs (cheap), but long ones are where reading the last word is hardest.
TRAIN_BUCKET_WEIGHTS = (0.25, 0.2, 0.2, 0.2, 0.15)


@dataclass(frozen=True)
class ModelSpec:
    """Shape and training schedule of one model."""

    name: str
    d_model: int
    d_ff: int
    num_heads: int
    d_kv: int
    encoder_layers: int
    decoder_layers: int
    domains: tuple[str, ...]
    steps: int
    batch_size: int
    lr: float
    bf16: bool  # bf16 autocast: faster for the target on this CPU, slower for the draft
    offset_init: bool  # start each attention head looking at one fixed earlier offset
    short_share: float  # share of batches whose labels stop after SHORT_LABELS tokens


# Equal encoder/decoder depth: transformers 5 sizes generate()'s DynamicCache by
# num_layers (the encoder's), so a deeper decoder crashes generate().
TARGET = ModelSpec("target", 192, 512, 4, 48, 6, 6, task.DOMAINS, 700, 16, 2e-3, True, True, 0.0)
DRAFT = ModelSpec("draft", 128, 512, 8, 16, 1, 1, (task.IN_DOMAIN,), 800, 32, 3e-3, False, True,
                  0.0)


def make_tokenizer() -> ByT5Tokenizer:
    """Return the byte tokenizer both models share (no sentinel tokens)."""
    return ByT5Tokenizer(extra_ids=0)


def make_model(spec: ModelSpec, vocab_size: int) -> T5ForConditionalGeneration:
    """Return a randomly initialized T5 of `spec`'s shape."""
    config = T5Config(
        vocab_size=vocab_size, d_model=spec.d_model, d_ff=spec.d_ff, d_kv=spec.d_kv,
        num_heads=spec.num_heads, num_layers=spec.encoder_layers,
        num_decoder_layers=spec.decoder_layers, dropout_rate=0.0,
        feed_forward_proj="relu", tie_word_embeddings=True, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0,
    )
    model = T5ForConditionalGeneration(config)
    if spec.offset_init:
        init_offset_heads(model)
    return model


@torch.no_grad()
def init_offset_heads(model: T5ForConditionalGeneration, strength: float = 8.0) -> None:
    """Bias head h of both stacks' relative attention towards the token h+1 places back.

    A one-layer model must read the previous word through position-based attention;
    learning those peaks from a flat bias takes thousands of steps, so start from them.
    For distances below 8 (encoder) and 16 (decoder) T5's bucket index is the distance.
    """
    for stack in (model.encoder, model.decoder):
        bias = stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight
        bias.zero_()
        for head in range(bias.shape[1]):
            bias[head + 1, head] = strength


# ---------------------------------------------------------------- data


def held_out_sets(seed: int) -> tuple[dict[str, list[str]], list[dict[str, str]]]:
    """Return (canary inputs per domain, held-out examples), all distinct."""
    rng = random.Random(seed)
    seen: set[str] = set()

    def fresh(domain: str, lo: int, hi: int) -> str:
        while True:
            text = task.make_input(domain, rng, rng.randint(lo, hi))
            if text not in seen:
                seen.add(text)
                return text

    canaries = {d: [fresh(d, lo, hi) for lo, hi in task.BYTE_BUCKETS
                    for _ in range(CANARIES_PER_BUCKET)] for d in task.DOMAINS}
    heldout = [{"domain": d, "input": text, "expected": task.expected_output(text)}
               for d in task.DOMAINS for lo, hi in task.BYTE_BUCKETS
               for text in (fresh(d, lo, hi) for _ in range(HELDOUT_PER_BUCKET))]
    return canaries, heldout


def batches(spec: ModelSpec, rng: random.Random, exclude: set[str]):
    """Yield (input_ids, attention_mask, labels) batches from one input bucket each."""
    while True:
        lo, hi = rng.choices(task.BYTE_BUCKETS, weights=TRAIN_BUCKET_WEIGHTS)[0]
        pairs = []
        while len(pairs) < spec.batch_size:
            domain = rng.choice(spec.domains)
            text, out = task.make_example(domain, rng, rng.randint(lo, hi))
            if text not in exclude:
                pairs.append((text, out))
        ids, mask, labels = encode(pairs)
        if spec.short_share and rng.random() < spec.short_share:
            labels = labels[:, :SHORT_LABELS].contiguous()
        yield ids, mask, labels


def encode(pairs: list[tuple[str, str]]):
    """Return padded tensors for (input, output) pairs: bytes + 3, EOS = 1, pad = 0."""
    src = [list(a.encode()) for a, _ in pairs]
    tgt = [list(b.encode()) for _, b in pairs]
    n = max(len(s) for s in src) + 1
    m = max(len(t) for t in tgt) + 1
    ids = torch.zeros(len(pairs), n, dtype=torch.long)
    mask = torch.zeros(len(pairs), n, dtype=torch.long)
    labels = torch.full((len(pairs), m), -100, dtype=torch.long)
    for i, (s, t) in enumerate(zip(src, tgt, strict=True)):
        ids[i, : len(s) + 1] = torch.tensor([b + 3 for b in s] + [1])
        mask[i, : len(s) + 1] = 1
        labels[i, : len(t) + 1] = torch.tensor([b + 3 for b in t] + [1])
    return ids, mask, labels


# ---------------------------------------------------------------- training


def train(spec: ModelSpec, vocab_size: int, exclude: set[str], seed: int,
          log_every: int = 100, save_every: int = 0,
          on_save=None) -> tuple[T5ForConditionalGeneration, dict]:
    """Train one model and return it with its training record.

    Every `save_every` steps `on_save(model)` is called (intermediate checkpoints).
    """
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = make_model(spec, vocab_size)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98),
                            weight_decay=0.01)
    warmup = max(1, spec.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        p = (step - warmup) / max(1, spec.steps - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    start = time.perf_counter()
    losses: list[float] = []
    data = batches(spec, rng, exclude)
    for step in range(spec.steps):
        ids, mask, labels = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.bf16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % log_every == 0:
            recent = sum(losses[-log_every:]) / log_every
            print(f"[{spec.name}] step {step + 1}/{spec.steps} loss {recent:.4f} "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
        if save_every and on_save and (step + 1) % save_every == 0 and step + 1 < spec.steps:
            on_save(model)
    model.eval()
    record = {"spec": asdict(spec), "seconds": round(time.perf_counter() - start, 1),
              "final_loss": round(sum(losses[-50:]) / min(50, len(losses)), 5),
              "params": sum(p.numel() for p in model.parameters())}
    return model, record


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def greedy(model: T5ForConditionalGeneration, texts: list[str], max_new: int) -> list[list[int]]:
    """Return greedy output ids (EOS included, no start token) for each text."""
    outs = []
    for i in range(0, len(texts), 32):
        chunk = texts[i: i + 32]
        ids, mask, _ = encode([(t, "") for t in chunk])
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                             do_sample=False, num_beams=1)
        for row in gen.tolist():
            row = row[1:]
            outs.append(row[: row.index(1) + 1] if 1 in row else row)
    return outs


@torch.no_grad()
def agreement(draft: T5ForConditionalGeneration, text: str, target_ids: list[int]) -> list[bool]:
    """Return whether the draft's greedy choice equals the target's at each position."""
    ids, mask, _ = encode([(text, "")])
    dec = torch.tensor([[0] + target_ids[:-1]])
    logits = draft(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits[0]
    return [int(a) == b for a, b in zip(logits.argmax(-1).tolist(), target_ids, strict=True)]


def simulate(agree: list[bool], k: int = 4) -> tuple[int, int]:
    """Return (accepted, proposed) draft tokens of greedy speculative rounds."""
    n = len(agree)
    s = accepted = proposed = 0
    while s < n:
        run = 0
        while run < k and s + run < n and agree[s + run]:
            run += 1
        accepted += run
        proposed += k
        s += run + 1  # the target adds one token after the accepted run
    return accepted, proposed


def bucket_of(text: str) -> int:
    """Return the index of the byte bucket `text` falls in."""
    n = len(text.encode())
    return next(i for i, (lo, hi) in enumerate(task.BYTE_BUCKETS) if n <= hi)


def evaluate(target, draft, canaries: dict[str, list[str]], heldout: list[dict]) -> dict:
    """Return exact-match and acceptance metrics per domain and bucket."""
    res: dict = {"exact_match": {}, "acceptance": {}, "draft_exact_match": {}}
    for domain in task.DOMAINS:
        rows = [r for r in heldout if r["domain"] == domain]
        outs = greedy(target, [r["input"] for r in rows], EXACT_TOKENS)
        dout = greedy(draft, [r["input"] for r in rows], EXACT_TOKENS)
        for name, got in (("exact_match", outs), ("draft_exact_match", dout)):
            ok = [0] * len(task.BYTE_BUCKETS)
            tot = [0] * len(task.BYTE_BUCKETS)
            for r, o in zip(rows, got, strict=True):
                want = ([b + 3 for b in r["expected"].encode()] + [1])[:EXACT_TOKENS]
                b = bucket_of(r["input"])
                tot[b] += 1
                ok[b] += int(o[:EXACT_TOKENS] == want)
            res[name][domain] = [round(a / t, 4) for a, t in zip(ok, tot, strict=True)]
        texts = canaries[domain]
        touts = greedy(target, texts, EVAL_TOKENS)
        acc = [0] * len(task.BYTE_BUCKETS)
        prop = [0] * len(task.BYTE_BUCKETS)
        for text, tids in zip(texts, touts, strict=True):
            a, p = simulate(agreement(draft, text, tids))
            acc[bucket_of(text)] += a
            prop[bucket_of(text)] += p
        per = [round(a / p, 4) for a, p in zip(acc, prop, strict=True)]
        res["acceptance"][domain] = {"per_bucket": per, "mean": round(sum(per) / len(per), 4)}
    return res


# ---------------------------------------------------------------- cost and saving


@torch.no_grad()
def step_cost(model: T5ForConditionalGeneration, steps: int = 64, reps: int = 5) -> dict:
    """Return decoder params per step and the seconds of one cached greedy decoder step.

    The step is a plain decoder forward with a growing DynamicCache (no generate()
    overhead): what a lean decode loop pays per token.
    """
    dec_params = sum(p.numel() for p in model.decoder.parameters()) - model.shared.weight.numel()
    ids, mask, _ = encode([("ple moon warm wave silver spring garden", "")])
    enc = model.get_encoder()(input_ids=ids, attention_mask=mask)
    best = float("inf")
    for _ in range(reps):
        out = model(encoder_outputs=enc, attention_mask=mask, use_cache=True,
                    decoder_input_ids=torch.zeros(1, 1, dtype=torch.long))
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = out.logits[:, -1:].argmax(-1)
            out = model(encoder_outputs=enc, attention_mask=mask, decoder_input_ids=tok,
                        past_key_values=out.past_key_values, use_cache=True)
        best = min(best, (time.perf_counter() - t0) / steps)
    return {"decoder_params": dec_params, "step_s": best}


def save(model: T5ForConditionalGeneration, tokenizer: ByT5Tokenizer, path: Path) -> None:
    """Write weights, configs and tokenizer files to `path`."""
    path.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=0, eos_token_id=1, pad_token_id=0, do_sample=False,
        num_beams=1, max_new_tokens=32)
    # bf16 keeps both checkpoints under 20 MB; the engine upcasts to float32 on load.
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def save_copy(model: T5ForConditionalGeneration, tokenizer: ByT5Tokenizer, path: Path) -> None:
    """Save a float32 copy of a model in training, leaving it untouched."""
    save(copy.deepcopy(model).eval(), tokenizer, path)


def write_sets(out: Path, canaries: dict[str, list[str]], heldout: list[dict]) -> None:
    """Write the canary text files and heldout.jsonl."""
    (out / "canaries").mkdir(parents=True, exist_ok=True)
    for domain, texts in canaries.items():
        (out / "canaries" / f"{domain}.txt").write_text("\n".join(texts) + "\n")
    with (out / "heldout.jsonl").open("w") as fh:
        for row in heldout:
            fh.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Train both models, evaluate them and write everything under --out."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("engine/builtin"))
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target-steps", type=int, default=TARGET.steps)
    ap.add_argument("--draft-steps", type=int, default=DRAFT.steps)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--save-every", type=int, default=0,
                    help="also save an intermediate checkpoint every N steps")
    ap.add_argument("--only", choices=("target", "draft"), default=None,
                    help="train (and save) just this model, skip evaluation")
    ap.add_argument("--eval-only", action="store_true",
                    help="skip training: evaluate the models already under --out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = make_tokenizer()
    canaries, heldout = held_out_sets(args.seed)
    exclude = {t for ts in canaries.values() for t in ts} | {r["input"] for r in heldout}
    write_sets(args.out, canaries, heldout)
    records = {}
    specs = [s for s in (TARGET, DRAFT) if args.only in (None, s.name) and not args.eval_only]
    for spec in specs:
        steps = args.target_steps if spec.name == "target" else args.draft_steps
        spec = ModelSpec(**{**asdict(spec), "steps": steps})
        model, records[spec.name] = train(spec, len(tokenizer), exclude,
                                          args.seed + (0 if spec.name == "target" else 1),
                                          log_every=args.log_every,
                                          save_every=args.save_every,
                                          on_save=partial(save_copy, tokenizer=tokenizer,
                                                          path=args.out / spec.name))
        save(model, tokenizer, args.out / spec.name)
        (args.out / f"train_{spec.name}.json").write_text(json.dumps(records[spec.name]) + "\n")
    if args.only:
        return 0
    target = T5ForConditionalGeneration.from_pretrained(args.out / "target").eval()
    draft = T5ForConditionalGeneration.from_pretrained(args.out / "draft").eval()
    metrics = evaluate(target, draft, canaries, heldout)
    torch.set_num_threads(1)
    cost_t, cost_d = step_cost(target), step_cost(draft)
    metrics["cost"] = {
        "target": cost_t, "draft": cost_d,
        "param_ratio": round(cost_t["decoder_params"] / cost_d["decoder_params"], 2),
        "time_ratio": round(cost_t["step_s"] / cost_d["step_s"], 2),
    }
    metrics["training"] = records or {
        name: json.loads((args.out / f"train_{name}.json").read_text())
        for name in ("target", "draft") if (args.out / f"train_{name}.json").exists()}
    metrics["size_bytes"] = sum(p.stat().st_size for d in ("target", "draft")
                                for p in (args.out / d).iterdir())
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
