"""Request checks every engine runs before it generates: plain functions, no torch.

The runtime and the service tests' fake engine both call these, so a test that sends
bad input sees the error the real engine answers.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.errors import InputTooLong, InvalidRequest

# No tokenizer we ship maps a token to more than this many characters.
MAX_CHARS_PER_TOKEN = 32


def check_timeout(timeout_s: float | None) -> None:
    """Raise InvalidRequest unless `timeout_s` is None or positive."""
    if timeout_s is not None and not timeout_s > 0:
        raise InvalidRequest("timeout_s", "must be > 0", value=timeout_s, limit=0)


def max_new_tokens(config: EngineConfig, value: object) -> int:
    """Return the token budget of a request: the configured default, or `value` within the cap."""
    cap = config.max_new_tokens_cap
    if value is None:
        return config.max_new_tokens
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest("max_new_tokens", "must be an integer", value=value, limit=cap)
    if not 1 <= value <= cap:
        raise InvalidRequest("max_new_tokens", f"must be between 1 and {cap}", value=value,
                             limit=cap)
    return value


def check_text(config: EngineConfig, text: object) -> str:
    """Return `text` if it is a non-blank string short enough to tokenize; raise otherwise."""
    if not isinstance(text, str):
        raise InvalidRequest("text", "must be a string", value=type(text).__name__)
    # Refused before tokenizing: a huge body must not cost a tokenizer pass.
    if len(text) > (cap := config.max_input_tokens * MAX_CHARS_PER_TOKEN):
        raise InputTooLong("text", f"{len(text)} characters is over {cap} (max_input_tokens"
                           f" x {MAX_CHARS_PER_TOKEN}), refused before tokenizing",
                           value=len(text), limit=cap)
    if not text.strip():
        raise InvalidRequest("text", "must not be empty", value=text, limit=1)
    return text


def check_input_tokens(config: EngineConfig, n: int) -> None:
    """Raise InputTooLong when a tokenized input has more than max_input_tokens tokens."""
    if n > config.max_input_tokens:
        raise InputTooLong("text", f"{n} tokens is over max_input_tokens "
                           f"{config.max_input_tokens}", value=n, limit=config.max_input_tokens)
