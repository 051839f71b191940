"""`tailwatch generate`: run one request through the engine and print the result."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import click


@click.command()
@click.argument("text", required=False)
@click.option("--max-new-tokens", type=int, default=None, help="Output tokens (default: config).")
@click.option("--model-dir", default=None, help="Local HF T5 directory (default: built-in).")
@click.option("--draft-dir", default=None,
              help="Draft for speculative decoding; its tokenizer must match the model's. "
                   "Without it a --model-dir model decodes directly.")
@click.option("--no-draft", is_flag=True, help="Do not load a draft model.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole GenerateResult as JSON.")
def generate(text: str | None, max_new_tokens: int | None, model_dir: str | None,
             draft_dir: str | None, no_draft: bool, as_json: bool) -> None:
    """Generate greedily for TEXT (or stdin) with the eager engine.

    The built-in draft pairs only with the built-in model: a --model-dir model speculates
    only with an explicit --draft-dir whose tokenizer matches.
    """
    from engine.config import EngineConfig
    from engine.errors import EngineError, InvalidRequest

    if text is None:
        text = sys.stdin.read()
    try:
        if max_new_tokens is not None and max_new_tokens <= 0:
            raise InvalidRequest("max_new_tokens", "must be >= 1", value=max_new_tokens, limit=1)
        # One request does not repay a compile: run eager.
        config = EngineConfig(model_dir=model_dir, draft_dir=draft_dir, use_draft=not no_draft,
                              compile_mode="off")
        from engine import load_engine

        engine = load_engine(config)
        try:
            result = engine.generate(text, max_new_tokens=max_new_tokens)
        finally:
            engine.close()
    except InvalidRequest as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from None
    except (EngineError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(1) from None
    if as_json:
        payload = asdict(result)
        payload["spec"]["acceptance_rate"] = result.spec.acceptance_rate
        click.echo(json.dumps(payload, indent=2))
    else:
        click.echo(result.text)
